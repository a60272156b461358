"""Run a function on several local ranks (gloo on CPU): compare's parallel rows, tests and benchmarks.

``run_ranks(path, "fn", world_size)`` starts one launcher process that imports torch and the file
at ``path`` once, then forks ``world_size`` ranks from it (a fresh ``import torch`` per rank costs
seconds of CPU; a fork costs milliseconds). Each rank joins a gloo process group (a file store in
a temporary folder, so no port is needed) and calls ``fn(rank, world_size, *args)``. The function
is found by file path, so test files that are not importable modules work.

Every run has a wall-clock timeout. When a rank fails, the others get a short grace period and
are then killed; on timeout the whole process group of the launcher is killed. So a bug cannot
hang the caller and no process is left behind.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass


@dataclass
class RankResult:
    rank: int
    returncode: int | None  # negative: killed by that signal; None: killed by us (timeout or grace)
    output: str  # the rank's stdout and stderr, interleaved


class RanksFailed(AssertionError):
    """Some rank exited with an unexpected status (the message has every rank's output)."""


def _report(results: list[RankResult]) -> str:
    def status(code):
        return "killed: timeout, or another rank failed first" if code is None else f"exit {code}"

    return "\n".join(f"--- rank {r.rank} ({status(r.returncode)}) ---\n{r.output[-6000:]}" for r in results)


def run_ranks(
    path: str,
    fn: str,
    world_size: int,
    *,
    args: tuple = (),
    timeout: float = 90.0,
    env: dict | None = None,
    expect: dict[int, int] | None = None,
    grace: float = 10.0,
    check: bool = True,
) -> list[RankResult]:
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
    child_env.setdefault("OMP_NUM_THREADS", "1")  # the ranks share the machine's cores
    child_env.update(env or {})
    expect = {int(k): v for k, v in (expect or {}).items()}
    with tempfile.TemporaryDirectory(prefix="llmmem-ranks-") as tmp:
        cmd = [
            sys.executable,
            "-m",
            "llmmem.parallel.ranks",
            "--file",
            os.path.abspath(path),
            "--fn",
            fn,
            "--world-size",
            str(world_size),
            "--dir",
            tmp,
            "--args",
            json.dumps(list(args)),
            "--timeout",
            str(timeout),
            "--grace",
            str(grace),
            "--expect",
            json.dumps(expect),
        ]
        with open(os.path.join(tmp, "launcher.log"), "w+") as log:
            # cwd=root: `python -m` puts the working directory first on sys.path, and the ranks must
            # import the same llmmem as the caller (not a source checkout the caller happens to be in).
            launcher = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env, start_new_session=True, cwd=root
            )
            try:
                launcher.wait(timeout=timeout + grace + 30)
            except subprocess.TimeoutExpired:
                pass
            finally:
                # the launcher leads its own process group: this also reaps any rank still running
                try:
                    os.killpg(launcher.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                launcher.wait()
            log.seek(0)
            launcher_out = log.read()
        codes = {}
        status_path = os.path.join(tmp, "status.json")
        if os.path.exists(status_path):
            with open(status_path) as f:
                codes = {int(k): v for k, v in json.load(f).items()}
        results = []
        for r in range(world_size):
            p = os.path.join(tmp, f"rank{r}.log")
            text = open(p).read() if os.path.exists(p) else ""
            results.append(RankResult(r, codes.get(r), text))
    if check and (any(r.returncode != expect.get(r.rank, 0) for r in results) or launcher.returncode != 0):
        raise RanksFailed(
            f"{fn} failed on some rank (launcher exit {launcher.returncode}):\n"
            f"{launcher_out[-3000:]}\n{_report(results)}"
        )
    return results


def _rank_main(module, fn: str, rank: int, world: int, store: str, args: list, timeout: float) -> None:
    import datetime

    import torch.distributed as dist

    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=world, timeout=datetime.timedelta(seconds=timeout)
    )
    try:
        getattr(module, fn)(rank, world, *args)
    finally:
        from llmmem.parallel import collectives

        collectives.close_all()
        # torch 2.5.1's gloo shutdown (destroy_process_group -> _shutdown_backend) hangs, holding
        # the GIL, in about one run in three of test_parallel_comm, with a barrier before it or not;
        # 2.11's does not (versions between: not tried). The rank exits right after this anyway.
        import torch

        if not torch.__version__.startswith("2.5.") and dist.is_initialized():  # fn may have destroyed it
            dist.destroy_process_group()


def _launch(argv: list[str]) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--file", required=True)
    p.add_argument("--fn", required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--args", default="[]")
    p.add_argument("--timeout", type=float, default=90.0)
    p.add_argument("--grace", type=float, default=10.0)
    p.add_argument("--expect", default="{}")
    a = p.parse_args(argv)
    expect = {int(k): v for k, v in json.loads(a.expect).items()}
    import torch  # noqa: F401 - imported once here, inherited by every forked rank

    fork_ranks(a.file, a.fn, a.world_size, a.dir, json.loads(a.args), timeout=a.timeout, grace=a.grace, expect=expect)
    return 0


def fork_ranks(
    path: str,
    fn: str,
    world_size: int,
    folder: str,
    args: list,
    *,
    timeout: float = 90.0,
    grace: float = 10.0,
    expect: dict[int, int] | None = None,
) -> dict[int, int | None]:
    """Fork ``world_size`` ranks from this process, each joining a gloo group (a file store in
    ``folder``) and calling ``fn(rank, world_size, *args)`` from file ``path``, its output in
    ``folder/rank{r}.log``; wait for them (the others get ``grace`` seconds after a rank fails, all
    are killed after ``timeout``). Returns rank -> exit code (None: killed), also written to
    ``folder/status.json``. What :func:`run_ranks`'s launcher runs; a process that has imported
    torch already calls it to save the launcher's start; it must not have run torch operators on
    several intra-op threads nor initialised CUDA (neither survives a fork)."""
    expect = expect or {}
    spec = importlib.util.spec_from_file_location("_llmmem_rank_module", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    store = os.path.join(folder, "store")
    a = argparse.Namespace(dir=folder, fn=fn, timeout=timeout, grace=grace, world_size=world_size)
    pids = {}
    for rank in range(a.world_size):
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                fd = os.open(os.path.join(a.dir, f"rank{rank}.log"), os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                _rank_main(module, a.fn, rank, a.world_size, store, args, a.timeout)
                code = 0
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids[pid] = rank
    codes: dict[int, int | None] = {}
    deadline = time.monotonic() + a.timeout
    kill_at = None
    while len(codes) < len(pids):
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid in pids:
            rank = pids[pid]
            codes[rank] = os.waitstatus_to_exitcode(status)
            if codes[rank] != expect.get(rank, 0) and kill_at is None:
                kill_at = time.monotonic() + a.grace
            continue
        now = time.monotonic()
        if now > deadline or (kill_at is not None and now > kill_at):
            for pid, rank in pids.items():
                if rank not in codes:
                    os.kill(pid, signal.SIGKILL)
                    os.waitpid(pid, 0)
                    codes[rank] = None
            break
        time.sleep(0.01)
    with open(os.path.join(a.dir, "status.json"), "w") as f:
        json.dump(codes, f)
    return codes


if __name__ == "__main__":
    sys.exit(_launch(sys.argv[1:]))
