"""Profiling blocks for the recompute planner: the entry points, and the profile they make.

Per block and per mode: the bytes kept for backward and the transient peaks of its forward and of
its backward (exact: :class:`~llmmem.checkpointing.meters.ActivationMeter`, tensor storages counted
by :class:`llmmem.diagnostics.live.LiveBytes`, on the CPU as on CUDA; on CUDA the allocator's
statistics too, whichever is larger), and its cost in work units
(:class:`~llmmem.checkpointing.work.WorkCounter`: FLOPs of the matrix products plus a fixed price
per byte moved and per operator). The planner compares plans in work units, which are counted, not
timed, so the same model and budget give the same plan on every run; one measured factor, the
blocks' store-all forward seconds per work unit (``time_unit``, from the median of timed repeats),
turns a plan's extra work into seconds for the predictions. On the CPU the Python a mode adds
beyond its work is timed apart: a checkpoint's bookkeeping on a null block
(:mod:`llmmem.checkpointing.bookkeeping`), the recompute-cheap hooks while the block is timed.

Blocks are called as the model calls them: a :class:`~llmmem.checkpointing.calls.BlockCall` holds a
block's positional and keyword arguments and says which one is the chain's activation (the output
of the block before).

Here: :class:`ChainProfile` (what the planner takes), :func:`profile_blocks` (a chain of blocks
that each take the previous one's output), :func:`profile_calls` (blocks called as their
``BlockCall`` says), :func:`profile_model` (a model's chain, as one real step calls it), and
:func:`kept_state` (profiling leaves the random state and the gradients as they were). The parts,
one concern each, in ``llmmem.checkpointing``: ``modes`` (the modes and running a call in one),
``calls`` (block calls), ``meters`` (bytes), ``work`` (work units), ``timing`` (seconds), ``costs``
(one block in each mode), ``blocks`` (checks on a block list), ``samples`` (a sample and its step),
``recording`` (a model's step with its blocks recorded). ``ActivationMeter`` and
``measure_saved_bytes`` are still importable from here, where earlier docstrings pointed.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from llmmem.checkpointing.blocks import as_block_list, check_distinct
from llmmem.checkpointing.calls import BlockCall, find_hidden, hidden_of, without_cache
from llmmem.checkpointing.compiled import use_compiled_costs
from llmmem.checkpointing.costs import block_signature, profile_one
from llmmem.checkpointing.meters import ActivationMeter, measure_saved_bytes, tensor_bytes
from llmmem.checkpointing.modes import INPUT_ONLY, MODES, run_call, run_mode
from llmmem.checkpointing.recording import record_step
from llmmem.checkpointing.samples import is_step, sample_step
from llmmem.checkpointing.timing import median_time
from llmmem.checkpointing.work import WorkCounter

__all__ = [
    "ChainProfile",
    "UNUSABLE_BYTES",
    "kept_state",
    "profile_blocks",
    "profile_calls",
    "profile_model",
    # importable from here as before the split (their homes: meters, work, modes, blocks, calls,
    # timing), for code that imported them from this module
    "ActivationMeter",
    "measure_saved_bytes",
    "WorkCounter",
    "run_call",
    "run_mode",
    "check_distinct",
    "median_time",
    "find_hidden",
]


_NESTABLE = {"store-all": 1, "selective": 0, "recompute-cheap": 0, INPUT_ONLY: 0}
# Saved bytes of a mode the head pseudo-block cannot use (plan.py): more than any budget.
UNUSABLE_BYTES = 1 << 50


@dataclass
class ChainProfile:
    """Measured costs of a chain of blocks, in bytes and in time units; ``modes`` names the columns.

    Times are in units of ``time_unit`` seconds (:func:`profile_blocks` counts work, so plans are
    the same on every run; a profile made by hand may use seconds with the default ``time_unit=1``;
    NaN when the blocks were counted but not timed, ``repeats=0``).
    ``head`` is what runs between the chain's forward and its backward, a model's head and loss
    (``{"saved_bytes", "fwd_tmp_bytes", "bwd_tmp_bytes"}``: kept at its end, transient peaks of its
    forward and its backward), planned as a last block that always keeps its tape; ``static_bytes``
    are held outside the chain through all of it (what ran before it keeps, the other arguments of
    the blocks such as masks); ``outside_peak_bytes`` is the step's peak before the chain's forward
    and after its backward. ``chainable`` is false when a block's input is not the previous block's
    output as it is (the model changes it in between): regions then hold one block each (the
    ``"store-input-only"`` mode) instead of spanning blocks.
    """

    modes: tuple
    fwd_time: list  # [L][K] forward keeping the tape in mode k
    fwd_nostore_time: list  # [L] forward inside a checkpointed region (the mean of it and its recompute)
    bwd_time: list  # [L][K]
    input_bytes: list  # [L + 1]
    saved_bytes: list  # [L][K] beyond the block input
    fwd_tmp_bytes: list  # [L] beyond input, output and tape: the most of any mode keeping a tape
    bwd_tmp_bytes: list  # [L][K] beyond tape, incoming and outgoing gradients
    device: str = "cpu"
    # [L] the forward inside a checkpointed region, beyond input and output: it frees intermediates
    # as it goes, yet holds more at once than a tape's forward beyond its tape. Empty: unknown,
    # fwd_tmp_bytes counts for both forwards.
    fwd_nostore_tmp_bytes: list = field(default_factory=list)
    # [L][K] the forward keeping its tape in mode k, beyond input, output and tape (a mode that keeps
    # less can hold more at once on the way: selective's forward). Empty: unknown, fwd_tmp_bytes
    # counts for every mode.
    fwd_tape_tmp_bytes: list = field(default_factory=list)
    # [L][K] 1 where the block's tape in that mode keeps its own output (selective keeps a final
    # matmul's output, tanh keeps its result): offloading the next block's input would then free
    # nothing on the device. Empty: unknown, treated as all 0.
    output_kept: list = field(default_factory=list)
    time_unit: float = 1.0
    head: dict | None = None
    static_bytes: int = 0
    outside_peak_bytes: int = 0
    measured_peak_bytes: int = 0  # the step's activation peak without checkpointing (0: not measured)
    measured_step_time: float = 0.0  # seconds of one store-all step of the chain (0: not measured)
    outside_work: float = 0.0  # work units of a step outside the chain (0: unknown; a bare chain)
    outside_time: float = 0.0  # seconds of it, at the blocks' timed rates (0: not timed or unknown)
    hidden: list = field(default_factory=list)  # [L] where each block's chain input is in its call
    chainable: bool = True
    # made by profile_model on a batch, whose step frees the model's output before the backward (a
    # loop that keeps it is warned: llmmem.checkpointing.outputs)
    step_frees_output: bool = False
    # the time fields measured in seconds ({"fwd_time", "bwd_time", "fwd_nostore_time"}), for the
    # predictions of a plan chosen on work (None: not timed), and "bookkeeping": per block, the
    # seconds of Python a mode adds beyond its work ({"checkpoint": s, "recompute-cheap": (pack,
    # unpack, operators inside the unpacks)}; {} off the CPU)
    seconds: dict | None = None
    # rows of the last block's chain input (its elements over its last dimension: the tokens a
    # model's LM head reads); 0: unknown (a profile made by hand)
    hidden_rows: int = 0
    # [L] 1 where block i's input is not block i - 1's output (a second stack of blocks starts
    # there: a decoder after an encoder): regions end before it. Empty: none.
    cuts: list = field(default_factory=list)
    # the kept bytes are those of blocks compiled by the plan (auto_checkpoint's compile_blocks)
    compiled_blocks: bool = False

    def to_chain(self, host_bandwidth: float = 0.0, seconds: bool = False) -> dict:
        """The dict the C planner takes (llmmem._C.plan_solve); ``host_bandwidth`` in bytes per
        time unit, 0 for no offloading. ``seconds``: the measured times instead of the work. With a
        ``head`` the chain has one more block (its modes other than store-all are made unusable)."""
        times = self.seconds if seconds else self.__dict__
        chain = {
            "fwd_time": [list(r) for r in times["fwd_time"]],
            "fwd_nostore_time": list(times["fwd_nostore_time"]),
            "bwd_time": [list(r) for r in times["bwd_time"]],
            "input_bytes": list(self.input_bytes),
            "saved_bytes": [list(r) for r in self.saved_bytes],
            "fwd_tmp_bytes": list(self.fwd_tmp_bytes),
            "fwd_nostore_tmp_bytes": list(self.fwd_nostore_tmp_bytes) if self.fwd_nostore_tmp_bytes else None,
            "fwd_tape_tmp_bytes": [list(r) for r in self.fwd_tape_tmp_bytes] if self.fwd_tape_tmp_bytes else None,
            "bwd_tmp_bytes": [list(r) for r in self.bwd_tmp_bytes],
            "mode_nestable": [_NESTABLE[m] if self.chainable else 0 for m in self.modes],
            "output_kept": [list(r) for r in self.output_kept] if self.output_kept else None,
            "host_bandwidth": float(host_bandwidth),
        }
        if any(self.cuts):
            chain["cut_before"] = [int(c) for c in self.cuts]
        if self.head is not None:
            K = len(self.modes)
            chain["fwd_time"].append([0.0] * K)
            chain["fwd_nostore_time"].append(0.0)
            chain["bwd_time"].append([0.0] * K)
            chain["input_bytes"].append(0)
            chain["saved_bytes"].append([int(self.head["saved_bytes"])] + [UNUSABLE_BYTES] * (K - 1))
            chain["fwd_tmp_bytes"].append(int(self.head["fwd_tmp_bytes"]))
            if chain["fwd_nostore_tmp_bytes"] is not None:
                # the planner never puts the head in a region; a plan given by hand that does gets
                # the one transient measured for it
                chain["fwd_nostore_tmp_bytes"].append(int(self.head["fwd_tmp_bytes"]))
            if chain["fwd_tape_tmp_bytes"] is not None:
                chain["fwd_tape_tmp_bytes"].append([int(self.head["fwd_tmp_bytes"])] * K)
            chain["bwd_tmp_bytes"].append([int(self.head["bwd_tmp_bytes"])] * K)
            if chain["output_kept"] is not None:
                chain["output_kept"].append([0] * K)
            if "cut_before" in chain:
                chain["cut_before"].append(0)
        return chain

    @property
    def n_blocks(self) -> int:
        return len(self.fwd_time)

    @property
    def stack_starts(self) -> list:
        """The first block of each stack: 0 and every cut."""
        return [0] + [i for i, c in enumerate(self.cuts) if c and i > 0]


def _rows(t: torch.Tensor) -> int:
    return t.numel() // t.shape[-1] if t.dim() and t.shape[-1] else 0


@contextlib.contextmanager
def kept_state(params: Sequence[torch.Tensor], devices: Sequence[torch.device] = ()):
    """Inside: profiling may draw random numbers and make gradients; on exit (also on an error) the
    random state (the CPU's and that of every CUDA device in ``devices``) and each parameter's
    ``.grad`` are exactly as before. Gradients are set to ``None`` inside, so autograd makes new
    tensors rather than accumulating into the caller's (which it would do in place).

    Memory: references to the old gradients only; no synchronisation beyond reading the CUDA
    random states."""
    params = [p for p in params if isinstance(p, torch.Tensor)]
    grads = [p.grad for p in params]
    cuda = sorted({d for d in (torch.device(d) for d in devices) if d.type == "cuda"}, key=str)
    try:
        with torch.random.fork_rng(devices=cuda, device_type="cuda"):
            for p in params:
                p.grad = None
            yield
    finally:
        for p, g in zip(params, grads):
            p.grad = g


def profile_calls(
    blocks,
    calls: Sequence[BlockCall],
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    same_blocks: bool | None = None,
    chainable: bool = True,
    runs: Sequence[Callable] | None = None,
    output_bytes: int | None = None,
) -> ChainProfile:
    """Measure each block called as ``calls[i]`` says (see :func:`profile_blocks`).

    :param calls: one :class:`BlockCall` per block (its chain input is replaced by a fresh copy).
    :param same_blocks: measure one block per group of blocks with the same class, configuration,
        parameter shapes and call signature, and give its costs to the group (``None``: group so;
        ``True``: all blocks are one group; ``False``: measure every block).
    :param chainable: each block's input is the previous block's output as it is.
    :param runs: what to call for each block (default: the block): its original forward when the
        block is wrapped.
    :param output_bytes: bytes of the last block's output (default: measured by running it).
    """
    blocks = as_block_list(blocks, "profile_blocks")
    modes = tuple(modes)
    if not modes or modes[0] != "store-all" or any(m not in MODES for m in modes) or len(set(modes)) != len(modes):
        raise ValueError(f"profile_blocks: modes must start with 'store-all' and be taken from {MODES}, got {modes!r}")
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 0:
        raise ValueError(f"profile_blocks: repeats must be an int >= 0, got {repeats!r}")
    if isinstance(warmup, bool) or not isinstance(warmup, int) or warmup < 0:
        raise ValueError(f"profile_blocks: warmup must be an int >= 0, got {warmup!r}")
    if len(calls) != len(blocks):
        raise ValueError(f"profile_blocks: {len(calls)} calls for {len(blocks)} blocks")
    runs = list(runs) if runs is not None else list(blocks)
    device = calls[0].hidden_tensor.device
    n = len(blocks)
    groups: dict = {}
    for i, (b, c) in enumerate(zip(blocks, calls)):
        key = 0 if same_blocks else (i if same_blocks is False else block_signature(b, c))
        groups.setdefault(key, []).append(i)
    params = [p for b in blocks for p in b.parameters()]
    # profiling must change neither the user's random stream nor the gradients
    with kept_state(params, {device, *(p.device for p in params)}):
        costs: list = [None] * n
        for members in groups.values():
            i = members[0]
            try:
                one = profile_one(runs[i], blocks[i], calls[i], modes, repeats, warmup, device)
            except RuntimeError as e:
                if isinstance(e, torch.OutOfMemoryError) or "in-place operation" not in str(e):
                    raise
                raise ValueError(
                    f"auto_checkpoint: block {i} ({type(blocks[i]).__name__}) updates in place an input that needs a "
                    "gradient (one an earlier block made for the later ones): a recompute of the blocks that read it "
                    "would see its later value, so they cannot be checkpointed; copy it in the block instead "
                    f"(x = x * 0.5, not x.mul_(0.5)) ({e})"
                ) from e
            for j in members:
                costs[j] = one
        if output_bytes is None:
            with torch.no_grad():
                args, kwargs = calls[-1].args, calls[-1].kwargs
                output_bytes = tensor_bytes(hidden_of(runs[-1](*args, **kwargs)))
    K = len(modes) + (0 if chainable else 1)
    prof = ChainProfile(
        modes + (() if chainable else (INPUT_ONLY,)),
        [],
        [],
        [],
        [tensor_bytes(c.hidden_tensor) for c in calls] + [output_bytes],
        [],
        [],
        [],
        device=str(device),
        chainable=chainable,
        hidden=[c.hidden for c in calls],
        hidden_rows=_rows(calls[-1].hidden_tensor),
    )
    timed = all(c.seconds is not None for c in costs)
    seconds = {"fwd_time": [], "bwd_time": [], "fwd_nostore_time": [], "bookkeeping": [c.bookkeeping for c in costs]}
    for i, c in enumerate(costs):
        saved, btmp = list(c.saved), list(c.btmp)
        kept = [int(o > 0) for o in c.kept_out]
        if not chainable:
            # a checkpoint of the block alone: keeps its input only; its backward rebuilds the tape
            saved.append(0)
            btmp.append(c.input_only_btmp)
            kept.append(0)
        if i == n - 1:
            # a tape keeping its own output: the planner counts it with the next block's input,
            # and there is no next block
            saved = [s + o for s, o in zip(saved, c.kept_out + [0] * (K - len(c.kept_out)))]
        for costs_of, into in ((c.work, prof), (c.seconds, seconds) if timed else (None, None)):
            if costs_of is None:
                continue
            fwd, bwd = list(costs_of["fwd"]), list(costs_of["bwd"])
            if not chainable:
                fwd.append(costs_of["input_only"][0])
                bwd.append(costs_of["input_only"][1])
            times = into if isinstance(into, dict) else into.__dict__
            times["fwd_time"].append(fwd)
            times["bwd_time"].append(bwd)
            times["fwd_nostore_time"].append(costs_of["nostore"])
        prof.saved_bytes.append(saved)
        # store-input-only (not chainable) is a tape mode whose forward is the no-store one
        ftmp = list(c.ftmp) + ([] if chainable else [c.nostore_ftmp])
        prof.fwd_tmp_bytes.append(max(ftmp))
        prof.fwd_tape_tmp_bytes.append(ftmp)
        prof.fwd_nostore_tmp_bytes.append(c.nostore_ftmp)
        prof.bwd_tmp_bytes.append(btmp)
        prof.output_kept.append(kept)
    if not timed:
        prof.time_unit = float("nan")  # counted work only: no seconds to predict (repeats=0)
    if timed:
        prof.seconds = seconds
        prof.measured_step_time = sum(f[0] + b[0] for f, b in zip(seconds["fwd_time"], seconds["bwd_time"]))
        # seconds per work unit, for figures given per block
        work = sum(f[0] for f in prof.fwd_time)
        if work > 0:
            prof.time_unit = sum(f[0] for f in seconds["fwd_time"]) / work
    return prof


def profile_blocks(
    blocks,
    sample_input,
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    same_blocks: bool | None = None,
) -> ChainProfile:
    """Measure each block of a chain: bytes kept for backward, transient peaks and work per mode.

    :param blocks: an ``nn.Sequential``/``nn.ModuleList``/list of blocks; block ``i + 1`` takes the
        output of block ``i``.
    :param sample_input: the first block's input (a tensor), of the shape used in training (the
        costs depend on batch and sequence length: profile again when they change). For blocks
        that take more than one argument, use :func:`llmmem.auto_checkpoint` on the whole model.
    :param modes: which modes to measure, from ``("store-all", "selective", "recompute-cheap")``;
        store-all is required.
    :param repeats: timed repeats (median) of the steps that turn work units into seconds.
    :param same_blocks: the blocks are copies of one block (transformer layers): measure the first
        and reuse its costs for all. ``None``: blocks of the same class, configuration (``repr``),
        parameter shapes and input shape are measured once.
    :returns: a :class:`ChainProfile` (times in work units of ``time_unit`` seconds).

    Memory: one block's activations at a time (and the chain's boundary activations). Runs each
    measured block once per mode under the meters, and ``2 * (warmup + repeats)`` timed steps;
    synchronises a CUDA device. The random state (CPU and CUDA) and the blocks' parameter
    gradients are left exactly as they were, also when profiling raises.
    """
    blocks = as_block_list(blocks, "profile_blocks")
    if not isinstance(sample_input, torch.Tensor):
        raise TypeError(
            f"profile_blocks: sample_input must be a tensor, got {type(sample_input).__name__} (for blocks called "
            "with several arguments, give the whole model to llmmem.auto_checkpoint(model, sample=...))"
        )
    x = sample_input.detach()
    params = [p for b in blocks for p in b.parameters()]
    devices = {x.device, *(p.device for p in params)}
    # the state is kept before the chain runs: its dropout draws random numbers too
    with kept_state(params, devices):
        calls = []
        with torch.no_grad():
            for block in blocks:
                calls.append(BlockCall((x,)))
                x = block(x)
                if not isinstance(x, torch.Tensor):
                    raise TypeError("profile_blocks: each block must return one tensor (the next block's input)")
        return profile_calls(
            blocks,
            calls,
            modes=modes,
            repeats=repeats,
            warmup=warmup,
            same_blocks=same_blocks,
            output_bytes=tensor_bytes(x),
        )


def profile_model(
    model,
    blocks: list,
    sample,
    *,
    modes: Sequence[str] = MODES,
    repeats: int = 5,
    warmup: int = 1,
    runs: Sequence[Callable] | None = None,
    stack_starts: Sequence[int] = (),
    compiled: dict | None = None,
) -> ChainProfile:
    """Profile the chain ``blocks`` of ``model`` as one real step on ``sample`` runs it (see
    :func:`sample_step`): each block called with the arguments the model gave it, and the bytes the
    rest of the step holds around the chain (``static_bytes``, ``head``, ``outside_peak_bytes``; see
    :func:`record_step`). Blocks of one class and call signature are measured once.

    Memory: the step with the blocks keeping nothing, then one block's activations at a time. The
    random state and the parameters' ``.grad`` are as before (:func:`kept_state`, also on an error);
    the step's other effects (an optimizer step in a callable ``sample``) happen once.

    ``compiled``: the blocks' forwards as a plan compiles them, per mode
    (:func:`llmmem.checkpointing.compiled.compile_bodies`); those modes' kept bytes (and, timed,
    their seconds) are then measured on them (:func:`~llmmem.checkpointing.compiled.use_compiled_costs`).
    """
    device = next((p.device for p in model.parameters()), torch.device("cpu"))
    step = sample_step(model, sample)
    params = list(model.parameters())
    with kept_state(params, {device, *(p.device for p in params)}):
        rec = record_step(model, blocks, step, device, stack_starts)
        # Regions span the blocks that feed each other; where no two do, each block is checkpointed
        # alone (the store-input-only mode), else regions end where the chain is cut.
        linked = rec.links[1:]
        chainable = all(linked) or any(linked)
        stripped = []
        for c in rec.calls:
            args, kwargs, _ = without_cache(c.args, c.kwargs)
            stripped.append(BlockCall(args, kwargs, c.hidden, input_grad=c.input_grad))
        prof = profile_calls(
            blocks,
            stripped,
            modes=modes,
            repeats=repeats,
            warmup=warmup,
            chainable=chainable,
            runs=runs,
            output_bytes=rec.output_bytes,
        )
        if compiled is not None:
            use_compiled_costs(prof, blocks, stripped, compiled, repeats)
    prof.head = rec.head
    if chainable and not all(linked):
        prof.cuts = [0] + [int(not link) for link in linked]
    prof.step_frees_output = not is_step(sample)
    prof.static_bytes = rec.static_bytes
    prof.outside_peak_bytes = rec.outside_peak_bytes
    prof.outside_work = rec.outside_work
    if prof.seconds:
        # the rest of the step at the blocks' seconds per work unit, forward and backward apart
        # (a backward runs at another rate: more operators per FLOP)
        rate = []
        for key in ("fwd_time", "bwd_time"):
            work = sum(r[0] for r in getattr(prof, key))
            rate.append(sum(r[0] for r in prof.seconds[key]) / work if work > 0 else prof.time_unit)
        forward = rec.outside_work - rec.outside_backward_work
        prof.outside_time = forward * rate[0] + rec.outside_backward_work * rate[1]
    return prof
