"""One strategy of ``python -m llmmem compare``, trained and measured in a fresh process.

Single-process strategies: ``python -m llmmem.compare.worker SPEC.json OUT.json``. Parallel ones run
:func:`rank_main` on ``tp * dp`` gloo ranks forked from one launcher process
(:func:`llmmem.parallel.ranks.run_ranks`); rank 0 writes ``OUT.json``. As ``python -m llmmem
compare`` runs them, both start from a server that imported torch once (``--serve``, :func:`serve`):
a single-process strategy is a child forked from it, a parallel one a child that forks the ranks.

What a run does, for every strategy alike: build the GPT from the seed, train ``steps`` steps on the
same batches (the first warms up and creates the optimizer state, the middle ones are timed, the
last runs under :class:`~llmmem.diagnostics.live.LiveBytes` for the memory figures and the timeline),
then search, by running steps, for the largest batch (single process) or the largest model (parallel
rows) whose peak fits in the baseline's peak. See :mod:`llmmem.compare.measure` for what is measured.
The rows of the model-state presets (``--preset finetune``) run :mod:`llmmem.compare.finetune`; the
LM-head preset's (``--preset vocab``) run here, on byte-pair tokens, their head fused first where the
strategy says so (:func:`llmmem.compare.training.install_techniques`). The compiled preset's
(``--preset compile``) run here too, compiled after their checkpointing, their last step measured
without a dispatch mode (:func:`llmmem.compare.measure.resident_step`), and search nothing.
What a row is built from (trainer, optimizer, planner) is in :mod:`llmmem.compare.training`.
"""

from __future__ import annotations

import json
import os
import sys

import torch

import llmmem
from llmmem.compare import finetune, measure
from llmmem.compare.corpus import BatchSampler
from llmmem.compare.sharding import local_bytes, shard_over, state_bytes
from llmmem.compare.strategies import Strategy
from llmmem.compare.training import (
    PhaseClock,
    Trainer,
    compiled,
    corpus_tokens,
    install_techniques,
    make_optimizer,
    pick_device,
    plan_budget,
    reference_trainer,
    row_header,
)
from llmmem.models.gpt import GPT, GPTConfig

__all__ = ["run_single", "rank_main", "main"]


# ------------------------------------------------------------------------------------------------
# Single process

# What a row's memory pass measures (measure.resident_step), taken over by its timed pass.
RESIDENT_KEYS = ("memory", "peak_bytes", "start_bytes", "activation_bytes", "peak_rise_bytes", "resident_start_bytes")


def _memory_pass(spec: dict) -> dict:
    """A row measured by the rise of the resident set on the CPU, measured apart: glibc made to map
    every allocation of a page or more (:func:`llmmem.compare.measure.unmap_large_frees`) slows
    steps by a page fault per new page, more where a step makes more tensors (a plan's compiled
    blocks run between graphs, a graph reuses its buffers), so the row's memory comes from a child
    forked first that sets it, warms up and measures one step, and its step times from this
    process, which does not. Returns the child's result. (The child plans and compiles again; a
    row that searched a largest batch would take its cap from the child and its trials from here:
    the rows measured this way, the compiled preset's, search none.)

    :raises RuntimeError: when the child fails, with its error."""
    read, write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        # the child never returns into the row it was forked from, whatever fails
        try:
            os.close(read)
            try:
                out = run_single({**spec, "pass": "memory", "steps": 3})
            except BaseException:
                import traceback

                out = {"error": traceback.format_exc()}
            with os.fdopen(write, "w") as f:
                json.dump(out, f, default=repr)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        text = f.read()
    os.waitpid(pid, 0)
    out = json.loads(text) if text else {"error": "the memory pass died without a result"}
    if "error" in out and "peak_bytes" not in out and not out.get("infeasible"):
        raise RuntimeError(f"the row's memory pass failed: {out['error']}")
    return out


def run_single(spec: dict) -> dict:
    """One single-process row: trained, measured, and its largest batch searched; a row of the
    model-state presets (``spec["search"] == "model"``) searches the largest model instead
    (:func:`llmmem.compare.finetune.run_row`)."""
    if spec.get("search") == "model":
        return finetune.run_row(spec)
    clock = PhaseClock(spec)
    strategy = Strategy(**spec["strategy"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    device = pick_device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    memory = spec.get("memory", "live")
    apart = None
    if memory == "resident" and device.type == "cpu":
        if spec.get("pass") == "memory":
            measure.unmap_large_frees()  # before the model is built: every later large free is seen
        else:
            apart = _memory_pass(spec)
    seed, batch, steps = spec["seed"], spec["batch"], spec["steps"]
    cfg = GPTConfig(**spec["model"])
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    tokens = corpus_tokens(spec.get("tokens", "bytes"))
    sampler = BatchSampler(tokens, batch, cfg.seq_len, seed=seed)
    result = row_header(spec, strategy, device, model.num_parameters(), model.num_parameters())
    result["seconds"] = clock.seconds
    result["parent_pid"] = os.getppid()  # the worker server's, when the row was forked from it
    clock.lap("build")
    sample = BatchSampler(tokens, batch, cfg.seq_len, seed=seed + 1).next_batch()  # the planner's, apart
    try:
        planned = install_techniques(model, strategy, spec, device, sample)
    except llmmem.InfeasibleError as exc:
        # a result, not a failure: the planner says what the least feasible budget is
        budget = plan_budget(strategy, spec)
        result["error"] = f"infeasible: {exc}"
        result["infeasible"] = True
        result["plan"] = {"budget_fraction": budget} if isinstance(budget, float) else {"budget_bytes": budget}
        result["plan"]["least_budget_bytes"] = getattr(exc, "min_budget_bytes", None)
        result["plan"]["no_checkpoint_peak_bytes"] = getattr(exc, "no_checkpoint_peak_bytes", None)
        clock.lap("plan")
        return result
    if planned is not None:
        clock.lap("plan")
    # the optimizer holds the parameters themselves; the trainer calls the compiled model, if any
    trainer = Trainer(
        compiled(model, strategy, spec), make_optimizer(model.parameters(), spec["lr"]), strategy, device
    )

    def batches():
        x, y = sampler.next_batch()
        return x.to(device), y.to(device)

    # Only train_and_measure holds the reference, so that it is freed before the measured step.
    result.update(
        measure.train_and_measure(
            trainer, batches, steps, device, reference=reference_trainer(cfg, spec, device), memory=memory
        )
    )
    if apart is not None and "peak_bytes" in apart:
        result.update({k: apart[k] for k in RESIDENT_KEYS if k in apart})
        result["memory_apart"] = True
    result["state_bytes"] = state_bytes(model, trainer.optimizer)
    clock.lap("train")
    if planned is not None:
        result["plan"] = planned.describe()
    if strategy.checkpoint == "torch-budget":
        result["plan"] = {"budget_fraction": strategy.budget_fraction, "by": "activation_memory_budget"}
    if spec.get("search") == "none":
        return result

    cap = spec.get("cap_bytes") or result["peak_bytes"]
    trial_sampler = BatchSampler(tokens, batch, cfg.seq_len, seed=seed + 2)
    x_bytes = 2 * batch * cfg.seq_len * 8  # the batch's inputs and targets (int64)

    def peak_at(b: int) -> int | None:
        x, y = trial_sampler.next_batch(b)
        x, y = x.to(device), y.to(device)
        if planned is not None:
            # at a larger batch the planner is given the baseline's whole memory: the activation peak
            # it may use is the cap less this strategy's parameters, gradients, optimizer state and batch
            try:
                planned.install(cap - result["start_bytes"], x, y)
            except llmmem.InfeasibleError:
                return None  # no plan fits: counts as not fitting
        return measure.measured_step(trainer, x, y, device)["peak_bytes"]

    first = None
    if planned is not None:
        # A plan uses the budget it is given, so its peak is not linear in the batch: start from the
        # batch at which the planner's least feasible budget (proportional to the batch) reaches the
        # cap, then its neighbour, then bisect.
        first = int((cap - result["start_bytes"]) // planned.least_budget_per_sample(batch))
    result["search"] = measure.search_largest(
        peak_at,
        start=batch,
        start_peak=result["peak_bytes"],
        cap=cap,
        trials=spec["search_trials"],
        kind="batch",
        first=first,
        linear=planned is None,
        # what the step holds at batch 0: parameters, gradients, optimizer state (less the batch itself)
        intercept=result["start_bytes"] - x_bytes,
    )
    clock.lap("search")
    return result


# ------------------------------------------------------------------------------------------------
# Several ranks (tensor parallel, sequence parallel, data parallel with ZeRO-1)


class _ParallelModel:
    """A GPT of ``layers`` layers split over this rank's TP group, wrapped for DP, with its trainer."""

    def __init__(self, spec: dict, strategy: Strategy, device, layers: int) -> None:
        import llmmem.parallel as tp

        cfg = GPTConfig(**{**spec["model"], "layers": layers})
        torch.manual_seed(spec["seed"])  # every rank builds the same full model, then keeps its shards
        full = GPT(cfg)
        self.full_params = full.num_parameters()
        model = tp.TensorParallelGPT.from_gpt(full).to(device)
        del full
        if strategy.sp:
            model = tp.SequenceParallelGPT(model)
        self.inner = model
        dp_group = tp.get_data_parallel_group()
        if strategy.fsdp != "none":
            shard_over(model, dp_group, device, reshard=strategy.fsdp == "zero3")
        self.params_per_rank = local_bytes(model.parameters(), elements=True)
        if strategy.dp > 1 and strategy.fsdp == "none":  # FSDP2 reduce-scatters the gradients itself
            from torch.nn.parallel import DistributedDataParallel

            model = DistributedDataParallel(model, process_group=dp_group, gradient_as_bucket_view=True)
        opt = make_optimizer(self.inner.parameters(), spec["lr"], zero_group=dp_group if strategy.zero else None)
        self.trainer = Trainer(
            model,
            opt,
            strategy,
            device,
            sp_model=self.inner if strategy.sp else None,
            grad_group=tp.get_tensor_parallel_group(),
        )


def rank_main(rank: int, world: int, spec: dict, out_path: str) -> None:
    """Entry point of each rank (called by llmmem.parallel.ranks's launcher)."""
    import torch.distributed as dist

    import llmmem.parallel as tp

    clock = PhaseClock(spec)
    strategy = Strategy(**spec["strategy"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    device = torch.device("cpu")
    tp.init(tensor_parallel_size=strategy.tp)
    dp_group = tp.get_data_parallel_group()
    dp_rank = dist.get_rank(dp_group)
    batch, seq = spec["batch"], spec["model"]["seq_len"]
    if batch % strategy.dp:
        raise ValueError(f"batch {batch} must be divisible by the data-parallel size {strategy.dp}")
    local = batch // strategy.dp
    tokens = corpus_tokens(spec.get("tokens", "bytes"))
    sampler = BatchSampler(tokens, batch, seq, seed=spec["seed"])
    layers = spec["model"]["layers"]
    pm = _ParallelModel(spec, strategy, device, layers)
    result = row_header(spec, strategy, device, pm.full_params, pm.params_per_rank)
    result["rank"] = rank
    result["seconds"] = clock.seconds
    clock.lap("build")

    def batches():
        # every DP rank draws the same global batch and keeps its rows: the union is the baseline's batch
        x, y = sampler.next_batch(rows=slice(dp_rank * local, (dp_rank + 1) * local))
        return x, y

    def mean_over_dp(loss: float) -> float:
        t = torch.tensor([loss], dtype=torch.float64)
        dist.all_reduce(t, group=dp_group)
        return float(t) / strategy.dp

    result.update(measure.train_and_measure(pm.trainer, batches, spec["steps"], device, reduce_loss=mean_over_dp))
    result["state_bytes"] = state_bytes(pm.inner, pm.trainer.optimizer)
    clock.lap("train")
    cap = spec.get("cap_bytes") or result["peak_bytes"]
    trial_sampler = BatchSampler(tokens, batch, seq, seed=spec["seed"] + 2)

    def max_over_ranks(v: int | None) -> int:
        t = torch.tensor([-1 if v is None else v], dtype=torch.int64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return int(t)

    result["peak_bytes_max_rank"] = max_over_ranks(result["peak_bytes"])

    def peak_with_layers(n: int) -> int:
        trial = _ParallelModel(spec, strategy, device, n)
        rows = slice(dp_rank * local, (dp_rank + 1) * local)
        if strategy.dp > 1:
            trial.trainer.step(*trial_sampler.next_batch(rows=rows))  # DDP's buckets settle in a first step
        else:
            trial.trainer.prime()
        x, y = trial_sampler.next_batch(rows=rows)
        peak = measure.measured_step(trial.trainer, x, y, device)["peak_bytes"]
        params_by_layers[n] = trial.full_params
        return max_over_ranks(peak)

    params_by_layers = {layers: pm.full_params}
    del pm
    search = measure.search_largest(
        peak_with_layers,
        start=layers,
        start_peak=result["peak_bytes_max_rank"],
        cap=cap,
        trials=spec["search_trials"],
        kind="layers",
    )
    search["params"] = {str(k): v for k, v in sorted(params_by_layers.items())}
    search["largest_params"] = params_by_layers.get(search["largest"])
    result["search"] = search
    clock.lap("search")
    per_rank = [None] * world
    dist.all_gather_object(
        per_rank,
        {
            k: result[k]
            for k in (
                "rank",
                "peak_bytes",
                "activation_bytes",
                "start_bytes",
                "step_time",
                "params_per_rank",
                "state_bytes",
            )
        },
    )
    result["per_rank"] = per_rank
    if rank == 0:
        _write(out_path, result)
    dist.barrier()
    tp.destroy()


# ------------------------------------------------------------------------------------------------


def _write(path: str, result: dict) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(result, f)
    os.replace(tmp, path)


def _preload() -> None:
    """Import, once in the server, what every forked worker would otherwise import again: the
    techniques llmmem resolves lazily and torch's checkpoint. Touches no CUDA (a forked child could
    not use a CUDA context made before the fork)."""
    import torch.utils.checkpoint  # noqa: F401

    for name in (
        "checkpoint",
        "auto_checkpoint",
        "selective_context_fn",
        "GradScaler",
        "InfeasibleError",
        "patch_lm_loss",
    ):
        getattr(llmmem, name)
    from llmmem.diagnostics import live  # noqa: F401


def _forked(job: dict) -> int:
    """Run ``job`` in a child forked from this process; the child's exit status (0: done)."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            os.dup2(fd, 1)
            os.dup2(fd, 2)
            if job.get("cuda_check"):
                code = 0 if torch.cuda.is_available() else 3
            elif job.get("world", 1) > 1:
                code = _forked_ranks(job)
            else:
                with open(job["spec"]) as f:
                    spec = json.load(f)
                _write(job["out"], run_single(spec))
                code = 0
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # no interpreter shutdown: the result is written, and torch's teardown costs seconds of a
            # loaded machine's CPU
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def _forked_ranks(job: dict) -> int:
    """A parallel strategy: ``job["world"]`` ranks forked from this child (the launcher), each running
    :func:`rank_main`; 0 when every rank exited 0, else 1 with every rank's output on stderr."""
    import tempfile

    from llmmem.compare import worker_path
    from llmmem.parallel.ranks import fork_ranks

    with open(job["spec"]) as f:
        spec = json.load(f)
    with tempfile.TemporaryDirectory(prefix="llmmem-ranks-", dir=os.path.dirname(job["log"])) as folder:
        codes = fork_ranks(
            worker_path(), "rank_main", job["world"], folder, [spec, job["out"]], timeout=job["timeout"]
        )
        if all(codes.get(r) == 0 for r in range(job["world"])):
            return 0
        for r in range(job["world"]):
            log = os.path.join(folder, f"rank{r}.log")
            text = open(log).read() if os.path.exists(log) else ""
            print(f"--- rank {r} (exit {codes.get(r)}) ---\n{text[-4000:]}", file=sys.stderr)
        return 1


def serve() -> int:
    """``python -m llmmem.compare.worker --serve``: import torch and llmmem once, then, for each line
    ``{"spec": SPEC.json, "out": OUT.json, "log": LOG}`` on stdin, run that strategy in a fresh child
    forked from this process (nothing of one strategy is left in the next) and answer
    ``{"code": exit status}`` on stdout; with ``"world": N, "timeout": SECONDS`` the child forks the
    N ranks of a parallel strategy (:func:`_forked_ranks`). ``{"cuda_check": true, "log": LOG}`` answers 0 when torch
    sees a CUDA device (asked in a child too, so that this process never touches CUDA). Ends at the
    end of stdin. A fresh ``import torch`` costs seconds of CPU per process, a fork milliseconds."""
    _preload()
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        if line.strip():
            print(json.dumps({"code": _forked(json.loads(line))}), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv == ["--serve"]:
        return serve()
    if len(argv) != 2:
        print("usage: python -m llmmem.compare.worker SPEC.json OUT.json | --serve", file=sys.stderr)
        return 2
    with open(argv[0]) as f:
        spec = json.load(f)
    _write(argv[1], run_single(spec))
    return 0


if __name__ == "__main__":
    sys.exit(main())
