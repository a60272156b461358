"""Plans for the shapes a model meets after it was planned: a batch of another size or length.

A step's activation bytes grow with the tokens of its batch: a plan made for 4 x 128 tokens peaks
near twice its budget at 4 x 256. :class:`ShapePlans` re-plans from the profile it already has,
scaled by the ratio of the chain input's bytes (no new profiling: the solver takes milliseconds),
so that the budget holds at the new shape: a fractional budget is re-derived from the scaled peak
without checkpointing, a budget in bytes stays. Shapes are grouped in buckets (ratios of 1.25 from
the profiled one, each planned for its largest ratio), one per stack of blocks (an encoder's and a
decoder's lengths change apart): a loop over batches of varying length re-plans once per bucket,
never per step, and a plan is kept per bucket.

Linear scaling is exact for another batch size and for attention that keeps O(s) for backward
(SDPA's fused kernels); eager attention's s x s scores grow faster, so at a longer sequence the
plan errs short there (the module's users are told so where it matters: ``describe()``).
"""

from __future__ import annotations

import dataclasses
import math

from llmmem.checkpointing.plan import CheckpointPlan, plan_checkpoints
from llmmem.checkpointing.profile import ChainProfile
from llmmem.errors import InfeasibleError
from llmmem.units import format_bytes

__all__ = ["BUCKET_RATIO", "ShapePlans", "scaled_profile"]

BUCKET_RATIO = 1.25  # shapes within this ratio of each other share a plan

_BYTE_LISTS = ("fwd_tmp_bytes", "fwd_nostore_tmp_bytes")
_BYTE_TABLES = ("saved_bytes", "bwd_tmp_bytes", "fwd_tape_tmp_bytes")
_TIMES = ("fwd_time", "fwd_nostore_time", "bwd_time")


def _ceil(b: float) -> int:
    return int(math.ceil(b))


def scaled_profile(profile: ChainProfile, factor) -> ChainProfile:
    """``profile`` as a batch ``factor`` times as large would give it: bytes and times times
    ``factor`` (what a plan is chosen on, the counted work, scales alike, so the choice depends on
    the bytes alone). ``factor`` may be a list, one per block (stacks of different lengths: an
    encoder's and a decoder's); the head and what is outside the chain then go with the last
    block's, what is held beside the chain with the largest."""
    L = profile.n_blocks
    per = list(factor) if isinstance(factor, (list, tuple)) else [factor] * L
    if len(per) != L:
        raise ValueError(f"scaled_profile: {len(per)} factors for {L} blocks")
    top, last = max(per), per[-1]
    new = dataclasses.replace(profile)
    new.input_bytes = [_ceil(b * f) for b, f in zip(profile.input_bytes, per + [last])]
    for name in _BYTE_LISTS:
        setattr(new, name, [_ceil(b * f) for b, f in zip(getattr(profile, name), per)])
    for name in _BYTE_TABLES:
        setattr(new, name, [[_ceil(b * f) for b in row] for row, f in zip(getattr(profile, name), per)])
    new.static_bytes = _ceil(profile.static_bytes * top)
    new.outside_peak_bytes = _ceil(profile.outside_peak_bytes * last)
    # the measured peak scales as a whole only when the whole step does; else the planner's model of it
    new.measured_peak_bytes = _ceil(profile.measured_peak_bytes * top) if min(per) == top else 0
    if profile.head is not None:
        new.head = {k: _ceil(v * last) for k, v in profile.head.items()}
    new.__dict__.update(_scale_times({k: getattr(profile, k) for k in _TIMES}, per))
    if profile.seconds:
        new.seconds = _scale_times(profile.seconds, per)
    mean = sum(per) / L if L else 1.0
    new.measured_step_time = profile.measured_step_time * mean
    new.outside_work = profile.outside_work * mean
    new.outside_time = profile.outside_time * mean
    new.hidden_rows = int(round(profile.hidden_rows * last))
    return new


def _scale_times(times: dict, per: list) -> dict:
    out = dict(times)
    out["fwd_time"] = [[t * f for t in row] for row, f in zip(times["fwd_time"], per)]
    out["bwd_time"] = [[t * f for t in row] for row, f in zip(times["bwd_time"], per)]
    out["fwd_nostore_time"] = [t * f for t, f in zip(times["fwd_nostore_time"], per)]
    return out


class ShapePlans:
    """The plans of one model at the shapes it meets, one per bucket of its stacks' input bytes.

    Each stack of the chain (an encoder's, a decoder's: the profile's cuts) has its own bucket, as
    an encoder-decoder's source and target lengths change apart: a key is one bucket per stack.

    :param plan: the plan made at the profiled shape (key all zeros).
    :param budget: the budget as the user gave it (a fraction is re-derived per shape).
    :param options: ``slots``, ``offload``, ``host_bandwidth`` as given to the planner.
    :param starts: the first block of each stack (default: where the profile's chain is cut).
    """

    def __init__(self, plan: CheckpointPlan, budget, options: dict, starts=None) -> None:
        self.base = plan
        self.budget = budget
        self.options = dict(options)
        profile = plan.profile
        # where each stack starts (its first block): given, or where the profile's chain is cut
        self.starts = list(starts) if starts else profile.stack_starts
        self.input_bytes = [int(profile.input_bytes[i]) for i in self.starts] if profile.input_bytes else []
        self.plans: dict = {self.base_key: plan}  # key -> plan
        self.infeasible: dict = {}  # key -> (least budget, why), where the budget could not be met

    @property
    def base_key(self) -> tuple:
        return (0,) * len(self.starts)

    @staticmethod
    def ratio(k: int) -> float:
        """The largest ratio of a stack's input bytes to the profiled one that bucket ``k`` holds."""
        return 1.0 if k == 0 else BUCKET_RATIO**k

    def bucket(self, stack: int, input_bytes: int) -> int:
        """``k`` such that ``BUCKET_RATIO ** k`` is the smallest bucket ratio at least
        ``input_bytes`` over stack ``stack``'s profiled input (0: within 5% of it)."""
        planned = self.input_bytes[stack] if stack < len(self.input_bytes) else 0
        if not planned or input_bytes <= 0:
            return 0
        ratio = input_bytes / planned
        if 1 / 1.05 <= ratio <= 1.05:
            return 0
        return math.ceil(math.log(ratio) / math.log(BUCKET_RATIO) - 1e-9)

    def plan_for(self, key: tuple) -> tuple[CheckpointPlan, bool]:
        """``(plan, new)``: the plan for the stacks' buckets ``key``, made now if it had none. Where
        the budget cannot be met at that shape, the plan of least memory, and ``infeasible`` says so."""
        plan = self.plans.get(key)
        if plan is not None:
            return plan, False
        ends = self.starts[1:] + [self.base.profile.n_blocks]
        per = [self.ratio(k) for k, s, e in zip(key, self.starts, ends) for _ in range(s, e)]
        profile = scaled_profile(self.base.profile, per)
        try:
            plan = plan_checkpoints(None, budget=self.budget, profile=profile, **self.options)
        except InfeasibleError as e:
            self.infeasible[key] = (e.min_budget_bytes, str(e).removeprefix("plan_checkpoints: "))
            plan = plan_checkpoints(None, budget=e.min_budget_bytes, profile=profile, **self.options)
        self.plans[key] = plan
        return plan, True

    def ratios(self, key: tuple):
        """The key as ratios: a number for one stack, a tuple for several."""
        out = tuple(self.ratio(k) for k in key)
        return out[0] if len(out) == 1 else out

    def describe(self) -> list:
        """Lines for ``describe()``: the other shapes planned, each with its budget and peak."""
        lines = []
        for key in sorted(self.plans):
            if key == self.base_key:
                continue
            plan = self.plans[key]
            note = (
                f", the budget cannot be met there (least {format_bytes(self.infeasible[key][0])}): least memory"
                if key in self.infeasible
                else ""
            )
            shown = " / ".join(f"{self.ratio(k):.2f}x" for k in key)
            per = " (per stack)" if len(key) > 1 else ""
            lines.append(
                f"  re-planned for inputs up to {shown} the sample's{per}: budget "
                f"{format_bytes(plan.budget_bytes)}, predicted peak {format_bytes(plan.predicted_peak_bytes)}, "
                f"{sum(m != 'store-all' for m in plan.modes)} blocks not keeping their tape, "
                f"{len(plan.regions)} region(s){note}"
            )
        return lines
