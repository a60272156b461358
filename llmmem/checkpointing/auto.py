"""``auto_checkpoint``: profile a model's chain of blocks, plan it for a budget on the step's peak
memory, and run the plan, in place (:class:`AutoCheckpointPlan`, :mod:`llmmem.checkpointing.inplace`)
or, for a bare chain, as a module that runs the chain itself (:class:`AutoCheckpointed`)."""

from __future__ import annotations

import contextlib
import sys
import time

import torch
import torch.nn as nn

from llmmem.checkpointing.blocks import as_block_list
from llmmem.checkpointing.compiled import COMPILED_MODES, compile_bodies, compile_options
from llmmem.checkpointing.core import checkpoint
from llmmem.checkpointing.inplace import (
    RUNNER_OPTIONS,
    ChainRunner,
    checkpointing_flags_off,
    own_forward,
    restore_flags,
)
from llmmem.checkpointing.modes import run_mode
from llmmem.checkpointing.offload import offload_without_prefetch
from llmmem.checkpointing.outputs import OutputWatch
from llmmem.checkpointing.plan import DEFAULT_SLOTS, CheckpointPlan, plan_checkpoints
from llmmem.checkpointing.profile import ChainProfile, profile_model
from llmmem.checkpointing.reshape import ShapePlans
from llmmem.checkpointing.stacks import Stack, find_blocks, order_by_calls, resolve_blocks
from llmmem.units import format_bytes

__all__ = ["auto_checkpoint", "AutoCheckpointed", "AutoCheckpointPlan", "find_blocks"]


# The regions a plan runs are non-reentrant, whatever the caller's options leave unsaid (and say so,
# so that llmmem.checkpoint does not warn that use_reentrant was omitted).
_REGION_DEFAULTS = {"use_reentrant": False}


class _Step:
    """What iterating an :class:`AutoCheckpointed` yields: the first block of a top-level item runs
    the whole item; the other blocks of a region pass their input through (it is already done)."""

    def __init__(self, owner, item) -> None:
        self._owner, self._item = owner, item

    def __call__(self, x):
        return self._owner._run_item(self._item, x) if self._item is not None else x


class AutoCheckpointed(nn.ModuleList):
    """The blocks of a chain, run according to a :class:`CheckpointPlan`.

    A ``ModuleList`` of the original blocks (same ``state_dict`` keys, ``len``, indexing). Calling
    it runs the whole chain: ``y = module(x)``. Iterating it (``for block in model.layers: x =
    block(x)``, as most models' forward do) yields one callable per block that together run the
    plan: only valid when the loop passes each output straight to the next block.

    Memory: what the plan predicts (``.plan``); time: the plan's recompute overhead.
    """

    def __init__(self, blocks, plan: CheckpointPlan, **checkpoint_options) -> None:
        super().__init__(blocks)
        if len(self) != plan.n_blocks:
            raise ValueError(f"auto_checkpoint: the plan is for {plan.n_blocks} blocks, got {len(self)}")
        self.plan = plan
        self._options = checkpoint_options
        self._offloaded = set(plan.offloaded)
        self._items = self._build(0, len(self))

    def _build(self, s: int, e: int) -> list:
        """Items of the sequence [s, e): ("block", i) or ("region", start, end, inner items)."""
        # The regions directly inside [s, e): maximal ones among those strictly inside it.
        inside = sorted(
            {r for r in self.plan.regions if s <= r[0] and r[1] <= e and r != (s, e)}, key=lambda r: (r[0], -r[1])
        )
        children, reach = {}, s
        for rs, re_ in inside:
            if rs >= reach:  # not nested in the previous maximal region
                children[rs] = re_
                reach = re_
        items, i = [], s
        while i < e:
            if i in children:
                items.append(("region", i, children[i], self._build(i, children[i])))
                i = children[i]
            else:
                items.append(("block", i))
                i += 1
        return items

    def _run_item(self, item, x):
        if item[0] == "block":
            i = item[1]
            return run_mode(self[i], x, self.plan.modes[i], **self._options)
        _, start, end, inner = item
        if (start, end) in self._offloaded:
            with offload_without_prefetch():
                return checkpoint(self._run_items, inner, x, **{**_REGION_DEFAULTS, **self._options, "offload": True})
        return checkpoint(self._run_items, inner, x, **{**_REGION_DEFAULTS, **self._options})

    def _run_items(self, items, x):
        for item in items:
            x = self._run_item(item, x)
        return x

    def forward(self, x):
        return self._run_items(self._items, x)

    def __iter__(self):
        firsts = {}
        for item in self._items:
            firsts[item[1]] = item
        return iter([_Step(self, firsts.get(i)) for i in range(len(self))])


class AutoCheckpointPlan:
    """A plan running in place on a model's blocks (what :func:`auto_checkpoint` returns for a model).

    ``print(plan.describe())`` shows the budget, the predicted peak, the bytes held when the
    backward starts and the recompute time; the attributes of the
    :class:`~llmmem.checkpointing.plan.CheckpointPlan` (``modes``, ``regions``,
    ``predicted_peak_bytes``, ...) are readable here too. :meth:`remove` gives the blocks their own
    ``forward`` back (``with llmmem.auto_checkpoint(...):`` removes it on exit). ``planning_time`` is
    the seconds profiling and solving took.

    A planned model is saved, loaded and copied whole with its plan (``torch.save(model)`` and
    ``torch.load(..., weights_only=False)``, ``pickle``, ``copy.deepcopy``): the copy runs the plan
    on its own blocks, and :meth:`of` finds it there. ``state_dict`` keys are the model's own, so
    ``save_pretrained`` / ``from_pretrained`` and ``load_state_dict`` give a model without the plan.
    """

    def __init__(
        self,
        model: nn.Module,
        name: str,
        runner: ChainRunner,
        plan: CheckpointPlan,
        planning_time: float,
        watch: OutputWatch | None = None,
        stacks: tuple = (),
    ):
        self.model = model
        self.blocks_name = name
        # every stack found: those planned (in the order the model runs them), then those left out
        self.stacks = tuple(stacks) or (Stack(name, tuple(runner.blocks)),)
        self.runner = runner
        self.plan = plan
        self.planning_time = planning_time
        self.watch = watch

    @classmethod
    def of(cls, model: nn.Module) -> AutoCheckpointPlan | None:
        """The plan running on ``model``'s blocks (also on a model loaded or copied whole), or None."""
        for module in model.modules():
            chain = module.__dict__.get("_llmmem_chain")
            if chain is not None and isinstance(getattr(chain[0], "owner", None), cls):
                return chain[0].owner
        return None

    @property
    def active(self) -> bool:
        return self.runner.active

    @property
    def profile(self) -> ChainProfile:
        return self.plan.profile

    @property
    def current(self):
        """The :class:`~llmmem.checkpointing.plan.CheckpointPlan` the last forward pass ran: ``plan``,
        or the one made for that pass's shape (``replan=True``)."""
        return self.runner.plan

    @property
    def replans(self) -> dict:
        """The plans made for other shapes than the sample's: ``{ratio of the chain input's bytes to
        the sample's (the bucket's largest): plan}``, the ratio a tuple (one per stack) when the
        model has several stacks (an encoder's and a decoder's)."""
        shapes = self.runner.shapes
        if shapes is None:
            return {}
        return {shapes.ratios(k): p for k, p in sorted(shapes.plans.items()) if k != shapes.base_key}

    def __getattr__(self, name: str):
        if name.startswith("_") or name in ("plan", "runner", "watch"):
            raise AttributeError(name)
        return getattr(self.plan, name)

    def remove(self) -> None:
        """Undo: every block runs its own ``forward`` again (idempotent)."""
        self.runner.remove()
        if self.watch is not None:
            self.watch.remove()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()
        return False

    def _fused_head_line(self) -> str | None:
        """What the description says of a model whose loss is the fused head (it carries the mark
        ``llmmem.patch_lm_loss`` leaves), else None. The profile measured the step as it runs, so
        the head and loss figures are the fused head's already: nothing in the plan changes."""
        marker = sys.modules.get("llmmem.head.marker")  # loaded wherever a model carries the mark
        info = None if marker is None else marker.fused_head(self.model)
        if info is None:
            return None
        from llmmem.head.chunks import chunk_rows  # (loaded with the mark: llmmem.head's package)

        p = self.plan.profile
        if p.hidden_rows:
            rows = f"{chunk_rows(p.hidden_rows, info.vocab, p.input_bytes[-1], info.chunk_size)} rows"
        elif info.chunk_size is not None:
            rows = f"{info.chunk_size} rows"
        else:
            rows = "the rows of max(32 MiB, the hidden states' bytes) of fp32 logits (at least 256)"
        return (
            f"  LM head fused (llmmem.patch_lm_loss): its logits are chunked by llmmem.linear_cross_entropy, "
            f"its peak at most one chunk of {rows} x {info.vocab} (measured with the step, below)"
        )

    def describe(self) -> str:
        blocks = self.runner.blocks
        kinds = sorted({type(b).__name__ for b in blocks})
        state = "" if self.active else " (removed)"
        planned = [s for s in self.stacks if s.planned]
        where = (
            f"at {self.blocks_name!r}"
            if len(planned) == 1
            else f"in {len(planned)} stacks, {', '.join(s.describe() for s in planned)}"
        )
        head = [
            f"llmmem.auto_checkpoint on {type(self.model).__name__}: {len(blocks)} blocks "
            f"({', '.join(kinds)}) {where}{state}; planned in {self.planning_time:.2f} s",
        ]
        head += [f"  left out: {s.describe()}" for s in self.stacks if not s.planned]
        cuts = [i for i, c in enumerate(self.plan.profile.cuts) if c]
        if cuts:
            head.append(
                f"  (the model changes the chain's input before block(s) {', '.join(map(str, cuts))}: no region "
                "spans them)"
            )
        if not self.plan.profile.chainable:
            between = "stacks" if len(planned) > 1 else "blocks"
            head.append(
                f"  (the model changes a block's input between {between}: regions hold one block each, "
                "store-input-only)"
            )
        if self.runner.compile_options is not None:
            opts = ", ".join(f"{k}={v!r}" for k, v in self.runner.compile_options.items())
            head.append(
                f"  blocks compiled by the plan: torch.compile({opts}); kept bytes of the compiled blocks; regions run "
                "between graphs"
            )
        fused = self._fused_head_line()
        if fused is not None:
            head.append(fused)
        shapes = self.runner.shapes
        tail = "" if shapes is None else "".join("\n" + line for line in shapes.describe())
        return "\n".join(head) + "\n" + self.plan.describe() + tail

    def __str__(self) -> str:
        return self.describe()

    def __repr__(self) -> str:
        return (
            f"<AutoCheckpointPlan {type(self.model).__name__}.{self.blocks_name}: budget "
            f"{format_bytes(self.plan.budget_bytes)}, predicted peak {format_bytes(self.plan.predicted_peak_bytes)}"
            f"{'' if self.active else ', removed'}>"
        )


@contextlib.contextmanager
def _errors_say_auto_checkpoint():
    """Errors of plan_checkpoints inside say auto_checkpoint (the function the user called), with
    their type, attributes (InfeasibleError's min_budget_bytes) and traceback."""
    try:
        yield
    except (ValueError, TypeError) as exc:
        text = str(exc)
        if not text.startswith("plan_checkpoints:"):
            raise
        ours = type(exc)("auto_checkpoint:" + text[len("plan_checkpoints:") :])
        ours.__dict__.update(exc.__dict__)
        raise ours.with_traceback(exc.__traceback__) from None


def auto_checkpoint(
    model,
    sample_input=None,
    budget=0.5,
    *,
    sample=None,
    blocks=None,
    slots: int = DEFAULT_SLOTS,
    profile: ChainProfile | None = None,
    offload: bool = False,
    host_bandwidth: float | None = None,
    repeats: int = 5,
    replan: bool = True,
    compile_blocks=False,
    **options,
):
    """Plan activation checkpointing for a memory budget and run it.

    **A whole model** (``plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch)``): finds
    the chain of repeated blocks (see :func:`find_blocks`; ``blocks=`` names it), runs one real
    training step on ``sample`` to record how the model calls each block (every positional and
    keyword argument) and what the rest of the step holds, profiles the blocks (one per class and
    call signature), plans, and gives each block an instance-level ``forward`` that runs the plan:
    the model's own forward, slicing of its block list, ``state_dict`` keys, ``named_modules`` and
    ``.to()`` are unchanged. Returns an :class:`AutoCheckpointPlan` (``print(plan.describe())``,
    ``plan.remove()``).

    ``sample`` is what a training step gets: a batch (a tensor for ``model(x)``, a tuple for
    ``model(*sample)``, a dict for ``model(**sample)``; the loss is the output's ``.loss`` or a
    scalar output, else the sum of the first floating-point output; the output is freed before the
    backward) or a callable that runs one training step (called once: its side effects, such as an
    optimizer step, happen). A loop that keeps the output through the backward (``out = model(**b);
    out.loss.backward()``) holds the logits then too: give it as the callable, so the budget counts them.

    **A bare chain** (``model.blocks = llmmem.auto_checkpoint(model.blocks, x0, budget="6GB")``,
    blocks taking one tensor each): returns an :class:`AutoCheckpointed` module list that runs the
    plan when called on the chain input or iterated by the model's loop.

    :param budget: the **peak** activation memory of a training step: bytes, a string like
        ``"6GB"``, or a fraction in (0, 1] (``0.5``, or a percent string such as ``"50%"``) of
        that peak without checkpointing (measured on the sample step for a model; the planner's
        model of it for a bare chain). Activation memory is
        what the step allocates beyond the parameters, their gradients and the batch: what is kept
        for backward and every temporary of the forward and the backward.
    :param blocks: for a model: ``None`` plans every stack of repeated blocks the sample's forward
        runs (:func:`~llmmem.checkpointing.stacks.find_stacks`; an encoder's and a decoder's, in
        the order it runs them; ``describe()`` names those left out and why); a dotted path
        (``"model.layers"``), a container or a list of the model's modules is one chain; a list of
        dotted paths (or of the ``nn.ModuleList`` themselves) is several stacks, given in the order the
        model runs them.
    :param slots, offload, host_bandwidth: as in :func:`llmmem.plan_checkpoints`.
    :param profile: a :class:`ChainProfile` to plan from instead of profiling (e.g. ``plan.profile``
        of an earlier call, for another budget).
    :param repeats: timed repeats (median) that turn the planner's work units into seconds.
    :param replan: for a model: at a batch of another size or length than the sample's, plan again
        from the profile, scaled (no new profiling; a fractional budget is re-derived at that shape,
        bytes stay bytes), once per bucket of shapes within 1.25x of each other
        (:mod:`llmmem.checkpointing.reshape`); ``False``: keep the plan, and warn once when an input
        is larger than the sample's.
    :param compile_blocks: for a model: ``True`` (inductor, ``torch.compile``'s defaults) or a dict
        of ``torch.compile`` keyword arguments (``{"backend": "inductor", "mode":
        "max-autotune-no-cudagraphs"}``; modes that capture CUDA graphs are refused) compiles each
        block's forward and plans the compiled blocks: what they keep for backward is measured on
        them, and the plan runs its regions around them, so its budget holds with compiled blocks.
        The planned modes are then "keep the tape", "selective" (the selective policy compiled into
        the block) and "recompute" (alone or in regions); the mode that recomputes only cheap
        operators is not available. Plan before compiling the model; the model may then run as it
        is or under ``torch.compile(model)``, whose graph breaks at each planned block's call
        (``fullgraph=True`` is refused; in a Hugging Face model the break is in its loop over the
        layers, which then runs eagerly). Without it, a model compiled as a whole runs each
        checkpointed block as torch's checkpoint operator inside its graph (one graph, ``fullgraph``
        works), whose memory is not the plan's: a warning at compilation says how it differs.
    :param options: for a model: ``preserve_rng_state``, ``determinism_check``, ``early_stop`` (as in
        :func:`llmmem.checkpoint`); for a bare chain, any :func:`llmmem.checkpoint` option.
    :raises llmmem.InfeasibleError: (a ``ValueError``) stating the smallest feasible budget.
    :raises ValueError: when blocks of the chain have no backward (nothing in them trains: a frozen
        model, or a frozen prefix; a model whose base is frozen but whose blocks hold trainable
        adapters is planned), or the chain holds a module twice or blocks that share a trained weight.

    Cost: one step of the model (every block checkpointed) under a memory meter, then per distinct
    block a few forward and backward passes; the solver takes milliseconds for identical blocks.
    With ``compile_blocks``, also two compilations per distinct block (plain and selective).
    Memory: that step's, then one block's activations at a time. Profile with the batch and
    sequence length you train with: the costs depend on them.
    """
    if profile is not None and not isinstance(profile, ChainProfile):
        raise TypeError(
            f"auto_checkpoint: profile must be a ChainProfile (from llmmem.profile_blocks or plan.profile) or None, "
            f"got {type(profile).__name__}"
        )
    chain_form = (
        sample is None
        and blocks is None
        and (
            isinstance(model, (nn.ModuleList, list, tuple))
            or (isinstance(model, nn.Sequential) and (isinstance(sample_input, torch.Tensor) or profile is not None))
        )
    )
    compiling = compile_options(compile_blocks)
    if chain_form:
        if compiling is not None:
            raise TypeError(
                "auto_checkpoint: compile_blocks plans a whole model (auto_checkpoint(model, sample=batch, "
                "compile_blocks=True)); for a bare chain, compile the blocks before planning them"
            )
        block_list = as_block_list(model, "auto_checkpoint")
        with _errors_say_auto_checkpoint():
            plan = plan_checkpoints(
                block_list,
                sample_input,
                budget,
                slots=slots,
                profile=profile,
                offload=offload,
                host_bandwidth=host_bandwidth,
            )
        return AutoCheckpointed(block_list, plan, **options)
    if not isinstance(model, nn.Module):
        raise TypeError(
            f"auto_checkpoint: model must be an nn.Module (or a list of blocks), got {type(model).__name__}"
        )
    if sample is not None and sample_input is not None:
        raise TypeError("auto_checkpoint: give the sample once, as sample=")
    sample = sample if sample is not None else sample_input
    unknown = set(options) - set(RUNNER_OPTIONS)
    if unknown:
        raise TypeError(
            f"auto_checkpoint: unexpected keyword argument(s) {sorted(unknown)}; a plan on a whole model takes "
            f"{list(RUNNER_OPTIONS)} as checkpoint options"
        )
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"auto_checkpoint: repeats must be an int >= 0, got {repeats!r}")
    if not isinstance(replan, bool):
        raise TypeError(f"auto_checkpoint: replan must be True or False, got {replan!r}")
    stacks = resolve_blocks(model, blocks)
    if blocks is None and sample is not None and profile is None:
        stacks = order_by_calls(model, stacks, sample)
    planned = [s for s in stacks if s.planned]
    block_list = [b for s in planned for b in s.blocks]
    name = " + ".join(s.name for s in planned)
    starts = [sum(len(s.blocks) for s in planned[:i]) for i in range(len(planned))]
    for i, b in enumerate(block_list):
        if "_llmmem_chain" in b.__dict__:
            raise ValueError(
                f"auto_checkpoint: block {i} of {name!r} already runs a plan; call .remove() on that plan first "
                "(llmmem.AutoCheckpointPlan.of(model) finds it, also on a model loaded or copied with its plan)"
            )
    if profile is None and sample is None:
        raise TypeError(
            "auto_checkpoint: sample= is needed to profile the model (a batch, or a callable running one "
            "training step), or give profile="
        )
    if compiling is not None and profile is not None and not getattr(profile, "compiled_blocks", False):
        raise ValueError(
            "auto_checkpoint: with compile_blocks the profile must be of compiled blocks: give plan.profile of a "
            "plan made with compile_blocks, or none"
        )
    if compiling is None and profile is not None and getattr(profile, "compiled_blocks", False):
        raise ValueError(
            "auto_checkpoint: the profile is of blocks compiled by a plan (compile_blocks); plan with "
            "compile_blocks again, or give a profile of the blocks as they are"
        )
    if profile is not None and profile.n_blocks != len(block_list):
        raise ValueError(
            f"auto_checkpoint: the profile is for {profile.n_blocks} blocks, {name!r} has {len(block_list)}"
        )
    start = time.perf_counter()
    extra: dict = {}
    flags = checkpointing_flags_off(block_list)  # the plan takes over from Hugging Face's own checkpointing
    try:
        if profile is None:
            if compiling is not None:
                own = [own_forward(b) for b in block_list]
                extra = {"modes": COMPILED_MODES, "compiled": compile_bodies(own, compiling)}
            profile = profile_model(
                model, block_list, sample, repeats=repeats, warmup=1 if repeats else 0, stack_starts=starts, **extra
            )
        with _errors_say_auto_checkpoint():
            plan = plan_checkpoints(
                None, budget=budget, profile=profile, slots=slots, offload=offload, host_bandwidth=host_bandwidth
            )
        shapes = None
        if replan:
            shapes = ShapePlans(
                plan, budget, {"slots": slots, "offload": offload, "host_bandwidth": host_bandwidth}, starts
            )
        runner = ChainRunner(
            block_list,
            plan,
            profile.hidden,
            options,
            saved_flags=flags,
            shapes=shapes,
            starts=starts,
            compile_options=compiling,
            bodies=extra.get("compiled"),  # those profiling compiled
        )
        runner.install()
        runner.guard(model)
    except BaseException:
        restore_flags(block_list, flags)
        raise
    watch = None
    if profile.step_frees_output:
        # profiled as model(**batch).loss.backward(): a loop keeping the output breaks the budget
        watch = OutputWatch(model, block_list[-1], plan.predicted_peak_bytes, plan.budget_bytes)
    result = AutoCheckpointPlan(model, name, runner, plan, time.perf_counter() - start, watch, stacks)
    runner.owner = result  # what AutoCheckpointPlan.of finds, in the model and in its copies
    return result
