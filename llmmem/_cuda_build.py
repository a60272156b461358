"""Whether this build's CUDA kernels can run on a GPU: compiled in, a runtime that talks to the
driver, and an architecture the build covers. Shared by the concerns with CUDA kernels (amp,
optim), each of which adds its own known-answer self-check on top."""

from __future__ import annotations

from typing import Optional

import torch

from llmmem._native import available, native

_built: Optional[bool] = None


def cuda_kernels_built() -> bool:
    """True when this llmmem was compiled with its CUDA kernels (no GPU needed to answer)."""
    global _built
    if _built is None:
        _built = bool(available() and native.build_info()["cuda_built"])
    return _built


def archs_cover(cuda_archs: str, capability: tuple[int, int]) -> bool:
    """Whether a build for ``cuda_archs`` (build_info()'s "sm_80,sm_90,compute_90") runs on a GPU of
    compute ``capability``: SASS for the same major version and a minor one not above it (sm_80
    code runs on sm_86/sm_89; SASS never crosses majors), or PTX for an arch not above it, which
    the driver compiles at load time."""
    cc = capability[0] * 10 + capability[1]
    for name in (a.strip() for a in cuda_archs.split(",")):
        kind, _, num = name.partition("_")
        if not num.isdigit():  # e.g. sm_90a: arch-specific code runs on that exact GPU only
            if kind == "sm" and num.rstrip("af").isdigit() and int(num.rstrip("af")) == cc:
                return True
            continue
        arch = int(num)
        if kind == "sm" and arch // 10 == cc // 10 and arch <= cc:
            return True
        if kind == "compute" and arch <= cc:
            return True
    return False


def build_problem(index: int) -> Optional[str]:
    """None when the build's kernels can be launched on GPU ``index``, else why not: a build with
    CUDA can still be unable to, when its static runtime does not talk to the installed driver or
    the GPU's architecture is missing from the build (every launch would then fail)."""
    if not cuda_kernels_built():
        return "llmmem was built without its CUDA kernels"
    try:
        count = native.cuda_device_count()
    except Exception as e:
        return f"llmmem's CUDA runtime cannot use the GPUs ({type(e).__name__}: {e})"
    if index >= count:
        return f"llmmem's CUDA runtime sees {count} GPU(s), not cuda:{index}"
    archs = str(native.build_info().get("cuda_archs") or "")
    major, minor = torch.cuda.get_device_capability(index)
    if not archs_cover(archs, (major, minor)):
        return (
            f"llmmem's CUDA kernels were built for {archs or 'no architecture'}, which does not "
            f"cover cuda:{index} (sm_{major}{minor}); rebuild with LLMMEM_CUDA_ARCHS including {major}{minor}"
        )
    return None
