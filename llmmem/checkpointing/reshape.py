"""Plans for the shapes a model meets after it was planned: a batch of another size or length.

A step's activation bytes grow with the tokens of its batch: a plan made for 4 x 128 tokens peaks
near twice its budget at 4 x 256. :class:`ShapePlans` re-plans from the profile it already has,
scaled by the ratio of the chain input's bytes (no new profiling: the solver takes milliseconds),
so that the budget holds at the new shape: a fractional budget is re-derived from the scaled peak
without checkpointing, a budget in bytes stays. Shapes are grouped in buckets (ratios of 1.25 from
the profiled one, each planned for its largest ratio): a loop over batches of varying length
re-plans once per bucket, never per step, and a plan is kept per bucket.

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

_BYTE_LISTS = ("input_bytes", "fwd_tmp_bytes", "fwd_nostore_tmp_bytes")
_BYTE_TABLES = ("saved_bytes", "bwd_tmp_bytes", "fwd_tape_tmp_bytes")
_BYTE_SCALARS = ("static_bytes", "outside_peak_bytes", "measured_peak_bytes")
_TIMES = ("fwd_time", "fwd_nostore_time", "bwd_time")


def _scale_times(times: dict, factor: float) -> dict:
    out = dict(times)
    out["fwd_time"] = [[t * factor for t in row] for row in times["fwd_time"]]
    out["bwd_time"] = [[t * factor for t in row] for row in times["bwd_time"]]
    out["fwd_nostore_time"] = [t * factor for t in times["fwd_nostore_time"]]
    return out


def scaled_profile(profile: ChainProfile, factor: float) -> ChainProfile:
    """``profile`` as a batch ``factor`` times as large would give it: bytes and times times
    ``factor`` (what a plan is chosen on, the counted work, scales alike, so the choice depends on
    the bytes alone)."""
    new = dataclasses.replace(profile)
    for name in _BYTE_LISTS:
        setattr(new, name, [int(math.ceil(b * factor)) for b in getattr(profile, name)])
    for name in _BYTE_TABLES:
        setattr(new, name, [[int(math.ceil(b * factor)) for b in row] for row in getattr(profile, name)])
    for name in _BYTE_SCALARS:
        setattr(new, name, int(math.ceil(getattr(profile, name) * factor)))
    if profile.head is not None:
        new.head = {k: int(math.ceil(v * factor)) for k, v in profile.head.items()}
    new.__dict__.update(_scale_times({k: getattr(profile, k) for k in _TIMES}, factor))
    if profile.seconds:
        new.seconds = _scale_times(profile.seconds, factor)
    new.measured_step_time = profile.measured_step_time * factor
    new.outside_work = profile.outside_work * factor
    new.outside_time = profile.outside_time * factor
    new.hidden_rows = int(round(profile.hidden_rows * factor))
    return new


class ShapePlans:
    """The plans of one model at the shapes it meets, one per bucket of the chain input's bytes.

    :param plan: the plan made at the profiled shape (bucket 0).
    :param budget: the budget as the user gave it (a fraction is re-derived per shape).
    :param options: ``slots``, ``offload``, ``host_bandwidth`` as given to the planner.
    """

    def __init__(self, plan: CheckpointPlan, budget, options: dict) -> None:
        self.base = plan
        self.budget = budget
        self.options = dict(options)
        self.input_bytes = int(plan.profile.input_bytes[0]) if plan.profile.input_bytes else 0
        self.plans: dict = {0: plan}  # bucket -> plan
        self.infeasible: dict = {}  # bucket -> (least budget, why), where the budget could not be met

    @staticmethod
    def ratio(k: int) -> float:
        """The largest ratio of chain-input bytes to the profiled one that bucket ``k`` holds."""
        return 1.0 if k == 0 else BUCKET_RATIO**k

    def bucket(self, input_bytes: int) -> int:
        """``k`` such that ``BUCKET_RATIO ** k`` is the smallest bucket ratio at least
        ``input_bytes`` over the profiled input's (0: within 5% of the profiled shape)."""
        if not self.input_bytes or input_bytes <= 0:
            return 0
        ratio = input_bytes / self.input_bytes
        if 1 / 1.05 <= ratio <= 1.05:
            return 0
        return math.ceil(math.log(ratio) / math.log(BUCKET_RATIO) - 1e-9)

    def plan_for(self, input_bytes: int) -> tuple[CheckpointPlan, bool]:
        """``(plan, new)``: the plan for a chain input of ``input_bytes``, made now if its bucket
        had none. Where the budget cannot be met at that shape, the plan of least memory, and
        ``infeasible`` says so."""
        k = self.bucket(input_bytes)
        plan = self.plans.get(k)
        if plan is not None:
            return plan, False
        profile = scaled_profile(self.base.profile, self.ratio(k))
        try:
            plan = plan_checkpoints(None, budget=self.budget, profile=profile, **self.options)
        except InfeasibleError as e:
            self.infeasible[k] = (e.min_budget_bytes, str(e).removeprefix("plan_checkpoints: "))
            plan = plan_checkpoints(None, budget=e.min_budget_bytes, profile=profile, **self.options)
        self.plans[k] = plan
        return plan, True

    def describe(self) -> list:
        """Lines for ``describe()``: the other shapes planned, each with its budget and peak."""
        lines = []
        for k in sorted(self.plans):
            if k == 0:
                continue
            plan = self.plans[k]
            note = (
                f", the budget cannot be met there (least {format_bytes(self.infeasible[k][0])}): least memory"
                if k in self.infeasible
                else ""
            )
            lines.append(
                f"  re-planned for inputs up to {self.ratio(k):.2f}x the sample's: budget "
                f"{format_bytes(plan.budget_bytes)}, predicted peak {format_bytes(plan.predicted_peak_bytes)}, "
                f"{sum(m != 'store-all' for m in plan.modes)} blocks not keeping their tape, "
                f"{len(plan.regions)} region(s){note}"
            )
        return lines
