"""``python -m llmmem info``: what this llmmem was built with, what it finds, what it can do.

Everything here is read at the time of the call, never cached at import, and every probe is
guarded: a diagnostic must work on the machines where something is broken.
"""

from __future__ import annotations

import importlib
import platform
import sys

import llmmem
from llmmem._native import available, load_error, native


def _probe_native() -> dict:
    if not available():
        return {"loaded": False, "error": repr(load_error)}
    info = {
        "loaded": True,
        "version": native.version(),
        "path": getattr(native, "__file__", "?"),
        "scaler_cpu_workers": native.scaler_cpu_workers(),
    }
    info.update(native.build_info())
    try:
        info["driver_version"] = native.cuda_driver_version()
    except native.LlmmemError as exc:
        info["driver_version"] = None
        info["driver_error"] = str(exc)
    try:
        info["device_count"] = native.cuda_device_count()
    except native.LlmmemError as exc:
        info["device_count"] = 0
        info["device_error"] = str(exc)
    return info


def _probe_torch() -> dict:
    try:
        import torch
    except Exception as exc:
        return {"imported": False, "error": repr(exc)}
    info = {"imported": True, "version": torch.__version__, "cuda_version": torch.version.cuda}
    try:
        info["cuda_available"] = torch.cuda.is_available()
        info["devices"] = (
            [
                f"{i}: {torch.cuda.get_device_name(i)} ({torch.cuda.get_device_properties(i).total_memory / 2**30:.0f} GiB)"
                for i in range(torch.cuda.device_count())
            ]
            if info["cuda_available"]
            else []
        )
    except Exception as exc:
        info["cuda_available"] = False
        info["devices"] = []
        info["cuda_error"] = repr(exc)
    try:
        import torch.distributed as dist

        info["distributed"] = dist.is_available()
        info["nccl"] = bool(dist.is_available() and dist.is_nccl_available())
        info["gloo"] = bool(dist.is_available() and dist.is_gloo_available())
    except Exception as exc:
        info.update(distributed=False, nccl=False, gloo=False, distributed_error=repr(exc))
    info["mempool"] = hasattr(torch.cuda, "MemPool")
    # as a training process does before unscale_: torch sets its OpenMP threads up here
    info["num_threads"] = torch.get_num_threads()
    return info


def _features(nat: dict, tor: dict) -> list[tuple[str, bool, str]]:
    """(feature, usable now, why) for each capability of llmmem."""
    gpu = bool(nat.get("device_count")) and bool(tor.get("cuda_available"))
    feats = [("memory estimator", True, "pure Python; no torch or GPU needed by name")]
    feats.append(("C core (llmmem._C)", nat["loaded"], "loaded" if nat["loaded"] else nat.get("error", "")))
    feats.append(("torch integration", tor["imported"], tor.get("version", tor.get("error", ""))))
    if nat["loaded"] and nat["cuda_built"]:
        why = (
            "GPU found"
            if gpu
            else "CUDA kernels built, but no usable GPU here: "
            + (nat.get("device_error") or tor.get("cuda_error") or "torch sees no CUDA device")
        )
        feats.append(("CUDA kernels", gpu, why))
    else:
        feats.append(("CUDA kernels", False, "not built (CPU-only build)"))
    for name, module in _FEATURE_MODULES:
        feats.append((name, *_feature_status(module)))
    return feats


# Each feature module reports on itself through `feature_status() -> (usable, detail)`.
_FEATURE_MODULES = (
    ("activation checkpointing + planner", "llmmem.checkpointing"),
    ("GradScaler", "llmmem.amp"),
    ("memory pool", "llmmem.pool"),
    ("tensor parallelism", "llmmem.parallel"),
    ("optimizer (llmmem.optim)", "llmmem.optim"),
)


def _feature_status(module: str) -> tuple[bool, str]:
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if exc.name == module:
            return False, "not implemented in this version"
        return False, f"cannot import {module}: {exc!r}"
    except Exception as exc:
        return False, f"cannot import {module}: {exc!r}"
    status = getattr(mod, "feature_status", None)
    if status is None:
        return True, "available"
    try:
        usable, detail = status()
    except Exception as exc:
        return False, f"{module}.feature_status() failed: {exc!r}"
    return bool(usable), str(detail)


def collect() -> dict:
    """All diagnostics as a dict (what ``info`` prints)."""
    tor = _probe_torch()  # first: importing torch loads the OpenMP runtime the native probe reports on
    nat = _probe_native()
    return {
        "llmmem": {"version": llmmem.__version__, "path": llmmem.__file__},
        "python": {"version": sys.version.split()[0], "platform": platform.platform()},
        "native": nat,
        "torch": tor,
        "features": [{"name": n, "usable": u, "detail": d} for n, u, d in _features(nat, tor)],
    }


def info() -> str:
    """A readable report of the build and the run-time environment (see ``python -m llmmem info``)."""
    d = collect()
    nat, tor = d["native"], d["torch"]
    yes = {True: "yes", False: "no"}
    lines = [
        f"llmmem {d['llmmem']['version']}  ({d['llmmem']['path']})",
        f"python {d['python']['version']} on {d['python']['platform']}",
        "",
        "build:",
    ]
    if nat["loaded"]:
        lines.append(f"  C core         {nat['version']}, {nat['c_compiler']}, debug level {nat['debug_level']}")
        if nat["cuda_built"]:
            v = nat["cuda_runtime_version"]
            lines.append(
                f"  CUDA           yes: runtime {v // 1000}.{v % 1000 // 10} (static), archs {nat['cuda_archs']}"
            )
            lines.append(f"  nvcc           {nat['cuda_compiler']}")
        else:
            lines.append("  CUDA           no (CPU-only build)")
    else:
        lines.append(f"  C core         NOT LOADED: {nat['error']}")
    lines += ["", "run time:"]
    if nat["loaded"] and nat["cuda_built"]:
        if nat.get("driver_version"):
            dv = nat["driver_version"]
            lines.append(f"  CUDA driver    {dv // 1000}.{dv % 1000 // 10}")
        else:
            lines.append(f"  CUDA driver    none ({nat.get('driver_error', '')})")
        lines.append(
            f"  GPUs (llmmem)  {nat['device_count']}"
            + (f"  ({nat['device_error']})" if nat.get("device_error") else "")
        )
    if nat["loaded"]:
        workers = {"openmp": "the process's OpenMP team (torch's threads)", "own": "threads of llmmem's own"}
        lines.append(f"  CPU unscale    {workers[nat['scaler_cpu_workers']]}")
    if tor["imported"]:
        lines.append(f"  torch          {tor['version']} (built for CUDA {tor['cuda_version']})")
        lines.append(
            f"  torch CUDA     {yes[tor['cuda_available']]}"
            + "".join(f"\n                 {x}" for x in tor["devices"])
        )
        lines.append(f"  distributed    {yes[tor['distributed']]}: NCCL {yes[tor['nccl']]}, gloo {yes[tor['gloo']]}")
        lines.append(f"  torch MemPool  {yes[tor['mempool']]}")
    else:
        lines.append(f"  torch          NOT IMPORTABLE: {tor['error']}")
    lines += ["", "features:"]
    for f in d["features"]:
        lines.append(f"  [{'x' if f['usable'] else ' '}] {f['name']:<36} {f['detail']}")
    return "\n".join(lines)


def register_cli(subparsers) -> None:
    p = subparsers.add_parser("info", help="what was built, what is found at run time, what is usable")
    p.add_argument("--json", action="store_true", help="print the diagnostics as JSON")
    p.set_defaults(func=_run_cli)


def _run_cli(args) -> int:
    if args.json:
        import json

        print(json.dumps(collect(), indent=2, default=str))
    else:
        print(info())
    return 0
