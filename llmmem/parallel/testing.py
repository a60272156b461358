"""Run a function on several local ranks (gloo on CPU), for tests, examples and benchmarks.

``run_ranks(path, "fn", world_size)`` starts ``world_size`` fresh Python processes; each joins a
gloo process group (a file store in a temporary folder, so no port is needed), loads the file at
``path`` and calls ``fn(rank, world_size, *args)``. The function is found by file path, so test
files that are not importable as modules work. Every run has a wall-clock timeout; when one rank
fails the others get a short grace period and are then killed, so a bug cannot hang the caller
and no process is left behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass


@dataclass
class RankResult:
    rank: int
    returncode: int | None   # None: killed by us after the timeout / grace period
    output: str              # stdout and stderr, interleaved


class RanksFailed(AssertionError):
    """Some rank exited with an unexpected status (the message has every rank's output)."""


def _report(results: list[RankResult]) -> str:
    return "\n".join(f"--- rank {r.rank} (exit {r.returncode}) ---\n{r.output[-6000:]}" for r in results)


def run_ranks(path: str, fn: str, world_size: int, *, args: tuple = (), timeout: float = 90.0,
              env: dict | None = None, expect: dict[int, int] | None = None, grace: float = 10.0,
              check: bool = True) -> list[RankResult]:
    """Run ``fn(rank, world_size, *args)`` from file ``path`` on ``world_size`` gloo ranks.

    :param args: JSON-serialisable extra arguments.
    :param expect: rank -> expected exit code (default 0 for every rank); a negative code is a signal.
    :param check: raise :class:`RanksFailed` when an exit code is not the expected one.
    """
    if not isinstance(world_size, int) or world_size <= 0:
        raise ValueError(f"run_ranks: world_size must be a positive int, got {world_size!r}")
    import llmmem

    root = os.path.dirname(os.path.dirname(os.path.abspath(llmmem.__file__)))
    child_env = dict(os.environ)
    child_env["PYTHONPATH"] = root + (os.pathsep + child_env["PYTHONPATH"] if child_env.get("PYTHONPATH") else "")
    # one thread per rank: the ranks share the machine's cores with each other
    child_env.setdefault("OMP_NUM_THREADS", "1")
    child_env.update(env or {})
    expect = expect or {}
    with tempfile.TemporaryDirectory(prefix="llmmem-ranks-") as tmp:
        procs, logs = [], []
        for rank in range(world_size):
            log = open(os.path.join(tmp, f"rank{rank}.log"), "w+")
            cmd = [sys.executable, "-m", "llmmem.parallel.testing", "--file", os.path.abspath(path), "--fn", fn,
                   "--rank", str(rank), "--world-size", str(world_size), "--store", os.path.join(tmp, "store"),
                   "--args", json.dumps(list(args)), "--timeout", str(timeout)]
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env))
            logs.append(log)
        deadline = time.monotonic() + timeout
        first_failure = None
        codes: list[int | None] = [None] * world_size
        try:
            while any(c is None for c in codes):
                now = time.monotonic()
                for i, p in enumerate(procs):
                    if codes[i] is None and p.poll() is not None:
                        codes[i] = p.returncode
                        if p.returncode != expect.get(i, 0) and first_failure is None:
                            first_failure = now
                if now > deadline or (first_failure is not None and now > first_failure + grace):
                    break
                time.sleep(0.02)
        finally:
            for i, p in enumerate(procs):
                if p.poll() is None:
                    p.kill()
                    p.wait()
                    codes[i] = None
                elif codes[i] is None:
                    codes[i] = p.returncode
        results = []
        for i, log in enumerate(logs):
            log.seek(0)
            results.append(RankResult(i, codes[i], log.read()))
            log.close()
    if check and any(r.returncode != expect.get(r.rank, 0) for r in results):
        timed_out = any(r.returncode is None for r in results)
        raise RanksFailed(("timed out after %.0f s; " % timeout if timed_out else "") +
                          f"{fn} failed on some rank:\n{_report(results)}")
    return results


def _child(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--file", required=True)
    p.add_argument("--fn", required=True)
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--store", required=True)
    p.add_argument("--args", default="[]")
    p.add_argument("--timeout", type=float, default=90.0)
    a = p.parse_args(argv)
    import datetime

    import torch.distributed as dist

    spec = importlib.util.spec_from_file_location("_llmmem_rank_module", a.file)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    dist.init_process_group("gloo", init_method=f"file://{a.store}", rank=a.rank, world_size=a.world_size,
                            timeout=datetime.timedelta(seconds=a.timeout))
    try:
        getattr(module, a.fn)(a.rank, a.world_size, *json.loads(a.args))
    finally:
        from llmmem.parallel import collectives

        collectives.close_all()
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(_child(sys.argv[1:]))
