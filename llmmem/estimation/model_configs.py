"""Transformer dimensions for the memory estimator: :class:`ModelConfig`, the named models, and
the conversion of user input (a name, a dict, a dataclass, an ``nn.Module``'s config) into one.

Pure Python; nothing here imports torch.

Parameter counts (elements, not bytes), for hidden size ``h``, ``a`` heads of size ``d = h/a``,
``k`` key/value heads (grouped-query attention, Ainslie et al. 2023; ``k = a`` is plain
multi-head attention), MLP width ``f``, vocabulary ``V``:

- attention: ``h·(h + 2·k·d)`` for the Q, K, V projections plus ``h·h`` for the output projection;
- MLP: ``2·h·f`` for GELU (up, down), ``3·h·f`` for SwiGLU (gate, up, down; Shazeer 2020);
- norms: ``2·h`` per LayerNorm (weight, bias), ``h`` per RMSNorm; two per layer plus a final one;
- biases when ``bias=True``: ``(h + 2·k·d) + h`` (attention) and ``f + h`` (GELU MLP) or ``2f + h`` (SwiGLU);
- embeddings: ``V·h``, a second ``V·h`` for an untied output head, ``max(max_positions, seq)·h``
  for a learned position table (GPT-2); rotary positions (LLaMA) have no parameters.

With these, llama-7b (32 layers, h 4096, 32 heads, f 11008, V 32000) has 6.74e9 parameters,
llama-13b (40, 5120, 40, 13824) 13.0e9, llama-2-70b (80, 8192, 64 heads, 8 kv heads, f 28672)
69.0e9 (Touvron et al. 2023, tables 1 and 2 of the Llama 2 paper), gpt2 124e6 and gpt2-xl 1.56e9
(Radford et al. 2019; the Hugging Face checkpoints).
"""

from __future__ import annotations

import dataclasses
import math
import numbers
from dataclasses import dataclass, field

MLP_KINDS = ("gelu", "swiglu")
NORM_KINDS = ("layernorm", "rmsnorm")
POSITION_KINDS = ("learned", "rotary")
ATTENTION_KINDS = ("explicit", "sdpa")


def positive_int(value, name: str) -> int:
    # bool is an int subclass; True as a layer count is a bug in the caller, not a 1.
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    if value <= 0:
        raise ValueError(f"{name}: must be a positive integer, got {value!r}")
    return int(value)


def choice(value, name: str, choices) -> str:
    key = value.strip().lower() if isinstance(value, str) else None
    if key not in choices:
        raise ValueError(f"{name}: unknown value {value!r}; choose one of {', '.join(choices)}")
    return key


@dataclass(frozen=True)
class ModelConfig:
    """Dimensions of a decoder-only transformer.

    ``kv_heads`` defaults to ``heads``. ``ffn`` defaults to ``4·hidden`` for a GELU MLP and, for
    SwiGLU, to LLaMA's rule ``256·ceil((8·hidden/3) / 256)`` (which gives 11008 for hidden 4096
    and 13824 for 5120). ``dropout`` is the dropout probability used on the attention
    probabilities, the residual branches and the embeddings (GPT-2: 0.1, LLaMA: 0); it decides
    whether dropout masks are saved for backward. ``attention`` is how the model computes
    attention: ``"explicit"`` (scores materialised, as Megatron's formula assumes) or ``"sdpa"``
    (a fused kernel such as flash attention that keeps no ``s x s`` tensor).
    """

    layers: int
    hidden: int
    heads: int
    vocab: int
    kv_heads: int | None = None
    ffn: int | None = None
    mlp: str = "gelu"
    norm: str = "layernorm"
    tied_embeddings: bool = True
    positions: str = "learned"
    max_positions: int = 0
    bias: bool = True
    dropout: float = 0.0
    attention: str = "explicit"
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        for key in ("layers", "hidden", "heads", "vocab"):
            set_(self, key, positive_int(getattr(self, key), key))
        set_(self, "mlp", choice(self.mlp, "mlp", MLP_KINDS))
        set_(self, "norm", choice(self.norm, "norm", NORM_KINDS))
        set_(self, "positions", choice(self.positions, "positions", POSITION_KINDS))
        set_(self, "attention", choice(self.attention, "attention", ATTENTION_KINDS))
        set_(self, "kv_heads", self.heads if self.kv_heads is None else positive_int(self.kv_heads, "kv_heads"))
        if self.hidden % self.heads:
            raise ValueError(f"heads: {self.heads} heads do not divide hidden size {self.hidden}")
        if self.heads % self.kv_heads:
            raise ValueError(f"kv_heads: {self.kv_heads} key/value heads do not divide {self.heads} heads")
        if self.ffn is None:
            ffn = 4 * self.hidden if self.mlp == "gelu" else 256 * math.ceil(8 * self.hidden / 3 / 256)
            set_(self, "ffn", ffn)
        else:
            set_(self, "ffn", positive_int(self.ffn, "ffn"))
        if (
            isinstance(self.max_positions, bool)
            or not isinstance(self.max_positions, numbers.Integral)
            or self.max_positions < 0
        ):
            raise ValueError(f"max_positions: must be an integer >= 0, got {self.max_positions!r}")
        if (
            isinstance(self.dropout, bool)
            or not isinstance(self.dropout, numbers.Real)
            or not 0.0 <= self.dropout < 1.0
        ):
            raise ValueError(f"dropout: must be a probability in [0, 1), got {self.dropout!r}")
        for key in ("tied_embeddings", "bias"):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}: must be True or False, got {getattr(self, key)!r}")

    @property
    def head_dim(self) -> int:
        return self.hidden // self.heads

    # -- parameter counts (elements) -------------------------------------------------------------
    def layer_parameters(self, tensor_parallel: int = 1) -> int:
        """Parameters of one transformer layer held by one tensor-parallel rank.

        Megatron's split (Shoeybi et al. 2019): the Q/K/V and first MLP projections are
        column-parallel (weights and biases divided by ``t``), the attention output and MLP down
        projections row-parallel (weights divided, biases replicated); norms are replicated.
        """
        h, f, t = self.hidden, self.ffn, tensor_parallel
        qkv_out = h + 2 * self.kv_heads * self.head_dim
        mlp_mats = 2 if self.mlp == "gelu" else 3
        sharded = h * qkv_out + h * h + mlp_mats * h * f
        replicated = 2 * self._norm_parameters()
        if self.bias:
            sharded += qkv_out + (mlp_mats - 1) * f  # column-parallel biases
            replicated += 2 * h  # row-parallel biases (attention output, MLP down)
        return -(-sharded // t) + replicated

    def _norm_parameters(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" else self.hidden

    def parameters(self, seq: int = 0, tensor_parallel: int = 1) -> int:
        """All parameters (tied embeddings counted once) held by one tensor-parallel rank.

        The token embedding (and an untied head) is vocabulary-parallel: ``ceil(V/t)·h`` per rank.
        A learned position table needs ``max(max_positions, seq)`` rows and is replicated.
        """
        t = tensor_parallel
        vocab_rows = -(-self.vocab // t)
        n = self.layers * self.layer_parameters(t) + self._norm_parameters()
        n += vocab_rows * self.hidden * (1 if self.tied_embeddings else 2)
        if self.positions == "learned":
            n += max(self.max_positions, seq) * self.hidden
        return n

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv heads" if self.kv_heads != self.heads else ""
        return (
            f"{self.layers} layers, hidden {self.hidden}, {self.heads} heads{kv}, "
            f"ffn {self.ffn} ({self.mlp}), vocab {self.vocab}"
        )


def _gpt2(layers: int, hidden: int, heads: int, name: str) -> ModelConfig:
    # Radford et al. 2019; Hugging Face config: n_positions 1024, vocab 50257, dropout 0.1 everywhere.
    return ModelConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        vocab=50257,
        mlp="gelu",
        norm="layernorm",
        tied_embeddings=True,
        positions="learned",
        max_positions=1024,
        bias=True,
        dropout=0.1,
        name=name,
    )


def _llama(layers: int, hidden: int, heads: int, ffn: int, name: str, kv_heads: int | None = None) -> ModelConfig:
    # Touvron et al. 2023: RMSNorm, SwiGLU, rotary positions, no biases, untied head, no dropout.
    return ModelConfig(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=kv_heads,
        ffn=ffn,
        vocab=32000,
        mlp="swiglu",
        norm="rmsnorm",
        tied_embeddings=False,
        positions="rotary",
        bias=False,
        dropout=0.0,
        name=name,
    )


NAMED_MODELS: dict[str, ModelConfig] = {
    "gpt2": _gpt2(12, 768, 12, "gpt2"),
    "gpt2-medium": _gpt2(24, 1024, 16, "gpt2-medium"),
    "gpt2-large": _gpt2(36, 1280, 20, "gpt2-large"),
    "gpt2-xl": _gpt2(48, 1600, 25, "gpt2-xl"),
    "llama-7b": _llama(32, 4096, 32, 11008, "llama-7b"),
    "llama-13b": _llama(40, 5120, 40, 13824, "llama-13b"),
    # Llama 2 70B: grouped-query attention with 8 key/value heads.
    "llama-70b": _llama(80, 8192, 64, 28672, "llama-70b", kv_heads=8),
}

# Keys other libraries use for the same dimensions (GPTConfig of llmmem.models.gpt, Hugging Face).
_ALIASES = {
    "n_layer": "layers",
    "num_hidden_layers": "layers",
    "num_layers": "layers",
    "n_embd": "hidden",
    "hidden_size": "hidden",
    "d_model": "hidden",
    "n_head": "heads",
    "num_attention_heads": "heads",
    "num_key_value_heads": "kv_heads",
    "n_kv_heads": "kv_heads",
    "ffn_hidden": "ffn",
    "intermediate_size": "ffn",
    "n_inner": "ffn",
    "vocab_size": "vocab",
    "seq_len": "max_positions",
    "n_positions": "max_positions",
    "max_position_embeddings": "max_positions",
    "tie_word_embeddings": "tied_embeddings",
}
_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def lookup(name: str) -> ModelConfig:
    """The named model (case-insensitive); ValueError listing the known names otherwise."""
    key = name.strip().lower()
    if key not in NAMED_MODELS:
        raise ValueError(
            f"model: unknown model name {name!r}; known models: {', '.join(NAMED_MODELS)} "
            "(or give explicit dimensions: layers, hidden, heads, kv_heads, ffn, vocab)"
        )
    return NAMED_MODELS[key]


def from_mapping(mapping, *, strict: bool = True, name: str = "custom") -> ModelConfig:
    """A :class:`ModelConfig` from a dict of dimensions, accepting the aliases in ``_ALIASES``.

    ``strict`` rejects unknown keys (a typo in a user's dict); configs read off an ``nn.Module``
    carry many unrelated keys, so they are read with ``strict=False``.
    """
    kwargs = {}
    for key, value in mapping.items():
        target = key if key in _FIELDS else _ALIASES.get(key)
        if target is None:
            if strict:
                raise ValueError(f"model: unknown dimension {key!r}; known: {', '.join(sorted(_FIELDS - {'name'}))}")
            continue
        if value is None and target in ("kv_heads", "ffn"):
            continue  # "use the default"
        kwargs[target] = value
    kwargs.setdefault("name", name)
    missing = [k for k in ("layers", "hidden", "heads", "vocab") if k not in kwargs]
    if missing:
        raise ValueError(f"model: missing dimension(s) {', '.join(missing)}")
    return ModelConfig(**kwargs)


def resolve(model) -> tuple[ModelConfig, int | None]:
    """``(config, counted parameters or None)`` for a name, a dict, a dataclass or an ``nn.Module``.

    An ``nn.Module`` is recognised without importing torch (only an imported torch can have made
    one); its parameters are counted (shared ones once) and its dimensions read from its ``cfg`` or
    ``config`` attribute.
    """
    if isinstance(model, ModelConfig):
        return model, None
    if isinstance(model, str):
        return lookup(model), None
    if isinstance(model, dict):
        return from_mapping(model), None
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        return from_mapping(dataclasses.asdict(model), name=type(model).__name__), None
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        counted = sum(p.numel() for p in model.parameters())
        cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
        if cfg is None:
            raise ValueError(
                f"model: this {type(model).__name__} has no .cfg or .config attribute with its dimensions; "
                "pass a dict of dimensions instead (layers, hidden, heads, kv_heads, ffn, vocab)"
            )
        if dataclasses.is_dataclass(cfg):
            mapping = dataclasses.asdict(cfg)
        elif isinstance(cfg, dict):
            mapping = cfg
        else:
            mapping = dict(vars(cfg))
        return from_mapping(mapping, strict=False, name=type(model).__name__), counted
    raise ValueError(
        f"model: expected a model name, a dict or dataclass of dimensions, or an nn.Module, got {type(model).__name__}"
    )
