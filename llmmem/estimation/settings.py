"""The estimator's run settings: precision and optimizer tables, and the validation of everything
but the model (batch, sequence, parallelism, ZeRO stage, checkpointing, attention, device type,
the optimizer's state format, master weights, the step in backward, the fused LM head)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from llmmem.estimation import model_configs
from llmmem.estimation.model_configs import ModelConfig, choice, positive_int
from llmmem.estimation.model_state import (
    DEFAULT_BLOCK,
    LLMMEM_OPTIMIZERS,
    MAX_BLOCK,
    MIN_BLOCK,
    MIN_QUANTIZED_NUMEL,
    QUANTIZED,
    TORCH_OPTIMIZERS,
)

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
    "LLMMEM_OPTIMIZERS",
    "DEVICE_TYPES",
    "Settings",
    "make_settings",
    "parse_checkpointing",
    "tp_indivisible",
    "check_tensor_parallel",
]

# bytes per parameter (see the module docstring) and per activation element
PRECISIONS = {
    "fp32": {"param": 4, "grad": 4, "master": 0, "moment": 4, "activation": 4},
    "fp16-mixed": {"param": 2, "grad": 2, "master": 4, "moment": 4, "activation": 2},
    "bf16-mixed": {"param": 2, "grad": 2, "master": 4, "moment": 4, "activation": 2},
    "bf16": {"param": 2, "grad": 2, "master": 0, "moment": 2, "activation": 2},
}
# optimizer moments per parameter: torch's (in the precision's moment dtype), then llmmem.optim's
# (in their own format, llmmem.estimation.model_state)
OPTIMIZERS = {**TORCH_OPTIMIZERS, **dict.fromkeys(LLMMEM_OPTIMIZERS, 2)}
DEVICE_TYPES = ("cuda", "cpu")


def parse_checkpointing(value) -> str:
    """``"none" | "selective" | "full" | "every-K"`` from a string or an int ``K`` (``K = 1`` is full;
    ``"all"`` is full too)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        k = positive_int(value, "checkpointing")
    elif isinstance(value, str):
        key = value.strip().lower()
        if key in ("none", "selective", "full"):
            return key
        if key == "all":
            return "full"
        if not key.startswith("every-") or not key[6:].isdigit():
            raise ValueError(
                f"checkpointing: unknown value {value!r}; use none, selective, full (or all), "
                "every-K (K a positive integer) or an integer K"
            )
        k = positive_int(int(key[6:]), "checkpointing")
    else:
        raise ValueError(f"checkpointing: expected none, selective, full, every-K or an integer, got {value!r}")
    return "full" if k == 1 else f"every-{k}"


@dataclass(frozen=True)
class Settings:
    """Validated, normalised run settings (everything but the model)."""

    batch: int
    seq: int
    precision: str
    optimizer: str
    zero_stage: int
    data_parallel: int
    tensor_parallel: int
    sequence_parallel: bool
    checkpointing: str
    attention: str
    device_type: str
    # resolved: whether an fp32 master copy exists (see make_settings); the llmmem formats'
    # block size and threshold (None for the other optimizers); the step inside backward
    master_weights: bool = False
    step_in_backward: bool = False
    block_size: int | None = None
    min_quantized_numel: int | None = None
    # the LM head and loss as llmmem.linear_cross_entropy computes them (llmmem.patch_lm_loss), and
    # its rows of logits a chunk (None: from its memory target)
    fused_head: bool = False
    head_chunk_size: int | None = None
    # an encoder-decoder's decoder length (its encoder's is seq); None: seq
    target_seq: int | None = None

    @property
    def decoder_seq(self) -> int:
        """The decoder's sequence length: ``target_seq``, else ``seq``."""
        return self.seq if self.target_seq is None else self.target_seq

    @property
    def state_dtype(self) -> str | None:
        """The llmmem.optim state format, or None for a torch optimizer."""
        return LLMMEM_OPTIMIZERS.get(self.optimizer)

    def recomputed_layers(self, layers: int) -> int:
        """Layers whose activations are dropped and recomputed (full or every-K recompute)."""
        if self.checkpointing == "full":
            return layers
        if self.checkpointing.startswith("every-"):
            return -(-layers // int(self.checkpointing[6:]))  # layers 0, K, 2K, ...
        return 0

    @property
    def devices(self) -> int:
        return self.data_parallel * self.tensor_parallel

    def public(self) -> dict:
        return dataclasses.asdict(self)


def make_settings(
    cfg: ModelConfig,
    *,
    batch,
    seq,
    precision,
    optimizer,
    zero_stage,
    data_parallel,
    tensor_parallel,
    sequence_parallel,
    checkpointing,
    attention,
    device_type,
    master_weights=None,
    step_in_backward=False,
    block_size=None,
    min_quantized_numel=None,
    fused_head=False,
    head_chunk_size=None,
    target_seq=None,
) -> Settings:
    if isinstance(zero_stage, bool) or not isinstance(zero_stage, numbers.Integral) or not 0 <= zero_stage <= 3:
        raise ValueError(f"zero_stage: must be 0, 1, 2 or 3, got {zero_stage!r}")
    if not isinstance(sequence_parallel, bool):
        raise ValueError(f"sequence_parallel: must be True or False, got {sequence_parallel!r}")
    st = Settings(
        batch=positive_int(batch, "batch"),
        seq=positive_int(seq, "seq"),
        precision=choice(precision, "precision", PRECISIONS),
        optimizer=choice(optimizer, "optimizer", OPTIMIZERS),
        zero_stage=int(zero_stage),
        data_parallel=positive_int(data_parallel, "data_parallel"),
        tensor_parallel=positive_int(tensor_parallel, "tensor_parallel"),
        sequence_parallel=sequence_parallel,
        checkpointing=parse_checkpointing(checkpointing),
        attention=cfg.attention
        if attention is None
        else choice(attention, "attention", model_configs.ATTENTION_KINDS),
        device_type=choice(device_type, "device_type", DEVICE_TYPES),
    )
    check_tensor_parallel(cfg, st.tensor_parallel)
    return dataclasses.replace(
        st,
        master_weights=_master(st.precision, st.optimizer, master_weights),
        step_in_backward=_step_in_backward(step_in_backward, st.data_parallel),
        **_format_settings(st.optimizer, block_size, min_quantized_numel),
        **_head_settings(fused_head, head_chunk_size),
        target_seq=_target_seq(cfg, target_seq),
    )


def _target_seq(cfg: ModelConfig, target_seq) -> int | None:
    if target_seq is None:
        return None
    if cfg.architecture != "encoder-decoder":
        raise ValueError(
            f"target_seq: the decoder's length of an encoder-decoder model; this model is {cfg.architecture}-only, "
            f"got {target_seq!r} (give seq alone)"
        )
    return positive_int(target_seq, "target_seq")


def _head_settings(fused_head, head_chunk_size) -> dict:
    if not isinstance(fused_head, bool):
        raise ValueError(f"fused_head: must be True or False, got {fused_head!r}")
    if head_chunk_size is not None:
        if not fused_head:
            raise ValueError(
                f"head_chunk_size: applies to the fused head (fused_head=True) only, got {head_chunk_size!r}"
            )
        head_chunk_size = positive_int(head_chunk_size, "head_chunk_size")
    return {"fused_head": fused_head, "head_chunk_size": head_chunk_size}


def _master(precision: str, optimizer: str, master_weights) -> bool:
    """Whether an fp32 master copy exists. None: what the precision says (the ``*-mixed`` modes
    keep one). A torch optimizer keeps no master of its own, so only the precision decides;
    llmmem.optim keeps one of 16-bit parameters when asked (``master_weights=True``) and needs
    one for fp16 parameters."""
    implied = PRECISIONS[precision]["master"] > 0
    if master_weights is None:
        return implied
    if not isinstance(master_weights, bool):
        raise ValueError(f"master_weights: must be None, True or False, got {master_weights!r}")
    if master_weights == implied:
        return implied
    if optimizer not in LLMMEM_OPTIMIZERS:
        raise ValueError(
            f"master_weights: {master_weights} contradicts precision {precision!r} with the torch optimizer "
            f"{optimizer!r}, which keeps no master copy of its own: the precision decides (bf16-mixed or "
            "fp16-mixed: an fp32 master; bf16 or fp32: none); master_weights=False with 16-bit weights needs an "
            "llmmem.optim optimizer (adamw-fp32, adamw-bf16, adamw-int8, adamw-int4)"
        )
    if precision == "fp32":
        raise ValueError("master_weights: fp32 parameters are their own master; llmmem.optim keeps no copy of them")
    if precision == "fp16-mixed":
        raise ValueError(
            "master_weights: llmmem.optim needs an fp32 master for fp16 parameters (their updates would be lost "
            "to fp16's rounding); use precision 'bf16' for 16-bit weights without a master"
        )
    return master_weights


def _step_in_backward(value, data_parallel: int) -> bool:
    if not isinstance(value, bool):
        raise ValueError(f"step_in_backward: must be True or False, got {value!r}")
    if value and data_parallel > 1:
        raise ValueError(
            f"step_in_backward: estimated for one data-parallel rank only (got data_parallel={data_parallel}): "
            "under DDP its gradient buckets keep every gradient, and FSDP's sharded gradients cannot be stepped "
            "in backward"
        )
    return value


def _format_settings(optimizer: str, block_size, min_quantized_numel) -> dict:
    """The block size and threshold of an llmmem quantized format (None for the others)."""
    dtype = LLMMEM_OPTIMIZERS.get(optimizer)
    if dtype not in QUANTIZED:
        for name, value in (("block_size", block_size), ("min_quantized_numel", min_quantized_numel)):
            if value is not None:
                raise ValueError(
                    f"{name}: applies to the quantized llmmem optimizers (adamw-int8, adamw-int4, adam-int8, "
                    f"adam-int4), not {optimizer!r}; got {value!r}"
                )
        return {"block_size": None, "min_quantized_numel": None}
    if block_size is None:
        block_size = DEFAULT_BLOCK[dtype]
    elif isinstance(block_size, bool) or not isinstance(block_size, numbers.Integral):
        raise ValueError(
            f"block_size: must be an integer power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block_size!r}"
        )
    elif not MIN_BLOCK <= block_size <= MAX_BLOCK or block_size & (block_size - 1):
        raise ValueError(f"block_size: must be a power of two in [{MIN_BLOCK}, {MAX_BLOCK}], got {block_size}")
    if min_quantized_numel is None:
        min_quantized_numel = MIN_QUANTIZED_NUMEL
    elif (
        isinstance(min_quantized_numel, bool)
        or not isinstance(min_quantized_numel, numbers.Integral)
        or min_quantized_numel < 0
    ):
        raise ValueError(f"min_quantized_numel: must be an integer >= 0, got {min_quantized_numel!r}")
    return {"block_size": int(block_size), "min_quantized_numel": int(min_quantized_numel)}


def tp_indivisible(cfg: ModelConfig, t: int) -> tuple[str, int] | None:
    """The first of heads, kv_heads, ffn that ``t`` does not divide, as (name, size); None if all.
    Megatron splits attention by heads and the MLP by columns: each rank needs whole heads."""
    for what, n in (("heads", cfg.heads), ("kv_heads", cfg.kv_heads), ("ffn", cfg.ffn)):
        if n % t:
            return what, n
    return None


def check_tensor_parallel(cfg: ModelConfig, t: int) -> None:
    bad = tp_indivisible(cfg, t)
    if bad is not None:
        raise ValueError(f"tensor_parallel: size {t} does not divide {bad[0]} ({bad[1]})")
