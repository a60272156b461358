"""Build of llmmem._C: the C core plus its CPython binding, and the CUDA kernels when nvcc is found.

Environment:
  LLMMEM_CUDA=1|0        force the CUDA part on (fail if nvcc is missing) or off; default: on if nvcc is found
  LLMMEM_CUDA_ARCHS      compute capabilities, default "75;80;90" (each as SASS, the last also as PTX)
  LLMMEM_WERROR=1        treat C warnings as errors (CI sets it)
  LLMMEM_DEBUG=0..3      internal checks in the C core (0 = release)
  CUDA_HOME              toolkit root, default: from nvcc on PATH, else /usr/local/cuda

The CUDA runtime is linked statically and its symbols kept private, so the module imports on a
machine with no driver and does not clash with the libcudart that torch loads. No torch headers
and no pybind11 are used: the build does not depend on the installed torch at all.
"""

from __future__ import annotations

import glob
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = os.path.dirname(os.path.abspath(__file__))


def _env_flag(name: str) -> bool | None:
    value = os.environ.get(name)
    if value is None or value == "":
        return None
    return value.lower() not in ("0", "false", "no", "off")


def _find_cuda_home() -> str | None:
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        return home
    nvcc = shutil.which("nvcc")
    if nvcc:
        return os.path.dirname(os.path.dirname(os.path.realpath(nvcc)))
    if os.path.exists("/usr/local/cuda/bin/nvcc"):
        return "/usr/local/cuda"
    return None


def _cuda_archs() -> list[str]:
    raw = os.environ.get("LLMMEM_CUDA_ARCHS", "75;80;90")
    archs = [a.strip().replace(".", "") for a in raw.replace(",", ";").split(";") if a.strip()]
    # "90a"/"100a": the architecture-specific feature sets (wgmma, ...), SASS only, no PTX promise
    if not archs or not all(re.fullmatch(r"[0-9]+a?", a) for a in archs):
        raise SystemExit(f"LLMMEM_CUDA_ARCHS: expected compute capabilities like '80;90' or '90a', got {raw!r}")
    return archs


def _rel(paths):
    return sorted(os.path.relpath(p, ROOT) for p in paths)


CUDA_HOME = _find_cuda_home()
WANT_CUDA = _env_flag("LLMMEM_CUDA")
if WANT_CUDA and CUDA_HOME is None:
    raise SystemExit("LLMMEM_CUDA=1 but nvcc was not found (set CUDA_HOME or put nvcc on PATH)")
USE_CUDA = CUDA_HOME is not None if WANT_CUDA is None else WANT_CUDA
DEBUG = int(os.environ.get("LLMMEM_DEBUG", "0") or 0)

C_SOURCES = _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*.c")))
CU_SOURCES = _rel(glob.glob(os.path.join(ROOT, "csrc", "*", "*.cu")))
# C files that only exist to stand in for the CUDA part in a CPU-only build end in _stub.c.
if USE_CUDA:
    C_SOURCES = [s for s in C_SOURCES if not s.endswith("_stub.c")]
HEADERS = _rel(
    glob.glob(os.path.join(ROOT, "csrc", "**", "*.h"), recursive=True)
    + glob.glob(os.path.join(ROOT, "csrc", "**", "*.cuh"), recursive=True)
)
INCLUDE_DIRS = ["csrc/include", "csrc/common"]

c_flags = [
    "-std=c11",
    "-O3",
    "-Wall",
    "-Wextra",
    "-Wno-missing-field-initializers",
    "-fvisibility=hidden",
    # no errno from sqrtf and no FP-exception side effects: the vector loops need both to vectorise
    # (values are unchanged: no reassociation, no contraction of separately rounded operations)
    "-fno-math-errno",
    "-fno-trapping-math",
    # every fp32 operation rounded on its own, as the C references and the CUDA kernels round it
    # (clang would otherwise fuse a * b + c inside an expression where FMA is available)
    "-ffp-contract=off",
    "-pthread",
    f"-DLLMMEM_DEBUG={DEBUG}",
]
if _env_flag("LLMMEM_WERROR"):
    c_flags.append("-Werror")
macros = []
link_args = ["-pthread", "-ldl"]  # -ldl: dlsym (the OpenMP lookup) lives in libdl before glibc 2.34
if USE_CUDA:
    ARCHS = _cuda_archs()
    arch_names = [f"sm_{a}" for a in ARCHS] + [f"compute_{ARCHS[-1]}"]
    macros.append(("LLMMEM_CUDA_ARCHS", '"' + ",".join(arch_names) + '"'))
    nvcc_version = (
        subprocess.run(
            [os.path.join(CUDA_HOME, "bin", "nvcc"), "--version"], capture_output=True, text=True, check=True
        )
        .stdout.strip()
        .splitlines()
    )
    release = next((line for line in nvcc_version if "release" in line), nvcc_version[-1])
    macros.append(("LLMMEM_NVCC_VERSION", '"' + release.replace('"', "") + '"'))
    macros.append(("LLMMEM_WITH_CUDA", "1"))
    INCLUDE_DIRS.append(os.path.join(CUDA_HOME, "include"))
    lib_dirs = [os.path.join(CUDA_HOME, d) for d in ("lib64", "lib", os.path.join("targets", "x86_64-linux", "lib"))]
    cudart_dir = next((d for d in lib_dirs if os.path.exists(os.path.join(d, "libcudart_static.a"))), None)
    if cudart_dir is None:
        raise SystemExit(
            f"nvcc found under {CUDA_HOME}, but not libcudart_static.a (looked in {', '.join(lib_dirs)}); "
            "install the CUDA runtime's static library, set CUDA_HOME, or build with LLMMEM_CUDA=0"
        )
    # --exclude-libs keeps the static runtime's symbols out of our dynamic symbol table.
    link_args += [f"-L{cudart_dir}", "-lcudart_static", "-lrt", "-lstdc++", "-Wl,--exclude-libs,ALL"]

# Only PyInit__C and llmmem_* leave the module (see the map for why -fvisibility alone is not enough).
EXPORTS_MAP = os.path.join("csrc", "exports.map")
if sys.platform.startswith("linux"):
    link_args.append(f"-Wl,--version-script={EXPORTS_MAP}")


class BuildExt(build_ext):
    """build_ext that first compiles the .cu files with nvcc (in parallel) and links their objects."""

    def build_extensions(self):
        # setuptools rebuilds only what is older than its sources, so a change of build option
        # (LLMMEM_CUDA=0 after a CUDA build in the same build/, another LLMMEM_DEBUG...) would
        # reuse the old objects. The options are stamped next to the objects; a change forces all.
        options = repr((USE_CUDA, CUDA_HOME, c_flags, macros, link_args))  # macros carry the CUDA archs
        stamp = os.path.join(self.build_temp, "llmmem-build-options.txt")
        try:
            with open(stamp) as f:
                self.force = self.force or f.read() != options
        except OSError:
            self.force = True
        super().build_extensions()
        os.makedirs(self.build_temp, exist_ok=True)
        with open(stamp, "w") as f:
            f.write(options)

    def build_extension(self, ext):
        if USE_CUDA and CU_SOURCES:
            ext.extra_objects = list(ext.extra_objects or []) + self._compile_cuda()
        super().build_extension(ext)

    def _compile_cuda(self) -> list[str]:
        nvcc = os.path.join(CUDA_HOME, "bin", "nvcc")
        gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in ARCHS]
        gencode.append(f"-gencode=arch=compute_{ARCHS[-1]},code=compute_{ARCHS[-1]}")
        flags = [
            "-O3",
            "-std=c++17",
            "-Xcompiler",
            "-fPIC,-fvisibility=hidden,-Wall",
            "--expt-relaxed-constexpr",
            # no a * b + c fused into one FMA: the kernels round every operation as their C
            # references do, and the optimizer's must equal its reference bit for bit
            "-fmad=false",
            f"-DLLMMEM_DEBUG={DEBUG}",
            "-DLLMMEM_WITH_CUDA=1",
        ] + gencode
        flags += [f"-I{os.path.join(ROOT, d)}" if not os.path.isabs(d) else f"-I{d}" for d in INCLUDE_DIRS]
        if _env_flag("LLMMEM_WERROR"):
            flags += ["-Werror=all-warnings"]
        out_dir = os.path.join(self.build_temp, "cuda")
        os.makedirs(out_dir, exist_ok=True)

        def compile_one(src: str) -> str:
            obj = os.path.join(out_dir, src.replace(os.sep, "_") + ".o")
            src_path = os.path.join(ROOT, src)
            deps = [src_path] + [os.path.join(ROOT, h) for h in HEADERS]
            if self.force or not os.path.exists(obj) or os.path.getmtime(obj) < max(map(os.path.getmtime, deps)):
                cmd = [nvcc, "-c", src_path, "-o", obj] + flags
                print(" ".join(cmd), flush=True)
                subprocess.run(cmd, check=True)
            return obj

        jobs = self.parallel if isinstance(self.parallel, int) and self.parallel > 0 else (os.cpu_count() or 1)
        with ThreadPoolExecutor(max_workers=jobs) as pool:
            return list(pool.map(compile_one, CU_SOURCES))


setup(
    ext_modules=[
        Extension(
            "llmmem._C",
            sources=C_SOURCES,
            include_dirs=INCLUDE_DIRS,
            define_macros=macros,
            extra_compile_args=c_flags,
            extra_link_args=link_args,
            # setuptools relinks only when a listed file is newer than the module: without these an
            # edit to a header or a .cu file would leave the old _C in place.
            depends=HEADERS + [EXPORTS_MAP] + (CU_SOURCES if USE_CUDA else []),
        )
    ],
    cmdclass={"build_ext": BuildExt},
)
