"""What ``python -m llmmem compare`` runs: the strategies (one technique or a combination each) and
the model, batch and step counts of the full and the quick run, of the model-state preset
(``--preset finetune``: its own rows, :data:`FINETUNE_STRATEGIES`), of the LM-head preset
(``--preset vocab``: :data:`VOCAB_STRATEGIES`) and of the compiled preset (``--preset compile``:
:data:`COMPILE_STRATEGIES`).

A strategy is data, so the orchestrator can hand it to a fresh worker process as JSON. No torch here.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

__all__ = [
    "Strategy",
    "STRATEGIES",
    "FINETUNE_STRATEGIES",
    "VOCAB_STRATEGIES",
    "COMPILE_STRATEGIES",
    "COMPILE_QUICK_KEYS",
    "Preset",
    "FinetunePreset",
    "VocabPreset",
    "CompilePreset",
    "PRESETS",
    "PRESET_FAMILIES",
    "preset_name",
    "strategies_of",
    "by_key",
]

CHECKPOINT_KINDS = ("none", "torch", "every", "selective", "plan", "offload", "auto", "torch-budget")
BUDGETED_KINDS = ("plan", "auto", "torch-budget")
AMP_KINDS = ("none", "bf16", "fp16")
OPTIM_KINDS = ("torch", "fp32", "bf16", "int8", "int4")
FSDP_KINDS = ("none", "zero2", "zero3")


@dataclass(frozen=True)
class Strategy:
    """One row of the table.

    :param checkpoint: ``none``; ``torch`` (torch.utils.checkpoint around every block); ``every``
        (llmmem.checkpoint around every block); ``selective`` (llmmem.checkpoint with
        llmmem.selective_context_fn around every block); ``plan`` (llmmem.auto_checkpoint with a budget
        of ``budget_fraction`` of the fp32 baseline's measured activation memory); ``offload``
        (llmmem.checkpoint(offload=True) around every block); ``auto`` (llmmem.auto_checkpoint with a
        budget of ``budget_fraction`` of the model's own activation peak, as a user writes
        ``budget=0.5``: it holds at every model size).
    :param amp: ``none`` (fp32), ``bf16`` (autocast) or ``fp16`` (autocast + llmmem.GradScaler).
    :param tp: tensor-parallel ranks; ``sp`` sequence parallelism with them; ``dp`` data-parallel
        replicas (DistributedDataParallel); ``zero`` ZeRO-1 (torch's ZeroRedundancyOptimizer) over them;
        ``fsdp`` ``zero2`` or ``zero3``: torch's FSDP2 over them instead of DDP (parameters, gradients
        and optimizer state sharded; zero3 frees each block's gathered parameters after its forward).
    :param optim: ``torch`` (torch.optim.AdamW, fused) or the moments' format of llmmem.optim.AdamW:
        ``fp32``, ``bf16``, ``int8``, ``int4``.
    :param bf16_weights: the parameters in bf16 with no fp32 master, updated by llmmem.optim.AdamW
        with stochastic rounding.
    :param step_in_backward: each parameter stepped as soon as its gradient exists, the gradient
        freed at once (llmmem.optim.step_in_backward).
    :param fused_head: the LM head and its loss fused (llmmem.patch_lm_loss, applied first: a plan
        made after it profiles the fused head).
    :param compile: the model run through ``torch.compile`` after its checkpointing is installed
        (the order torchtitan documents), single-process rows only.
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
    fsdp: str = "none"
    optim: str = "torch"
    bf16_weights: bool = False
    step_in_backward: bool = False
    fused_head: bool = False
    compile: bool = False

    def __post_init__(self) -> None:
        if self.checkpoint not in CHECKPOINT_KINDS:
            raise ValueError(f"Strategy {self.key}: checkpoint must be one of {CHECKPOINT_KINDS}")
        if self.amp not in AMP_KINDS:
            raise ValueError(f"Strategy {self.key}: amp must be one of {AMP_KINDS}")
        if (self.checkpoint in BUDGETED_KINDS) != (self.budget_fraction is not None):
            raise ValueError(
                f"Strategy {self.key}: budget_fraction goes with checkpoint='plan', 'auto' or 'torch-budget' only"
            )
        if self.checkpoint in ("auto", "torch-budget") and not 0.0 < self.budget_fraction <= 1.0:
            raise ValueError(f"Strategy {self.key}: checkpoint={self.checkpoint!r} takes a budget_fraction in (0, 1]")
        if self.checkpoint == "torch-budget" and not self.compile:
            raise ValueError(
                f"Strategy {self.key}: checkpoint='torch-budget' is torch.compile's partitioner; it needs compile=True"
            )
        if self.compile and (self.parallel or self.checkpoint in ("plan", "offload")):
            raise ValueError(
                f"Strategy {self.key}: compile runs single-process rows without checkpoint='plan' (its budget is "
                "bytes of the eager baseline's activations; a compiled row's plan takes a fraction, 'auto') or "
                "'offload' (a compiled graph keeps a region's inputs on the device)"
            )
        if self.fsdp not in FSDP_KINDS:
            raise ValueError(f"Strategy {self.key}: fsdp must be one of {FSDP_KINDS}")
        if self.fsdp != "none" and (self.dp == 1 or self.zero or self.sp):
            raise ValueError(
                f"Strategy {self.key}: fsdp shards over dp > 1 ranks, in place of zero, and without sp (FSDP2's "
                "new parameters lose the mark of the norms whose gradients sequence parallelism sums)"
            )
        if self.optim not in OPTIM_KINDS:
            raise ValueError(f"Strategy {self.key}: optim must be one of {OPTIM_KINDS}")
        if self.bf16_weights and self.optim == "torch":
            raise ValueError(
                f"Strategy {self.key}: bf16_weights needs an llmmem optim (stochastic rounding is llmmem.optim.AdamW's)"
            )
        if self.bf16_weights and self.amp == "fp16":
            raise ValueError(f"Strategy {self.key}: bf16_weights do not train under fp16 autocast")
        if self.step_in_backward and (self.amp == "fp16" or self.parallel):
            raise ValueError(
                f"Strategy {self.key}: step_in_backward refuses an fp16 scaler and runs single-process rows only"
            )
        if self.fused_head and (self.parallel or self.bf16_weights):
            raise ValueError(
                f"Strategy {self.key}: fused_head runs single-process rows without bf16_weights only (its loss is "
                "the patched model's, which the tensor-parallel GPT and the bf16-weights loss do not call)"
            )

    @property
    def world(self) -> int:
        return self.tp * self.dp

    @property
    def parallel(self) -> bool:
        return self.world > 1

    @property
    def is_llmmem(self) -> bool:
        """Whether llmmem does the memory saving (the 4x-batch target is about these rows)."""
        return (
            self.checkpoint in ("every", "selective", "plan", "offload", "auto")
            or self.amp == "fp16"
            or self.optim != "torch"
            or self.step_in_backward
            or self.fused_head
        )

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
    Strategy("zero3", "ZeRO-3 over DP 2 (FSDP2)", dp=2, fsdp="zero3"),
    Strategy("tp2xzero3", "TP 2 x ZeRO-3 over DP 2 (FSDP2)", tp=2, dp=2, fsdp="zero3"),
)


# The model-state rows (issue 23): what fine-tuning's memory is made of is the parameters, their
# gradients and the optimizer's moments, so each row changes one of them, and the lean row all.
FINETUNE_STRATEGIES = (
    Strategy("baseline", "torch AdamW, fp32 (baseline)"),
    Strategy("int8-state", "llmmem AdamW, int8 state", optim="int8"),
    Strategy("bf16-weights", "bf16 weights + stochastic rounding", optim="fp32", bf16_weights=True),
    Strategy("step-in-backward", "step in backward", optim="fp32", step_in_backward=True),
    Strategy(
        "lean",
        "bf16 + int8 state + step in bwd + plan 50%",
        optim="int8",
        bf16_weights=True,
        step_in_backward=True,
        checkpoint="auto",
        budget_fraction=0.5,
    ),
)


# The LM-head rows (issue 24): at a large vocabulary the head's logits, their fp32 log-softmax and
# their gradient are the step's largest activations. The planner alone recomputes blocks, never the
# head; patched first, the fused head leaves the blocks as what a plan can halve. (No bf16 row: at
# the preset's size the fused head's fp32 [vocab x hidden] weight gradients, which bf16 does not
# shrink, are too large a share of a bf16 step for a plan at 50%, which a large model's blocks
# dwarf; and a bf16 row without the plan would add a third to the run's time.)
VOCAB_STRATEGIES = (
    Strategy("baseline", "plain head, fp32 (baseline)"),
    Strategy("fused", "llmmem.patch_lm_loss (fused head)", fused_head=True),
    Strategy("plan-50", "llmmem plan 50%, plain head", checkpoint="auto", budget_fraction=0.5),
    Strategy("fused+plan-50", "fused head + plan 50%", fused_head=True, checkpoint="auto", budget_fraction=0.5),
)


# The compiled rows (issue 25): what checkpointing saves once the model is compiled, where a region
# is torch's checkpoint lowered by the partitioner and a dispatch mode sees no allocation of the
# graph. torch's own compile-time planner (activation_memory_budget, a knapsack over the joint graph)
# is the anchor llmmem's plan at the same fraction is held to; llmmem's plan rows compile their blocks
# themselves (auto_checkpoint's compile_blocks, planned on the compiled blocks) and the model's graph
# breaks before each planned block. The baseline stays eager: the losses of every compiled row are
# compared with the model as written.
COMPILE_STRATEGIES = (
    Strategy("baseline", "eager fp32 (baseline)"),
    Strategy("compile", "torch.compile", compile=True),
    Strategy("compile+torch-every", "compile + torch checkpoint, every layer", checkpoint="torch", compile=True),
    Strategy(
        "compile+amb-50",
        "compile + activation_memory_budget 0.5",
        checkpoint="torch-budget",
        budget_fraction=0.5,
        compile=True,
    ),
    Strategy("compile+plan-50", "compile + llmmem plan 50%", checkpoint="auto", budget_fraction=0.5, compile=True),
    Strategy(
        "compile+amb-25",
        "compile + activation_memory_budget 0.25",
        checkpoint="torch-budget",
        budget_fraction=0.25,
        compile=True,
    ),
    Strategy("compile+plan-25", "compile + llmmem plan 25%", checkpoint="auto", budget_fraction=0.25, compile=True),
)

# Each compiled row costs a compilation (inductor on one CPU core: tens of seconds even for a tiny
# model), so the quick run keeps the rows the targets at 50% need.
COMPILE_QUICK_KEYS = ("baseline", "compile", "compile+amb-50", "compile+plan-50")


# --preset -> (the full run's preset, the quick run's), each a key of PRESETS
PRESET_FAMILIES = {
    "default": ("full", "quick"),
    "finetune": ("finetune", "finetune-quick"),
    "vocab": ("vocab", "vocab-quick"),
    "compile": ("compile", "compile-quick"),
}


def preset_name(family: str, quick: bool) -> str:
    """The key of :data:`PRESETS` that ``--preset family`` (with ``--quick``) runs."""
    return PRESET_FAMILIES[family][1 if quick else 0]


def strategies_of(preset: str) -> tuple:
    """The rows of ``preset`` (a key of :data:`PRESETS`)."""
    if preset.startswith("finetune"):
        return FINETUNE_STRATEGIES
    if preset.startswith("vocab"):
        return VOCAB_STRATEGIES
    if preset == "compile-quick":
        return tuple(s for s in COMPILE_STRATEGIES if s.key in COMPILE_QUICK_KEYS)
    if preset.startswith("compile"):
        return COMPILE_STRATEGIES
    return STRATEGIES


def by_key(keys, strategies=STRATEGIES) -> list[Strategy]:
    """The strategies of ``strategies`` named in ``keys`` (in table order); the baseline is always
    included first."""
    known = {s.key: s for s in strategies}
    unknown = [k for k in keys if k not in known]
    if unknown:
        raise ValueError(f"unknown strategies {unknown}; choose from {', '.join(known)}")
    wanted = set(keys) | {"baseline"}
    return [s for s in strategies if s.key in wanted]


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

    def worker_settings(self) -> dict:
        """What each row's worker needs beyond the model and run sizes (see the subclasses)."""
        return {}


@dataclass(frozen=True)
class FinetunePreset(Preset):
    """A model-state preset: each row also measures its peak at ``fit_layers`` layers, fits
    ``peak = a * params + b`` through that and its own size, and runs the model that the fit says
    is the largest to fit the baseline's peak (see :mod:`llmmem.compare.finetune`)."""

    fit_layers: int = 2

    def worker_settings(self) -> dict:
        # the rows search the largest model, from a line through two depths
        return {"search": "model", "fit_layers": self.fit_layers}


@dataclass(frozen=True)
class VocabPreset(Preset):
    """An LM-head preset: a vocabulary of ``vocab_size`` ids, the corpus read by the tokeniser
    ``tokens`` (a key of :data:`llmmem.compare.corpus.TOKENIZERS`), and the fused head's rows of
    logits a chunk (``head_chunk_size``; None: ``llmmem.linear_cross_entropy``'s own choice)."""

    tokens: str = "pairs"
    head_chunk_size: int | None = None

    def worker_settings(self) -> dict:
        return {"tokens": self.tokens, "head_chunk_size": self.head_chunk_size}


@dataclass(frozen=True)
class CompilePreset(Preset):
    """A compiled preset: the compiled rows use ``backend`` (a ``torch.compile`` backend), and every
    row's memory is measured outside the dispatcher (``memory="resident"``, see
    :func:`llmmem.compare.measure.resident_step`): LiveBytes, a dispatch mode, sees no buffer a
    compiled graph allocates, and Dynamo does not compile while one is active. No largest-batch
    search: each new batch would be a new compilation."""

    backend: str = "inductor"

    def worker_settings(self) -> dict:
        return {"compile_backend": self.backend, "memory": "resident", "search": "none"}


# Full: 10 layers of width 64 with 4 heads over 256 tokens: heads * seq / hidden = 16, as in GPT-3
# 175B at 2048 tokens, so attention's seq^2 activations weigh what they weigh in a large model, and
# activations are ~90% of the fp32 baseline's peak (parameters, gradients and Adam state ~10%). Ten
# layers, not fewer, so that one block's recompute (what no plan avoids) is well under 25% of the
# activations and a plan at 25% is feasible.
PRESETS = {
    "full": Preset(layers=10, hidden=64, heads=4, seq_len=256, batch=4, steps=20, search_trials=4),
    # Quick: a fraction of the width and length, the same heads * seq / hidden.
    "quick": Preset(layers=12, hidden=32, heads=4, seq_len=128, batch=2, steps=4, search_trials=3, profile_repeats=1),
    # Finetune: shaped like a full fine-tune, where the parameters, gradients and Adam's moments
    # (16 B a parameter in fp32) dominate the peak and activations are a small part: a wide model
    # (hidden 256: 3.2M parameters in 4 layers) over short sequences (32 tokens) at batch 2, so
    # that the fp32 baseline's model state is 90% of its measured peak (49.3 of 55.0 MiB; a 7B
    # Llama with its activations checkpointed: 95%, issue 23). The second depth of the fit is 8
    # layers, not 2: the lean row's plan at 50% is infeasible on 2 blocks (its least budget there
    # is ~58% of their activations), and the largest models are 5 to 16 layers deep, so a point
    # beyond the start extrapolates less. A row (30 steps beside the fp32 reference, the fit, the
    # largest model and the next one run) takes 5-8 s on one core of the loaded 2-core VM; 30
    # steps at a learning rate of 1e-3 take the loss from 5.5 to 3.0, far enough for the
    # final-loss ratios to show each technique's error.
    "finetune": FinetunePreset(
        layers=4, hidden=256, heads=4, seq_len=32, batch=2, steps=30, search_trials=3, fit_layers=8
    ),
    # The same shape at a quarter of the width, for CI (the lean row's plan is feasible at 4 layers).
    "finetune-quick": FinetunePreset(
        layers=4, hidden=64, heads=2, seq_len=16, batch=2, steps=4, search_trials=2, fit_layers=8, profile_repeats=1
    ),
    # Vocab: the LM head where it matters. A vocabulary of 32,768 ids (the corpus read as byte pairs,
    # 256 * b0 + b1), so that the plain head's logits (512 tokens x 32768 x 4 B = 64 MiB), their
    # log-softmax and their gradient are the step's largest activations. 8 layers of width 128 with
    # 16 heads over 256 tokens at batch 2, so that once the head is fused (its peak one chunk of
    # logits beside the [vocab x hidden] weight gradients) the blocks are most of what is left and a
    # plan at 50% of it is feasible, as in a large model whose blocks dwarf its head; with 4 layers it
    # is not. A step costs what the head costs (three [512 x 128] x [128 x 32768] matmuls and the
    # cross-entropy's passes over the logits), so a narrower model saves little time and a wider one
    # adds. Five steps at a learning rate of 3e-3 move the loss well below ln(32768) = 10.4; two
    # trials a largest-batch search. The planner profiles untimed (profile_repeats=0): it chooses on
    # work units, so the plan is the same, and a plan row's search, which plans again at each batch
    # it tries, is spared the timed repeats. Figures: benchmarks/README.md, "compare --preset vocab".
    "vocab": VocabPreset(
        layers=8,
        hidden=128,
        heads=16,
        seq_len=256,
        batch=2,
        steps=5,
        search_trials=2,
        vocab_size=32768,
        lr=3e-3,
        profile_repeats=0,
    ),
    # The same vocabulary at a quarter of the width over 128 tokens, for CI; chunks of 32 rows, so that
    # its 256 rows still make several (a default chunk would be all of its logits) and the plan at
    # 50% is feasible.
    "vocab-quick": VocabPreset(
        layers=8,
        hidden=32,
        heads=16,
        seq_len=128,
        batch=2,
        steps=3,
        search_trials=1,
        vocab_size=32768,
        lr=3e-3,
        profile_repeats=0,
        head_chunk_size=32,
    ),
    # Compile: inductor, the backend users train with (aot_eager would measure the partitioner's
    # choices but not inductor's buffer reuse). 6 layers of width 128 with 4 heads over 256 tokens at
    # batch 4 (heads * seq / hidden = 8): activations of tens of MiB, far above the resident set's
    # page-sized noise, and a plan at 25% feasible (one block's recompute is a sixth of them). Each
    # compiled row compiles its forward and backward once (about a minute on one loaded core). The
    # plans time their compiled blocks (3 repeats): they choose among them on measured seconds.
    "compile": CompilePreset(
        layers=6, hidden=128, heads=4, seq_len=256, batch=4, steps=10, search_trials=0, profile_repeats=3
    ),
    # For CI: 4 layers (a plan at 50% is feasible on them) of width 32 over 64 tokens; inductor still
    # takes 15-45 s a row to compile on one core (less once its on-disk cache holds the kernels).
    "compile-quick": CompilePreset(
        layers=4, hidden=32, heads=4, seq_len=64, batch=2, steps=4, search_trials=0, profile_repeats=0
    ),
}
