"""``python -m llmmem compare``: every technique on one GPT, measured, as a table, JSON and charts.

The orchestrator imports no torch: each strategy runs in a fresh worker process
(:mod:`llmmem.compare.worker`), the baseline first, since the others are measured against its peak.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import contextlib
import dataclasses
import json
import os
import queue
import subprocess
import sys
import tempfile
import threading
import time

from llmmem.compare.interrupts import Interrupted, Interrupts

__all__ = ["register_cli", "run", "run_strategy", "WorkerServer", "end_process_group"]

DESCRIPTION = """\
Train the same GPT with each memory technique of llmmem (and torch's own), every strategy in a
fresh process from the same seed on the same batches, and print one table: peak and activation
memory with their reduction against the fp32 baseline, step time and its overhead, the final loss
beside the baseline's, the largest batch that fits in the baseline's peak memory (found by running
it) and, for the parallel rows, parameters per rank and the largest model that fits per rank.
Writes results.json, results.md and two charts (memory over one step; memory saved vs overhead).

--preset finetune: the model state instead (a wide GPT over short sequences, where parameters,
gradients and Adam's moments make most of the peak, as in a full fine-tune): torch's AdamW, then
llmmem.optim's int8 moments, bf16 weights with stochastic rounding, the step in backward, and all
of them with the planner; each row's peak, bytes a parameter, step time and final loss against the
baseline's, and the largest model that fits in the baseline's peak, predicted from the row's peaks
at two depths and verified by running it.

--preset vocab: the LM head instead (a GPT with a vocabulary of 32,768 byte pairs, where the head's
logits and their gradient are the largest activations): the plain head, llmmem.patch_lm_loss (the
fused head and loss), the planner alone, and the fused head with the planner; each row's
peak, activation memory, overhead, final loss against the baseline's and largest batch.

--preset compile: the model under torch.compile (inductor): compile alone, with torch's checkpoint on
every layer, with torch's compile-time planner (torch._functorch.config.activation_memory_budget at
0.5 and 0.25) and with llmmem.auto_checkpoint at the same budgets, against the eager baseline; memory
by the rise of each worker's resident set on the CPU (a compiled graph's buffers pass no dispatch
mode), no largest-batch search."""


def register_cli(sub) -> None:
    from llmmem.compare.strategies import (
        COMPILE_STRATEGIES,
        FINETUNE_STRATEGIES,
        PRESET_FAMILIES,
        STRATEGIES,
        VOCAB_STRATEGIES,
    )

    p = sub.add_parser(
        "compare",
        help="measure what each memory technique saves on one GPT (the main job)",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--quick", action="store_true", help="a small model and few steps (CI: under 90 s on 2 cores)")
    p.add_argument(
        "--preset",
        choices=list(PRESET_FAMILIES),
        default="default",
        help="default: activation memory (checkpointing, mixed precision, parallelism); finetune: the model "
        "state (optimizer state, bf16 weights, step in backward) on a fine-tuning-shaped GPT; vocab: the LM head "
        "(llmmem.patch_lm_loss, with and without the planner) on a GPT with a 32k vocabulary; compile: "
        "checkpointing under torch.compile (llmmem's plan against activation_memory_budget). With --quick, "
        "its small version",
    )
    p.add_argument(
        "--only",
        type=_keys,
        default=None,
        metavar="KEYS",
        help="comma-separated strategies to run (the baseline always runs): "
        + ", ".join(s.key for s in STRATEGIES)
        + "; with --preset finetune: "
        + ", ".join(s.key for s in FINETUNE_STRATEGIES[1:])
        + "; with --preset vocab: "
        + ", ".join(s.key for s in VOCAB_STRATEGIES[1:])
        + "; with --preset compile: "
        + ", ".join(s.key for s in COMPILE_STRATEGIES[1:]),
    )
    p.add_argument("--out", default="llmmem-compare", help="output folder (default: ./llmmem-compare)")
    p.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda when present")
    p.add_argument("--threads", type=_positive, default=1, help="torch threads per process (default 1)")
    p.add_argument(
        "--timer",
        choices=["auto", "wall", "cpu"],
        default="auto",
        help="step time of single-process rows: wall clock, or the process's CPU time (the same on an idle "
        "machine, and steady on a shared one); auto (default): CPU time on the CPU with --threads 1, else wall "
        "clock. Parallel rows are always wall clock",
    )
    p.add_argument("--steps", type=_at_least(3), default=None, help="training steps per strategy (>= 3)")
    p.add_argument("--batch", type=_positive, default=None, help="batch size of every strategy")
    p.add_argument(
        "--jobs",
        type=_positive,
        default=None,
        help="single-process strategies run at once (default 1; 2 with --quick): more than one perturbs the timing",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--no-charts", action="store_true", help="skip the PNG charts")
    p.add_argument(
        "--resume",
        action="store_true",
        help="continue the run whose results.json is in --out (one cut short by Ctrl-C or SIGTERM): keep its "
        "measured rows and run the others; refused when its settings differ from this command's",
    )
    p.set_defaults(func=run)


def _positive(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def _at_least(low: int):
    def parse(text: str) -> int:
        value = _positive(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    return parse


def _keys(text: str) -> list[str]:
    from llmmem.compare.strategies import COMPILE_STRATEGIES, FINETUNE_STRATEGIES, STRATEGIES, VOCAB_STRATEGIES

    keys = [k.strip() for k in text.split(",") if k.strip()]
    every = STRATEGIES + FINETUNE_STRATEGIES + VOCAB_STRATEGIES + COMPILE_STRATEGIES
    known = list(dict.fromkeys(s.key for s in every))
    bad = [k for k in keys if k not in known]
    if not keys or bad:
        raise argparse.ArgumentTypeError(f"unknown strategies {bad or text!r}; choose from {', '.join(known)}")
    return keys


def _llmmem_root() -> str:
    import llmmem

    return os.path.dirname(os.path.dirname(os.path.abspath(llmmem.__file__)))


def _cuda_available(server: WorkerServer | None = None, tmp: str | None = None) -> bool:
    # asked in a child process, so that this one never imports torch (and the server never touches CUDA)
    if server is not None:
        code = server.request({"cuda_check": True, "log": os.path.join(tmp, "cuda_check.log")}, timeout=120.0)
        if code is not None:
            return code == 0
    code = "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"
    return subprocess.run([sys.executable, "-c", code], capture_output=True).returncode == 0


def _worker_env(threads: int) -> dict:
    env = dict(os.environ)
    root = _llmmem_root()
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["OMP_NUM_THREADS"] = str(threads)
    return env


class WorkerServer:
    """One ``python -m llmmem.compare.worker --serve`` process: it imports torch once and forks a fresh
    child per strategy (see :func:`llmmem.compare.worker.serve`), so a strategy costs no interpreter
    start, no ``import torch`` and no interpreter shutdown. Started in the background: the import
    overlaps whatever runs meanwhile. A request that times out kills the server and its child; the
    next request starts a new one."""

    def __init__(self, threads: int, tmp: str, interrupts: Interrupts | None = None) -> None:
        self.threads, self.tmp = threads, tmp
        self.proc = self._stderr = None
        self._pending = b""
        self._ready = False
        # start, kill and terminate may run on a row's thread and the main thread at once
        self._lock = threading.RLock()
        self._stopped = False
        self._interrupts = interrupts
        self.start()

    def start(self) -> None:
        root = _llmmem_root()
        held = self._interrupts.held() if self._interrupts is not None else contextlib.nullcontext()
        # held: a signal between the fork and `self.proc = ...` would leave a server nobody ends
        with self._lock, held:
            if self._stopped:
                raise RuntimeError("WorkerServer: terminated; it starts no new server")
            if self._stderr is not None:
                self._stderr.close()
            self._stderr = open(os.path.join(self.tmp, f"server-{id(self)}-{time.monotonic_ns()}.log"), "w+")
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "llmmem.compare.worker", "--serve"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=self._stderr,
                env=_worker_env(self.threads),
                cwd=root,  # `-m` puts the working directory first on sys.path: import this llmmem
                # its own process group, holding its children and their ranks: one signal ends them all
                start_new_session=True,
                bufsize=0,
            )
            self._pending, self._ready = b"", False

    def _readline(self, deadline: float) -> dict | None:
        """The next JSON line from the server; None at the deadline or when the server died."""
        import select

        fd = self.proc.stdout.fileno()
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        return json.loads(line)

    def request(self, job: dict, timeout: float) -> int | None:
        """Run ``job`` (see :func:`llmmem.compare.worker.serve`); the child's exit status, or None
        when it did not answer within ``timeout`` seconds (the server is then killed) or died, or
        when the server was terminated (:meth:`terminate`)."""
        if self._stopped:
            return None
        if self.proc is None or self.proc.poll() is not None:
            try:
                self.start()
            except RuntimeError:  # terminated meanwhile
                return None
        deadline = time.monotonic() + timeout
        if not self._ready:
            if self._readline(deadline) is None:
                self.kill()
                return None
            self._ready = True
        try:
            self.proc.stdin.write((json.dumps(job) + "\n").encode())
        except (BrokenPipeError, OSError):
            self.kill()
            return None
        reply = self._readline(deadline)
        if reply is None:
            self.kill()
            return None
        return int(reply["code"])

    def server_log(self) -> str:
        self._stderr.seek(0)
        return self._stderr.read()

    def kill(self) -> None:
        with self._lock:
            if self.proc is not None:
                end_process_group(self.proc, grace=0.0)
                self.proc = None

    def terminate(self, grace: float = 5.0) -> None:
        """End the server, its child and the child's ranks now (SIGTERM to its process group, up to
        ``grace`` seconds, then SIGKILL) and start none again: what an interrupted run does."""
        with self._lock:
            self._stopped = True
            if self.proc is not None:
                end_process_group(self.proc, grace=grace)
                self.proc = None
            if self._stderr is not None:
                self._stderr.close()

    def close(self) -> None:
        with self._lock:
            if self.proc is not None:
                with contextlib.suppress(OSError):
                    self.proc.stdin.close()  # the server ends at the end of its input
                end_process_group(self.proc, grace=10.0, term=False)
                self.proc = None
            if self._stderr is not None:
                self._stderr.close()


def end_process_group(proc: subprocess.Popen, grace: float, *, term: bool = True) -> None:
    """End every process of the group that ``proc`` leads (started with ``start_new_session``):
    SIGTERM (unless ``term`` is false: ``proc`` was asked to end otherwise), up to ``grace`` seconds
    for ``proc`` to exit, then SIGKILL to the group, and reap ``proc``. While ``proc`` is not reaped
    its id, and so the group's, cannot be taken by another process."""
    import signal

    pgid = proc.pid
    if term:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pgid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while proc.returncode is None and time.monotonic() < deadline:
        try:
            if os.waitid(os.P_PID, pgid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None:
                break  # exited, not reaped
        except ChildProcessError:
            break
        time.sleep(0.01)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)  # whatever of the group is left: a child, its ranks
    proc.wait()
    # the others are reparented to init as they die: wait a little for them to be gone (bounded)
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        try:
            os.killpg(pgid, 0)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(0.01)


def run_strategy(spec: dict, tmp: str, timeout: float, server: WorkerServer | None = None) -> dict:
    """Train and measure one strategy (``spec["strategy"]``) in a fresh process: a child of
    ``server`` when given, else a new interpreter (a parallel strategy: on ranks forked from a fresh
    launcher); its result dict, with ``error`` set on failure."""
    key = spec["strategy"]["key"]
    spec = dict(spec, launched_at=time.time())  # the worker reports its start-up (imports) from this
    spec_path = os.path.join(tmp, f"{key}.spec.json")
    out_path = os.path.join(tmp, f"{key}.json")
    with open(spec_path, "w") as f:
        json.dump(spec, f)
    world = spec["strategy"]["tp"] * spec["strategy"]["dp"]
    try:
        if server is not None:
            log_path = os.path.join(tmp, f"{key}.log")
            job = {"spec": spec_path, "out": out_path, "log": log_path}
            if world > 1:
                job.update(world=world, timeout=timeout)  # the ranks' own limit; the request's is a little longer
            code = server.request(job, timeout + (30.0 if world > 1 else 0.0))
            if code != 0:
                try:
                    with open(log_path) as f:
                        text = f.read()
                except OSError:
                    text = ""
                if code is None:
                    text += (
                        f"\ntimed out after {timeout:.0f} s (or the worker server died)\n"
                        + server.server_log()[-2000:]
                    )
                return _failed(spec, text or f"the worker exited with status {code}")
        elif world > 1:
            from llmmem.compare import worker_path
            from llmmem.parallel.ranks import RanksFailed, run_ranks

            try:
                run_ranks(worker_path(), "rank_main", world, args=(spec, out_path), timeout=timeout)
            except RanksFailed as exc:
                return _failed(spec, str(exc))
        else:
            root = _llmmem_root()
            proc = subprocess.run(
                [sys.executable, "-m", "llmmem.compare.worker", spec_path, out_path],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=_worker_env(spec["threads"]),
                cwd=root,  # `-m` puts the working directory first on sys.path: import this llmmem
            )
            if proc.returncode != 0:
                return _failed(spec, (proc.stderr or proc.stdout)[-4000:])
    except subprocess.TimeoutExpired:
        return _failed(spec, f"timed out after {timeout:.0f} s")
    try:
        with open(out_path) as f:
            return json.load(f)
    except (OSError, ValueError) as exc:  # a worker that exited 0 without a whole result
        return _failed(spec, f"no result from the worker: {exc}")


def _failed(spec: dict, text: str) -> dict:
    s = spec["strategy"]
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    return {
        "key": s["key"],
        "label": s["label"],
        "strategy": s,
        "world": s["tp"] * s["dp"],
        "error": lines[-1] if lines else "failed",
        "log": text,
    }


def _command(argv=None) -> str:
    """This command as typed (sys.argv of ``python -m llmmem compare ...``)."""
    argv = sys.argv if argv is None else argv
    return "python -m llmmem compare " + " ".join(argv[2:] if argv[1:2] == ["compare"] else argv[1:])


def run(args) -> int:
    """The command: checks its flags and its folder before any work, then :func:`_run` under the
    signal handlers; an interrupted run keeps the rows it has written and says how to continue."""
    from llmmem.compare import results
    from llmmem.compare.strategies import PRESETS, by_key, preset_name, strategies_of
    from llmmem.paths import check_output_folder

    family = getattr(args, "preset", "default")
    name = preset_name(family, args.quick)
    preset = PRESETS[name]
    if args.steps is not None:
        preset = dataclasses.replace(preset, steps=args.steps)
    if args.batch is not None:
        preset = dataclasses.replace(preset, batch=args.batch)
    known = strategies_of(name)
    if args.only:
        try:
            strategies = by_key(args.only, known)
        except ValueError as exc:
            quick = " --quick" if args.quick and len(known) < len(strategies_of(args.preset)) else ""
            raise ValueError(f"--only: {exc} (the rows of --preset {args.preset}{quick})") from None
    else:
        strategies = list(known)
    for s in strategies:
        if s.parallel and preset.batch % s.dp:
            raise ValueError(f"--batch {preset.batch} must be divisible by {s.key}'s data-parallel size {s.dp}")
    check_output_folder(args.out, "--out")
    # One worker at a time: two at once on two cores slow each other (shared caches, memory bandwidth,
    # or hyperthreads of one core), CPU time included. The quick run trades that for speed.
    jobs = args.jobs if args.jobs is not None else (min(2, os.cpu_count() or 1) if args.quick else 1)
    # what the rows' figures depend on: rows measured in two runs must share them (--resume)
    settings = dict(
        preset=name,
        config=dataclasses.asdict(preset),
        strategies=[s.key for s in strategies],
        device=args.device,
        threads=args.threads,
        timer=args.timer,
        jobs=jobs,
        seed=args.seed,
    )
    previous = None
    if getattr(args, "resume", False):
        previous = results.load_for_resume(args.out, settings)
    else:  # a fresh run replaces the folder's results: none of an older run stays beside its rows
        old = results.partial_rows(args.out)
        if old:
            print(
                f"note: {args.out} held an interrupted run ({old} row(s)); starting over (--resume continues one)",
                file=sys.stderr,
            )
        for name in results.OUTPUTS:
            with contextlib.suppress(FileNotFoundError):
                os.remove(os.path.join(args.out, name))
    interrupts = Interrupts()
    state = {"rows": {}, "planned": len(strategies)}
    with interrupts.installed():
        try:
            return _run(args, preset, strategies, jobs, settings, previous, interrupts, state, family)
        except Interrupted as exc:
            done = len(state["rows"])
            if done:
                where = (
                    f"{os.path.join(args.out, results.RESULTS)} holds them (partial); continue with: "
                    + _command()
                    + ("" if getattr(args, "resume", False) else " --resume")
                )
            else:
                where = "no row was finished, nothing was written"
            print(
                f"\ninterrupted by {exc.name} with {done} of {state['planned']} rows measured: {where}",
                file=sys.stderr,
                flush=True,
            )
            return 128 + exc.signum


def _run(args, preset, strategies, jobs, settings, previous, interrupts, state, family="default") -> int:
    from llmmem.compare import report, results

    t_start = time.perf_counter()
    seconds = {}  # where the orchestrator's own time goes (the workers report theirs in each row)
    timeout = 300.0 if args.quick else 900.0
    kept = results.kept_rows(previous, settings["strategies"]) if previous is not None else {}
    rows_by_key = state["rows"]
    rows_by_key.update(kept)
    with contextlib.ExitStack() as stack:
        tmp = stack.enter_context(tempfile.TemporaryDirectory(prefix="llmmem-compare-"))
        # Unwound in reverse: the servers end first (so that no row's thread waits on one), then the
        # rows' threads are joined, then the temporary folder goes.
        pool = concurrent.futures.ThreadPoolExecutor(max_workers=jobs)
        stack.callback(pool.shutdown, wait=True, cancel_futures=True)
        servers: list[WorkerServer] = []

        def end_servers(exc_type, exc, tb):
            for server in servers:
                if exc_type is None:
                    server.close()
                else:  # interrupted or failed: end their rows now
                    server.terminate()
            return False

        stack.push(end_servers)
        # Every row runs in a child forked from a server that imported torch once (a parallel row: its
        # ranks forked from that child); the servers start now, so their imports overlap each other
        # and the device check.
        with interrupts.held():  # each server is in `servers` (so ended) before a signal is raised
            for _ in range(jobs):
                servers.append(WorkerServer(args.threads, tmp, interrupts))
        idle = queue.SimpleQueue()
        for server in servers:
            idle.put(server)
        t0 = time.perf_counter()
        device = args.device
        if device != "cpu":
            cuda = _cuda_available(servers[0], tmp)
            if device == "auto":
                device = "cuda" if cuda else "cpu"
            elif not cuda:
                raise ValueError("--device cuda: torch sees no CUDA device here (use --device cpu)")
        seconds["device_check"] = round(time.perf_counter() - t0, 3)
        if previous is not None and previous.get("device") != device:
            raise ValueError(
                f"--resume: the rows in {args.out} were measured on {previous.get('device')}, this run would be "
                f"on {device} (pass --device {previous.get('device')})"
            )
        skipped = []
        if device == "cuda":
            # the parallel rows run over gloo on the CPU only; on GPUs use examples/train_gpt.py under torchrun
            skipped = [s.key for s in strategies if s.parallel]
            strategies = [s for s in strategies if not s.parallel]
        if strategies[0].key != "baseline":
            raise AssertionError("the baseline must come first")
        state["planned"] = len(strategies)
        common = dict(
            model=preset.model_config(),
            batch=preset.batch,
            steps=preset.steps,
            seed=args.seed,
            lr=preset.lr,
            threads=args.threads,
            device=device,
            search_trials=preset.search_trials,
            profile_repeats=preset.profile_repeats,
            preset=settings["preset"],
            **preset.worker_settings(),
        )
        vocab = f", vocabulary {preset.vocab_size}" if family == "vocab" else ""
        print(
            f"llmmem compare{'' if family == 'default' else ' --preset ' + family}: GPT {preset.layers} layers x "
            f"{preset.hidden} hidden, {preset.heads} heads{vocab}, "
            f"seq {preset.seq_len}, batch {preset.batch}, {preset.steps} steps per strategy, on {device} "
            f"({args.threads} thread{'s' if args.threads > 1 else ''} per process)",
            flush=True,
        )
        if kept:
            print(
                f"  resuming: {len(kept)} row(s) from {os.path.join(args.out, results.RESULTS)} "
                f"({', '.join(k for k in settings['strategies'] if k in kept)})",
                flush=True,
            )
        timer = args.timer
        if timer == "auto":
            timer = "cpu" if device == "cpu" and args.threads == 1 else "wall"
        t_strategies = time.perf_counter()
        previous_wall = float(previous.get("wall_seconds") or 0.0) if kept else 0.0
        runs = list(previous.get("runs") or []) if kept else []
        this_run = {"command": _command(), "rows": []}

        def header(partial: bool, machine: str) -> dict:
            return {
                "command": this_run["command"] if not runs else runs[0]["command"],
                "preset": settings["preset"],
                "config": settings["config"],
                "device": device,
                "machine": machine,
                "threads_per_process": args.threads,
                "timer": timer,
                "partial": partial,
                "planned": [s.key for s in strategies],
                "settings": settings,
                "runs": runs + [this_run],
                "skipped": skipped,
            }

        def save(partial: bool, extra: dict | None = None) -> None:
            """results.json and results.md as they stand: after every row, and at the end."""
            rows = [rows_by_key[s.key] for s in strategies if s.key in rows_by_key]
            report.derive(rows, timer)
            machine = _machine(device, rows_by_key["baseline"])
            this_run["wall_seconds"] = round(time.perf_counter() - t_start, 3)
            data = dict(header(partial, machine), wall_seconds=previous_wall + this_run["wall_seconds"])
            data.update(rows=rows, **(extra or {}))
            missing = [s.key for s in strategies if s.key not in rows_by_key]
            note = (
                f"Partial: {len(rows)} of {len(strategies)} rows (not yet measured: {', '.join(missing)}); "
                "`--resume` with the same flags continues it.\n\n"
                if partial
                else ""
            )
            md = (
                f"Machine: {machine}; {args.threads} torch thread(s) per process; step time: {timer}.\n\n"
                + note
                + report.markdown(rows)
                + "\n"
                + (f"\n{extra['headline']}\n" if extra and extra.get("headline") else "")
            )
            with interrupts.held():  # both files whole, in step with each other
                results.write_atomic(os.path.join(args.out, results.RESULTS), json.dumps(data, indent=1))
                results.write_atomic(os.path.join(args.out, results.TABLE), md)

        def record(row: dict) -> None:
            if interrupts.stopping:
                return  # a row cut short by the interrupt is not a result
            rows_by_key[row["key"]] = row
            this_run["rows"].append(row["key"])
            save(partial=len(rows_by_key) < len(strategies))

        done = [len(kept)]

        def run_one(s, extra):
            t0 = time.perf_counter()
            server = idle.get()
            try:
                row = run_strategy(dict(common, strategy=s.to_dict(), **extra), tmp, timeout, server)
            finally:
                if server is not None:
                    idle.put(server)
            row["wall_seconds"] = time.perf_counter() - t0
            if interrupts.stopping:
                return row
            done[0] += 1
            status = ("" if row.get("infeasible") else "error: ") + row["error"][:100] if row.get("error") else "ok"
            print(f"  [{done[0]:>2}/{len(strategies)}] {s.key:<15} {row['wall_seconds']:6.1f} s  {status}", flush=True)
            return row

        # The baseline first and alone: the others are measured against its peak and activation memory.
        if "baseline" in rows_by_key:
            baseline = rows_by_key["baseline"]
        else:
            baseline = run_one(strategies[0], {})
            if baseline.get("error"):
                print(baseline.get("log", ""), file=sys.stderr)
                print("error: the baseline failed; nothing to compare against", file=sys.stderr)
                return 1
            record(baseline)
        extra = dict(cap_bytes=baseline["peak_bytes"], baseline_activation_bytes=baseline["activation_bytes"])
        todo = [s for s in strategies[1:] if s.key not in rows_by_key]
        # Single-process rows use one core each (--threads 1): --jobs 2 runs two at a time on two cores.
        futures = [pool.submit(run_one, s, extra) for s in todo if not s.parallel]
        for future in concurrent.futures.as_completed(futures):
            record(future.result())
        while not idle.empty():  # the parallel rows run one at a time, on the first server
            idle.get()
        idle.put(servers[0])
        for server in servers[1:]:
            server.close()
        for s in todo:
            if s.parallel:  # alone: their ranks share the machine's cores
                record(run_one(s, extra))
        rows = [rows_by_key[s.key] for s in strategies]
        seconds["strategies"] = round(time.perf_counter() - t_strategies, 3)
        report.derive(rows, timer)
        machine = _machine(device, baseline)
        timelines = any(r.get("timeline") for r in rows)  # none where memory is the resident set's
        if not args.no_charts:
            t0 = time.perf_counter()
            title = (
                f"{machine}: GPT {preset.layers}x{preset.hidden}{vocab}, seq {preset.seq_len}, batch {preset.batch}"
            )
            if timelines:
                report.plot_timelines(rows, os.path.join(args.out, "memory_timeline.png"), title=title)
            report.plot_tradeoff(rows, os.path.join(args.out, "saved_vs_overhead.png"), title=title)
            seconds["charts"] = round(time.perf_counter() - t0, 3)
        # the whole command but the interpreter's start and the table, over every run of these rows
        this_run["wall_seconds"] = round(time.perf_counter() - t_start, 3)
        this_run["seconds"] = seconds
        wall = previous_wall + this_run["wall_seconds"]
        targets = report.check_preset_targets(rows, wall_seconds=wall, quick=args.quick)
        extra = dict(wall_seconds=wall, seconds=seconds, targets=targets)
        line = report.headline(rows)
        if line:
            extra["headline"] = line
        save(partial=False, extra=extra)
    text = report.table(rows)
    print()
    print(text)
    timer_text = "process CPU time" if timer == "cpu" else "wall clock"
    print(
        f"\nstep ms: median of {preset.steps - 2} steps ({timer_text}; † wall clock of the slowest rank). overhead: "
        "median ratio to an fp32 baseline step taken alternately in the same process, over the baseline row's "
        "(†: ratio of medians); ±: how far another run may put it, in points (half the width of an interval "
        "holding each median ratio with probability >= 68%, the row's and the baseline's combined; none from fewer than "
        f"{report.MIN_SPREAD_PAIRS} pairs). Memory: "
        + _memory_note(device, family)
        + "; act = peak during forward+backward less parameters, gradients, optimizer state and batch."
    )
    if any(s.key == "offload" for s in strategies) and device == "cpu":
        print("offload on the CPU moves nothing: the host is the device (the row shows llmmem.checkpoint's cost).")
    if skipped:
        print(f"skipped on {device}: {', '.join(skipped)} (parallel rows run over gloo with --device cpu)")
    if family == "finetune":
        print(
            "state B/param: what a step starts from (weights, kept gradients, optimizer state), a parameter. "
            "loss ratio: final loss over the baseline's. largest model: by depth, fitted and then run."
        )
    if family == "vocab":
        print(
            "loss ratio: final loss over the baseline's (rel. diff beside it). plan 50%: llmmem.auto_checkpoint("
            "budget=0.5), half of the row's own activation peak, planned after the patch on the fused-head rows."
        )
    if family == "compile":
        print(
            f"compiled rows: torch.compile(backend={preset.backend!r}) after checkpointing; the baseline eager. "
            "budget: llmmem.auto_checkpoint(budget=f), f of the activation peak the planner profiled eagerly, in "
            "tensor bytes; (torch): torch._functorch.config.activation_memory_budget = f. worst step rel. diff: the "
            "largest relative difference of the loss from the eager baseline's over the steps."
        )
    if extra.get("headline"):
        print("\n" + extra["headline"])
    print(
        "\ntargets (what llmmem sets out to reach here), on this run's ratios"
        + (" (the quick run: indicative only)" if args.quick else "")
        + ":"
    )
    print(report.format_targets(targets))
    print(
        f"\nwrote {args.out}/results.json, results.md"
        + ("" if args.no_charts else (", memory_timeline.png" if timelines else "") + ", saved_vs_overhead.png")
        + f" ({wall:.0f} s)"
    )
    return 1 if any(r.get("error") and not r.get("infeasible") for r in rows) else 0


def _memory_note(device: str, family: str) -> str:
    if device == "cuda":
        return "torch.cuda.max_memory_allocated"
    if family == "compile":
        # a compiled graph allocates its buffers below the dispatcher, where LiveBytes does not see them
        return (
            "the rise of the worker's resident set over the step (VmHWM reset through /proc/self/clear_refs; "
            "glibc made to map every allocation of a page or more, and to return its heap's free pages first; "
            "measured in a process of its own forked first, 3 steps, because the mapping slows steps by a page "
            "fault per new page: the step times come from the row's process, which does not map), on top of the "
            "tensor bytes of parameters, "
            "gradients, optimizer state and batch: pages written, not tensor bytes (an allocation never written "
            "is not counted), the same measure for every row, eager baseline included"
        )
    return "live tensor bytes (llmmem LiveBytes)"


def _machine(device: str, baseline: dict) -> str:
    if device == "cuda":
        return baseline.get("device_name") or "cuda"  # as the baseline's worker saw it
    name = ""
    try:
        with open("/proc/cpuinfo") as f:
            name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), "")
    except OSError:
        pass
    return f"{name or 'CPU'}, {os.cpu_count()} cores"
