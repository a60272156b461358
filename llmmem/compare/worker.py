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
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sys
import time

import torch

import llmmem
from llmmem.compare import measure
from llmmem.compare.corpus import BatchSampler, encode, generate_text
from llmmem.compare.strategies import Strategy
from llmmem.models.gpt import GPT, GPTConfig

__all__ = ["run_single", "rank_main", "main"]


# ------------------------------------------------------------------------------------------------
# Where a worker's own time goes


class PhaseClock:
    """Wall-clock seconds of a worker's phases, for ``result["seconds"]``: ``start`` (from the moment
    the orchestrator launched the process, ``spec["launched_at"]``, to the first line of work:
    interpreter start and imports), then each :meth:`lap` since the previous one."""

    def __init__(self, spec: dict) -> None:
        self.seconds: dict[str, float] = {}
        launched = spec.get("launched_at")
        if launched is not None:
            self.seconds["start"] = round(max(0.0, time.time() - float(launched)), 3)
        self._last = time.perf_counter()

    def lap(self, name: str) -> None:
        now = time.perf_counter()
        self.seconds[name] = round(self.seconds.get(name, 0.0) + now - self._last, 3)
        self._last = now


# ------------------------------------------------------------------------------------------------
# Techniques


def _block_runner(kind: str):
    """``run(fn, x)`` that runs one block's forward under the chosen checkpointing, or None."""
    if kind == "torch":
        import torch.utils.checkpoint as tuc

        return lambda fn, x: tuc.checkpoint(fn, x, use_reentrant=False)
    if kind == "every":
        return lambda fn, x: llmmem.checkpoint(fn, x)
    if kind == "selective":
        return lambda fn, x: llmmem.checkpoint(fn, x, context_fn=llmmem.selective_context_fn)
    if kind == "offload":
        return lambda fn, x: llmmem.checkpoint(fn, x, offload=True)
    return None


def checkpoint_every_block(blocks, kind: str) -> None:
    """Run every block of ``blocks`` under checkpointing ``kind``, in place (an instance-level
    ``forward``, so parameters and ``state_dict`` keys are unchanged)."""
    run = _block_runner(kind)
    if run is None:
        return
    for block in blocks:
        block.forward = functools.partial(run, type(block).forward.__get__(block))


def amp_context(amp: str, device: torch.device):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


class Trainer:
    """A model, its optimizer (and scaler), and one training step; the same for every strategy."""

    def __init__(self, model, optimizer, strategy: Strategy, device, *, sp_model=None, grad_group=None) -> None:
        self.model, self.optimizer, self.strategy, self.device = model, optimizer, strategy, device
        self.scaler = llmmem.GradScaler(device.type) if strategy.amp == "fp16" else None
        self.sp_model = sp_model  # sequence-parallel grads to sum over the TP group after backward
        self.grad_group = grad_group

    def tracked(self) -> list:
        """What exists before a step and lives through it: parameters, gradients, optimizer state."""
        opt = getattr(self.optimizer, "optim", self.optimizer)  # ZeRO: this rank's shard of the state
        return [self.model, opt]

    def step(self, x, y, marks=None) -> float:
        with amp_context(self.strategy.amp, self.device):
            _, loss = self.model(x, y)
        if marks is not None:
            marks("forward")
        (self.scaler.scale(loss) if self.scaler is not None else loss).backward()
        if self.sp_model is not None:
            from llmmem.parallel import allreduce_sequence_parallel_grads

            allreduce_sequence_parallel_grads(self.sp_model, self.grad_group)
        if marks is not None:
            marks("backward")
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        # Gradients stay allocated between steps, so a step's memory is (parameters + gradients +
        # optimizer state, constant) + what the step itself makes.
        self.optimizer.zero_grad(set_to_none=False)
        if marks is not None:
            marks("optimizer")
        return float(loss.detach())

    def prime(self) -> None:
        """Create gradients and optimizer state without a forward pass (an update with zero
        gradients), so that the next step measures the steady state."""
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)


def make_optimizer(params, lr: float, *, zero_group=None):
    params = list(params)
    kwargs = dict(lr=lr, weight_decay=0.0, fused=True)
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=torch.optim.AdamW, process_group=zero_group, **kwargs)
    return torch.optim.AdamW(params, **kwargs)


# ------------------------------------------------------------------------------------------------
# Single process


def _tokens():
    return encode(generate_text())


def _device(spec: dict) -> torch.device:
    want = spec.get("device", "auto")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return torch.device("cpu")


class _Planned:
    """The llmmem plan of a strategy with ``checkpoint='plan'``: ``llmmem.auto_checkpoint`` on the
    whole model with a budget on the step's activation peak. The planner measures the rest of the
    step (embedding, head, loss) itself on a sample step: forward and backward of a batch drawn apart
    from the training batches, in the strategy's precision."""

    def __init__(self, model: GPT, strategy: Strategy, device, repeats: int) -> None:
        self.model, self.strategy, self.device, self.repeats = model, strategy, device, repeats
        self.plan = None
        self.budget = None
        self.planning_seconds = 0.0

    def install(self, budget: int, x, y) -> None:
        """Plan for ``budget`` bytes of activation peak on a sample step with batch ``(x, y)`` and run
        the blocks by the plan. Raises llmmem.InfeasibleError when no plan fits."""
        if self.plan is not None:
            self.plan.remove()
            self.plan = None
        model, amp = self.model, self.strategy.amp

        def sample_step():
            with amp_context(amp, self.device):
                _, loss = model(x, y)
            loss.backward()

        t0 = time.perf_counter()
        try:
            # under autocast, so that the blocks are profiled in the precision they train in
            with amp_context(amp, self.device):
                self.plan = llmmem.auto_checkpoint(
                    model, budget=max(1, int(budget)), sample=sample_step, repeats=self.repeats
                )
        finally:
            for p in model.parameters():  # the sample step's gradients are not the training's
                if p.grad is not None:
                    p.grad.zero_()
        self.planning_seconds = time.perf_counter() - t0
        self.budget = int(budget)

    def least_budget_per_sample(self, batch: int) -> float:
        return self.plan.min_budget_bytes / batch

    def describe(self) -> dict:
        return {
            "budget_bytes": self.budget,
            "predicted_peak_bytes": self.plan.predicted_peak_bytes if self.plan else None,
            "least_budget_bytes": self.plan.min_budget_bytes if self.plan else None,
            "planning_seconds": self.planning_seconds,
            "describe": self.plan.describe() if self.plan else None,
        }


def run_single(spec: dict) -> dict:
    clock = PhaseClock(spec)
    strategy = Strategy(**spec["strategy"])
    torch.set_num_threads(int(spec.get("threads", 1)))
    device = _device(spec)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    seed, batch, steps = spec["seed"], spec["batch"], spec["steps"]
    cfg = GPTConfig(**spec["model"])
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    tokens = _tokens()
    sampler = BatchSampler(tokens, batch, cfg.seq_len, seed=seed)
    result = _header(spec, strategy, device, model.num_parameters(), model.num_parameters())
    result["seconds"] = clock.seconds
    result["parent_pid"] = os.getppid()  # the worker server's, when the row was forked from it
    clock.lap("build")
    planned = None
    if strategy.checkpoint == "plan":
        planned = _Planned(model, strategy, device, int(spec.get("profile_repeats", 3)))
        sample_x, sample_y = BatchSampler(tokens, batch, cfg.seq_len, seed=seed + 1).next_batch()
        budget = int(strategy.budget_fraction * spec["baseline_activation_bytes"])
        try:
            planned.install(budget, sample_x.to(device), sample_y.to(device))
        except llmmem.InfeasibleError as exc:
            # a result, not a failure: the planner says what the least feasible budget is
            result["error"] = f"infeasible: {exc}"
            result["infeasible"] = True
            result["plan"] = {"budget_bytes": budget}
            clock.lap("plan")
            return result
        clock.lap("plan")
    else:
        checkpoint_every_block(model.blocks, strategy.checkpoint)
    trainer = Trainer(model, make_optimizer(model.parameters(), spec["lr"]), strategy, device)

    def batches():
        x, y = sampler.next_batch()
        return x.to(device), y.to(device)

    # Only train_and_measure holds the reference, so that it is freed before the measured step.
    result.update(measure.train_and_measure(trainer, batches, steps, device, reference=_reference(cfg, spec, device)))
    clock.lap("train")
    if planned is not None:
        result["plan"] = planned.describe()

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


def _reference(cfg: GPTConfig, spec: dict, device) -> Trainer:
    """The fp32 baseline again, on its own copy of the model, to be stepped alternately with the
    strategy: the overhead is the median ratio of the two, taken at the same moments in one process."""
    torch.manual_seed(spec["seed"] + 3)
    model = GPT(cfg).to(device)
    return Trainer(model, make_optimizer(model.parameters(), spec["lr"]), Strategy("reference", "fp32"), device)


def _header(spec: dict, strategy: Strategy, device, params: int, params_per_rank: int) -> dict:
    return {
        "key": strategy.key,
        "label": strategy.label,
        "strategy": strategy.to_dict(),
        "device": str(device),
        "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "threads": torch.get_num_threads(),
        "world": strategy.world,
        "model": spec["model"],
        "batch": spec["batch"],
        "steps": spec["steps"],
        "params": params,
        "params_per_rank": params_per_rank,
        "error": None,
    }


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
        self.params_per_rank = sum(p.numel() for p in model.parameters())
        dp_group = tp.get_data_parallel_group()
        if strategy.dp > 1:
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
    tokens = _tokens()
    sampler = BatchSampler(tokens, batch, seq, seed=spec["seed"])
    layers = spec["model"]["layers"]
    pm = _ParallelModel(spec, strategy, device, layers)
    result = _header(spec, strategy, device, pm.full_params, pm.params_per_rank)
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
            for k in ("rank", "peak_bytes", "activation_bytes", "start_bytes", "step_time", "params_per_rank")
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

    for name in ("checkpoint", "auto_checkpoint", "selective_context_fn", "GradScaler", "InfeasibleError"):
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
