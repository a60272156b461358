"""What every row of ``python -m llmmem compare`` is built from: the techniques applied to a GPT
(:func:`install_techniques`: the fused head, then the planner or checkpointing; then
:func:`compiled`), its optimizer, one
training step (:class:`Trainer`), the planner's set-up (:class:`Planned`), the fp32 reference
stepped beside a row, and a row's header. The flows that train and measure a row are in
:mod:`llmmem.compare.worker` (batch search, parallel rows) and :mod:`llmmem.compare.finetune`
(model-state rows, model-size search).
"""

from __future__ import annotations

import contextlib
import functools
import time

import torch
import torch.nn.functional as F

import llmmem
import llmmem.optim
from llmmem.compare.corpus import TOKENIZERS, generate_text
from llmmem.compare.strategies import Strategy
from llmmem.models.gpt import GPT, GPTConfig

__all__ = [
    "PhaseClock",
    "checkpoint_every_block",
    "install_techniques",
    "compiled",
    "plan_budget",
    "amp_context",
    "loss_of",
    "Trainer",
    "make_optimizer",
    "corpus_tokens",
    "pick_device",
    "Planned",
    "reference_trainer",
    "row_header",
]


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
        return lambda fn, x: llmmem.checkpoint(fn, x, use_reentrant=False)
    if kind == "selective":
        return lambda fn, x: llmmem.checkpoint(
            fn, x, use_reentrant=False, context_fn=llmmem.selective_context_fn, respect_saved_tensors_hooks=False
        )
    if kind == "offload":
        return lambda fn, x: llmmem.checkpoint(fn, x, use_reentrant=False, offload=True)
    return None


def checkpoint_every_block(blocks, kind: str) -> None:
    """Run every block of ``blocks`` under checkpointing ``kind``, in place (an instance-level
    ``forward``, so parameters and ``state_dict`` keys are unchanged)."""
    run = _block_runner(kind)
    if run is None:
        return
    for block in blocks:
        block.forward = functools.partial(run, type(block).forward.__get__(block))


def plan_budget(strategy: Strategy, spec: dict):
    """The planner's budget for a row: ``strategy.budget_fraction`` of the fp32 baseline's measured
    activation memory in bytes (``checkpoint='plan'``), or the fraction itself (``'auto'``: of the
    model's own activation peak, as a user writes ``budget=0.5``)."""
    if strategy.checkpoint == "auto":
        return float(strategy.budget_fraction)
    return int(strategy.budget_fraction * spec["baseline_activation_bytes"])


def install_techniques(model: GPT, strategy: Strategy, spec: dict, device, sample):
    """``strategy``'s techniques on ``model``, in place, in the order a user applies them: the fused
    head (``llmmem.patch_lm_loss``, with ``spec["head_chunk_size"]`` rows a chunk), then the planner
    (planned on the batch ``sample`` for :func:`plan_budget`) or checkpointing around every block.
    Returns the :class:`Planned` of a planner row, else None.

    :raises llmmem.InfeasibleError: when the planner finds no plan within the budget.
    """
    if strategy.fused_head:
        llmmem.patch_lm_loss(model, chunk_size=spec.get("head_chunk_size"))
    if strategy.checkpoint not in ("plan", "auto"):
        checkpoint_every_block(model.blocks, strategy.checkpoint)
        return None
    # a compiled row's plan compiles its blocks itself, with the row's backend, and budgets them as compiled
    blocks_compiled = {"backend": spec.get("compile_backend", "inductor")} if strategy.compile else False
    planned = Planned(model, strategy, device, int(spec.get("profile_repeats", 3)), blocks_compiled)
    planned.install(plan_budget(strategy, spec), *(t.to(device) for t in sample))
    return planned


def compiled(model: GPT, strategy: Strategy, spec: dict):
    """``model`` under ``torch.compile`` with ``spec["compile_backend"]`` (default inductor) for a
    compiled row, after :func:`install_techniques` (checkpointing, then compile: a region is then
    torch's checkpoint, lowered by the partitioner); ``model`` itself for any other. A
    ``torch-budget`` row sets ``torch._functorch.config.activation_memory_budget``, which is global
    to the process: each row runs in a process of its own."""
    if not strategy.compile:
        return model
    if strategy.checkpoint == "torch-budget":
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = float(strategy.budget_fraction)
    return torch.compile(model, backend=spec.get("compile_backend", "inductor"))


def amp_context(amp: str, device: torch.device):
    if amp == "none":
        return contextlib.nullcontext()
    return torch.autocast(device.type, dtype=torch.bfloat16 if amp == "bf16" else torch.float16)


def loss_of(model, x, y, strategy: Strategy):
    """The step's loss. With bf16 weights the logits are bf16 and the loss is taken on them in fp32
    (as torchtune's bf16 recipes do): a bf16 loss keeps 3 significant digits, too few to compare
    final losses."""
    if strategy.bf16_weights:
        logits, _ = model(x)
        return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), y.reshape(-1))
    _, loss = model(x, y)
    return loss


class Trainer:
    """A model, its optimizer (and scaler), and one training step; the same for every strategy.

    With ``strategy.step_in_backward`` the optimizer steps each parameter inside backward
    (:func:`llmmem.optim.step_in_backward`, installed here): ``optimizer.step()`` then finds no
    gradient, and none is kept between steps. :meth:`close` removes it.
    """

    def __init__(self, model, optimizer, strategy: Strategy, device, *, sp_model=None, grad_group=None) -> None:
        self.model, self.optimizer, self.strategy, self.device = model, optimizer, strategy, device
        self.scaler = llmmem.GradScaler(device.type) if strategy.amp == "fp16" else None
        self.sp_model = sp_model  # sequence-parallel grads to sum over the TP group after backward
        self.grad_group = grad_group
        self.in_backward = None
        if strategy.step_in_backward:
            self.in_backward = llmmem.optim.step_in_backward(model, optimizer)

    def tracked(self) -> list:
        """What exists before a step and lives through it: parameters, gradients, optimizer state."""
        opt = getattr(self.optimizer, "optim", self.optimizer)  # ZeRO: this rank's shard of the state
        return [self.model, opt]

    def step(self, x, y, marks=None) -> float:
        with amp_context(self.strategy.amp, self.device):
            loss = loss_of(self.model, x, y, self.strategy)
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
        if self.in_backward is not None:
            raise RuntimeError("Trainer.prime: a step-in-backward trainer keeps no gradients; take a step instead")
        for p in self.model.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=False)

    def close(self) -> None:
        """Removes the step in backward, so that a row trained after this one in the same worker
        steps nothing of this model."""
        if self.in_backward is not None:
            self.in_backward.remove()
            self.in_backward = None


def make_optimizer(params, lr: float, *, zero_group=None, optim: str = "torch", seed: int = 0):
    """torch's fused AdamW (``optim="torch"``), or ``llmmem.optim.AdamW`` with moments in ``optim``
    (``"fp32"``, ``"bf16"``, ``"int8"``, ``"int4"``; its stochastic rounding seeded by ``seed``);
    over ``zero_group`` in torch's ZeroRedundancyOptimizer when given."""
    params = list(params)
    if optim == "torch":
        cls, kwargs = torch.optim.AdamW, dict(lr=lr, weight_decay=0.0, fused=True)
    else:
        cls, kwargs = llmmem.optim.AdamW, dict(lr=lr, weight_decay=0.0, state_dtype=optim, seed=seed)
    if zero_group is not None:
        from torch.distributed.optim import ZeroRedundancyOptimizer

        return ZeroRedundancyOptimizer(params, optimizer_class=cls, process_group=zero_group, **kwargs)
    return cls(params, **kwargs)


# ------------------------------------------------------------------------------------------------
# Data, device, the planner


def corpus_tokens(tokens: str = "bytes"):
    """The generated corpus read by the tokeniser ``tokens`` (a key of
    :data:`llmmem.compare.corpus.TOKENIZERS`): ``"bytes"``, or ``"pairs"`` for the LM-head preset."""
    if tokens not in TOKENIZERS:
        raise ValueError(f"corpus_tokens: tokens must be one of {sorted(TOKENIZERS)}, got {tokens!r}")
    return TOKENIZERS[tokens][0](generate_text())


def pick_device(spec: dict) -> torch.device:
    want = spec.get("device", "auto")
    if want == "cuda" or (want == "auto" and torch.cuda.is_available()):
        return torch.device("cuda", torch.cuda.current_device() if torch.cuda.is_available() else 0)
    return torch.device("cpu")


class Planned:
    """The llmmem plan of a strategy with ``checkpoint='plan'`` or ``'auto'``: ``llmmem.auto_checkpoint``
    on the whole model with a budget on the step's activation peak. The planner measures the rest of
    the step (embedding, head, loss) itself on a sample step: forward and backward of a batch drawn
    apart from the training batches, in the strategy's precision."""

    def __init__(self, model: GPT, strategy: Strategy, device, repeats: int, compile_blocks=False) -> None:
        self.model, self.strategy, self.device, self.repeats = model, strategy, device, repeats
        self.compile_blocks = compile_blocks
        self.plan = None
        self.budget = None
        self.budget_fraction = None
        self.planning_seconds = 0.0

    def install(self, budget, x, y) -> None:
        """Plan for ``budget`` (bytes of activation peak, or a float in (0, 1]: that fraction of the
        model's own activation peak without checkpointing) on a sample step with batch ``(x, y)``
        and run the blocks by the plan. Raises llmmem.InfeasibleError when no plan fits."""
        if self.plan is not None:
            self.plan.remove()
            self.plan = None
        model, strategy = self.model, self.strategy
        fraction = isinstance(budget, float) and 0.0 < budget <= 1.0

        def sample_step():
            with amp_context(strategy.amp, self.device):
                loss = loss_of(model, x, y, strategy)
            loss.backward()

        t0 = time.perf_counter()
        try:
            # under autocast, so that the blocks are profiled in the precision they train in
            with amp_context(strategy.amp, self.device):
                self.plan = llmmem.auto_checkpoint(
                    model,
                    budget=budget if fraction else max(1, int(budget)),
                    sample=sample_step,
                    repeats=self.repeats,
                    compile_blocks=self.compile_blocks,
                )
        finally:
            for p in model.parameters():  # the sample step's gradients are not the training's
                if p.grad is not None:
                    p.grad = None if strategy.step_in_backward else p.grad.zero_()
        self.planning_seconds = time.perf_counter() - t0
        self.budget = self.plan.budget_bytes if fraction else int(budget)
        self.budget_fraction = budget if fraction else None

    def least_budget_per_sample(self, batch: int) -> float:
        return self.plan.min_budget_bytes / batch

    def describe(self) -> dict:
        out = {
            "budget_bytes": self.budget,
            "predicted_peak_bytes": self.plan.predicted_peak_bytes if self.plan else None,
            "least_budget_bytes": self.plan.min_budget_bytes if self.plan else None,
            "planning_seconds": self.planning_seconds,
            "describe": self.plan.describe() if self.plan else None,
        }
        if self.budget_fraction is not None:
            out["budget_fraction"] = self.budget_fraction
        if self.compile_blocks:
            out["compile_blocks"] = self.compile_blocks
        # what a compiled model runs otherwise than the plan (a compiled row's memory may then exceed it)
        changes = getattr(getattr(self.plan, "runner", None), "compile_changes", "")
        if self.strategy.compile and changes:
            out["compile_changes"] = changes
        return out


def reference_trainer(cfg: GPTConfig, spec: dict, device) -> Trainer:
    """The fp32 baseline again, on its own copy of the model, to be stepped alternately with the
    strategy: the overhead is the median ratio of the two, taken at the same moments in one process."""
    torch.manual_seed(spec["seed"] + 3)
    model = GPT(cfg).to(device)
    return Trainer(model, make_optimizer(model.parameters(), spec["lr"]), Strategy("reference", "fp32"), device)


def row_header(spec: dict, strategy: Strategy, device, params: int, params_per_rank: int) -> dict:
    return {
        "key": strategy.key,
        "label": strategy.label,
        "preset": spec.get("preset"),
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
