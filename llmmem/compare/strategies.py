"""What ``python -m llmmem compare`` runs: the strategies (one technique or a combination each) and
the model, batch and step counts of the full and the quick run.

A strategy is data, so the orchestrator can hand it to a fresh worker process as JSON. No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = ["Strategy", "STRATEGIES", "Preset", "PRESETS", "by_key"]

CHECKPOINT_KINDS = ("none", "torch", "every", "selective", "plan", "offload")
AMP_KINDS = ("none", "bf16", "fp16")


@dataclass(frozen=True)
class Strategy:
    """One row of the table.

    :param checkpoint: ``none``; ``torch`` (torch.utils.checkpoint around every block); ``every``
        (llmmem.checkpoint around every block); ``selective`` (llmmem.checkpoint with
        llmmem.selective_context_fn around every block); ``plan`` (llmmem.auto_checkpoint with a budget
        of ``budget_fraction`` of the fp32 baseline's measured activation memory); ``offload``
        (llmmem.checkpoint(offload=True) around every block).
    :param amp: ``none`` (fp32), ``bf16`` (autocast) or ``fp16`` (autocast + llmmem.GradScaler).
    :param tp: tensor-parallel ranks; ``sp`` sequence parallelism with them; ``dp`` data-parallel
        replicas (DistributedDataParallel); ``zero`` ZeRO-1 (torch's ZeroRedundancyOptimizer) over them.
    """

    key: str
    label: str
    checkpoint: str = "none"
    amp: str = "none"
    budget_fraction: float | None = None
    tp: int = 1
    dp: int = 1
    sp: bool = False
    zero: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_KINDS:
            raise ValueError(f"Strategy {self.key}: checkpoint must be one of {CHECKPOINT_KINDS}")
        if self.amp not in AMP_KINDS:
            raise ValueError(f"Strategy {self.key}: amp must be one of {AMP_KINDS}")
        if (self.checkpoint == "plan") != (self.budget_fraction is not None):
            raise ValueError(f"Strategy {self.key}: budget_fraction goes with checkpoint='plan' only")

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @property
    def is_llmmem(self) -> bool:
        """Whether llmmem does the memory saving (the 4x-batch target is about these rows)."""
        return self.checkpoint in ("every", "selective", "plan", "offload") or self.amp == "fp16"

    def to_dict(self) -> dict:
        return asdict(self)


STRATEGIES = (
    Strategy("baseline", "fp32 baseline"),
    Strategy("torch-every", "torch.utils.checkpoint, every layer", checkpoint="torch"),
    Strategy("every", "llmmem.checkpoint, every layer", checkpoint="every"),
    Strategy("plan-50", "llmmem plan, 50% budget", checkpoint="plan", budget_fraction=0.5),
    Strategy("plan-25", "llmmem plan, 25% budget", checkpoint="plan", budget_fraction=0.25),
    Strategy("selective", "llmmem selective, every layer", checkpoint="selective"),
    Strategy("bf16", "bf16 autocast", amp="bf16"),
    Strategy("fp16", "fp16 autocast + llmmem.GradScaler", amp="fp16"),
    Strategy("every+bf16", "llmmem.checkpoint every layer + bf16", checkpoint="every", amp="bf16"),
    Strategy("plan-25+bf16", "llmmem plan 25% + bf16", checkpoint="plan", budget_fraction=0.25, amp="bf16"),
    Strategy("offload", "llmmem.checkpoint(offload=True), every layer", checkpoint="offload"),
    Strategy("tp2+sp", "tensor parallel 2 + sequence parallel", tp=2, sp=True),
    Strategy("tp2xdp2+zero1", "TP 2 (+SP) x DP 2, ZeRO-1", tp=2, dp=2, sp=True, zero=True),
)


def by_key(keys) -> list[Strategy]:
    """The strategies named in ``keys`` (in table order); the baseline is always included first."""
    known = {s.key: s for s in STRATEGIES}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(known)}")
    wanted = set(keys) | {"baseline"}
    return [s for s in STRATEGIES if s.key in wanted]


@dataclass(frozen=True)
class Preset:
    """Model and run sizes. ``steps`` training steps per strategy: the first warms up (optimizer
    state is made), the next ``steps - 2`` are timed, the last is measured under the tracker."""

    layers: int
    hidden: int
    heads: int
    seq_len: int
    batch: int
    steps: int
    search_trials: int  # measured steps allowed per strategy for the largest-batch / largest-model search
    vocab_size: int = 256
    lr: float = 1e-3
    profile_repeats: int = 3  # timed repeats of each block mode when the planner profiles

    def model_config(self) -> dict:
        return dict(
            layers=self.layers,
            hidden=self.hidden,
            heads=self.heads,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            dropout=0.0,
        )


# Full: 10 layers of width 64 with 4 heads over 256 tokens: heads * seq / hidden = 16, as in GPT-3
# 175B at 2048 tokens, so attention's seq^2 activations weigh what they weigh in a large model, and
# activations are ~90% of the fp32 baseline's peak (parameters, gradients and Adam state ~10%). Ten
# layers, not fewer, so that one block's recompute (what no plan avoids) is well under 25% of the
# activations and a plan at 25% is feasible.
PRESETS = {
    "full": Preset(layers=10, hidden=64, heads=4, seq_len=256, batch=4, steps=10, search_trials=4),
    # Quick: a fraction of the width and length, the same heads * seq / hidden.
    "quick": Preset(layers=12, hidden=32, heads=4, seq_len=128, batch=2, steps=4, search_trials=3, profile_repeats=1),
}
