"""The estimator's run settings: precision and optimizer tables, and the validation of everything
but the model (batch, sequence, parallelism, ZeRO stage, checkpointing, attention, device type)."""

from __future__ import annotations

import dataclasses
import numbers
from dataclasses import dataclass

from llmmem.estimation import model_configs
from llmmem.estimation.model_configs import ModelConfig, choice, positive_int

__all__ = [
    "PRECISIONS",
    "OPTIMIZERS",
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
OPTIMIZERS = {"sgd": 0, "sgd-momentum": 1, "adam": 2, "adamw": 2}  # optimizer moments per parameter
DEVICE_TYPES = ("cuda", "cpu")


def parse_checkpointing(value) -> str:
    """``"none" | "selective" | "full" | "every-K"`` from a string or an int ``K`` (``K = 1`` is full)."""
    if isinstance(value, numbers.Integral) and not isinstance(value, bool):
        k = positive_int(value, "checkpointing")
    elif isinstance(value, str):
        key = value.strip().lower()
        if key in ("none", "selective", "full"):
            return key
        if not key.startswith("every-") or not key[6:].isdigit():
            raise ValueError(
                f"checkpointing: unknown value {value!r}; use none, selective, full, "
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
    return st


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
