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
import sys
from dataclasses import dataclass, field

from llmmem.estimation import hf_encoders, hf_moe, hf_multimodal

MLP_KINDS = ("gelu", "swiglu")
# The MLP's activation, as implemented: "gelu" (one kernel, torch's exact or tanh GELU), "gelu_new"
# (the tanh approximation written as elementwise operators, Hugging Face's GPT-2), "relu", "silu".
ACTIVATIONS = ("gelu", "gelu_new", "relu", "silu")
NORM_KINDS = ("layernorm", "rmsnorm")
# "relative": T5's bucketed position biases added to the attention scores (a table a stack)
POSITION_KINDS = ("learned", "rotary", "relative")
ARCHITECTURES = ("decoder", "encoder", "encoder-decoder")
QK_NORMS = ("none", "head", "width")
# the task head an architecture may carry (the first one is its default)
ARCHITECTURE_TASKS = {
    "decoder": ("causal-lm",),
    "encoder-decoder": ("seq2seq-lm",),
    "encoder": (
        "sequence-classification",
        "masked-lm",
        "token-classification",
        "image-classification",
        "question-answering",
    ),
}
# tasks whose head is a vocabulary-sized matrix (tied to the token embedding or not)
VOCAB_TASKS = ("causal-lm", "seq2seq-lm", "masked-lm")
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

    ``kv_heads`` defaults to ``heads``, ``head_dim`` to ``hidden / heads``. ``ffn`` defaults to
    ``4·hidden`` for a GELU MLP and, for SwiGLU, to LLaMA's rule ``256·ceil((8·hidden/3) / 256)``
    (which gives 11008 for hidden 4096 and 13824 for 5120). ``mlp`` is ``"gelu"`` (two matrices)
    or ``"swiglu"`` (gated, three); ``activation`` is how its nonlinearity is written (see
    :data:`ACTIVATIONS`; default ``"gelu"`` resp. ``"silu"``). ``norm`` is ``"layernorm"`` or
    ``"rmsnorm"``; ``fused_norm`` whether it is one kernel (default: LayerNorm yes, RMSNorm no, as
    Hugging Face and Meta write it, from elementwise operators that keep more). ``dropout`` is the
    dropout probability on the residual branches and the embeddings and, unless
    ``attention_dropout`` says otherwise, on the attention probabilities (GPT-2: 0.1, LLaMA: 0);
    ``hidden_dropout`` overrides the former. ``attention`` is how the model computes attention:
    ``"explicit"`` (scores materialised, as Megatron's formula assumes; grouped key/value heads
    repeated to every head) or ``"sdpa"`` (a fused kernel that keeps no ``s x s`` tensor).

    Mixture of experts (Mixtral, Qwen2-MoE, Qwen3-MoE): ``experts`` routed experts per layer (0, the
    default: a dense MLP of width ``ffn``), each a ``mlp`` of width ``expert_ffn`` (default ``ffn``),
    ``experts_per_token`` of them run for each token (top-k) after a router (``h x experts``, no
    bias); ``shared_ffn`` the width of the shared experts that every token runs (0: none), with a
    one-output sigmoid gate when ``shared_gate``; ``dense_layers`` of the ``layers`` have the dense
    MLP of width ``ffn`` instead (Qwen2-MoE's ``mlp_only_layers`` and ``decoder_sparse_step``).
    Parameters and model state count every expert; activations the ``experts_per_token`` an
    average token runs (capacity is not capped: Hugging Face's experts drop no token).

    Beyond decoders (``architecture``): an ``"encoder-decoder"`` (T5, BART) has ``layers`` encoder
    layers and ``decoder_layers`` decoder layers, each of those with cross-attention over the
    encoder's output (a norm, Q/K/V and output projections as its self-attention's), and a final
    norm and (learned) position table a stack; an ``"encoder"`` (BERT, ViT) attends both ways.
    ``task`` is the head: ``"causal-lm"`` (decoders), ``"seq2seq-lm"`` (encoder-decoders),
    ``"sequence-classification"`` (an encoder's default), ``"token-classification"``,
    ``"masked-lm"``, ``"question-answering"`` (a start and an end logit a token, each a softmax over
    the sequence) or ``"image-classification"`` (ViT, ``vocab`` 0: patches, no tokens); only the
    ``*-lm`` tasks have a vocabulary-sized head, the classifiers ``num_labels`` outputs.
    ``activation_dropout``: dropout on the MLP's hidden (T5, BART). ``extra_tensors``: element
    counts of the parameters outside the layers, embeddings and norms that the config reader found
    (token types, position buckets, a patch convolution, a pooler, the task head's own layers).
    ``image_tokens``: the sequence an image makes (ViT: patches + class token), the default ``seq``.

    Norms beyond the two a layer (each of the same ``norm`` kind): ``qk_norm`` ``"head"`` (an
    RMSNorm of every query and key head, weights of ``head_dim``: Qwen3, Gemma 3) or ``"width"``
    (of all the queries and all the keys together: OLMo 2), else ``"none"``; ``sandwich_norm``:
    also a norm after attention and after the MLP (Gemma 2 and 3: four a layer).
    ``attention_softcap`` / ``logit_softcap``: ``cap·tanh(x/cap)`` on the attention scores / the
    head's logits (Gemma 2), whose tanh output backward keeps.

    ``parallel_attention``: attention and the MLP both read one norm's output, added to the
    residual together (Falcon's ``parallel_attn`` with one norm): one norm a layer, and the
    MLP's input is the Q/K/V projection's (kept once). ``kv_broadcast``: the model hands SDPA its
    key/value heads unrepeated, without ``enable_gqa`` (Falcon's multi-query attention); no fused
    kernel takes heads that differ in number, so PyTorch runs its math path, which keeps the
    ``s x s`` probabilities and K, V expanded to every head, as explicit attention does.
    ``norm_bias``: whether a LayerNorm has a bias beside its weight (DBRX's have none).
    ``clip_qkv``: the fused Q/K/V projection's output is clamped (DBRX), which keeps its input, and
    the value heads, views of the clamped output, keep all of it.
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
    activation: str | None = None
    fused_norm: bool | None = None
    head_dim: int | None = None
    attention_dropout: float | None = None
    hidden_dropout: float | None = None
    qkv_bias: bool = False
    experts: int = 0
    experts_per_token: int = 0
    expert_ffn: int | None = None
    shared_ffn: int = 0
    shared_gate: bool = False
    dense_layers: int = 0
    architecture: str = "decoder"
    decoder_layers: int = 0
    task: str | None = None
    num_labels: int = 2
    activation_dropout: float = 0.0
    extra_tensors: tuple = ()
    image_tokens: int = 0
    qk_norm: str = "none"
    sandwich_norm: bool = False
    attention_softcap: bool = False
    logit_softcap: bool = False
    parallel_attention: bool = False
    kv_broadcast: bool = False
    norm_bias: bool = True
    clip_qkv: bool = False
    name: str = field(default="custom", compare=False)

    def __post_init__(self) -> None:
        set_ = object.__setattr__  # frozen: normalise once, here
        self._check_architecture(set_)
        for key in ("layers", "hidden", "heads") + (("vocab",) if self.task != "image-classification" else ()):
            set_(self, key, positive_int(getattr(self, key), key))
        set_(self, "mlp", choice(self.mlp, "mlp", MLP_KINDS))
        set_(self, "norm", choice(self.norm, "norm", NORM_KINDS))
        set_(self, "positions", choice(self.positions, "positions", POSITION_KINDS))
        set_(self, "attention", choice(self.attention, "attention", ATTENTION_KINDS))
        set_(self, "kv_heads", self.heads if self.kv_heads is None else positive_int(self.kv_heads, "kv_heads"))
        if self.head_dim is None:
            if self.hidden % self.heads:
                raise ValueError(f"heads: {self.heads} heads do not divide hidden size {self.hidden}")
            set_(self, "head_dim", self.hidden // self.heads)
        else:
            set_(self, "head_dim", positive_int(self.head_dim, "head_dim"))
        default_act = "gelu" if self.mlp == "gelu" else "silu"
        set_(
            self,
            "activation",
            default_act if self.activation is None else choice(self.activation, "activation", ACTIVATIONS),
        )
        if self.fused_norm is None:
            set_(self, "fused_norm", self.norm == "layernorm")
        elif not isinstance(self.fused_norm, bool):
            raise ValueError(f"fused_norm: must be True or False, got {self.fused_norm!r}")
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
        for key in ("dropout", "attention_dropout", "hidden_dropout", "activation_dropout"):
            value = getattr(self, key)
            if key != "dropout" and value is None:
                set_(self, key, self.dropout)
                continue
            if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0.0 <= value < 1.0:
                raise ValueError(f"{key}: must be a probability in [0, 1), got {value!r}")
        set_(self, "qk_norm", choice(self.qk_norm, "qk_norm", QK_NORMS))
        for key in (
            "tied_embeddings",
            "bias",
            "qkv_bias",
            "sandwich_norm",
            "attention_softcap",
            "logit_softcap",
            "parallel_attention",
            "kv_broadcast",
            "norm_bias",
            "clip_qkv",
        ):
            if not isinstance(getattr(self, key), bool):
                raise ValueError(f"{key}: must be True or False, got {getattr(self, key)!r}")
        self._check_experts(set_)

    def _check_architecture(self, set_) -> None:
        set_(self, "architecture", choice(self.architecture, "architecture", ARCHITECTURES))
        tasks = ARCHITECTURE_TASKS[self.architecture]
        set_(self, "task", tasks[0] if self.task is None else choice(self.task, "task", tasks))
        if self.architecture == "encoder-decoder":
            set_(self, "decoder_layers", positive_int(self.decoder_layers, "decoder_layers"))
        elif self.decoder_layers:
            raise ValueError(
                f"decoder_layers: only an encoder-decoder has a second stack, got {self.decoder_layers!r}"
            )
        if self.architecture != "decoder" and self.experts:
            raise ValueError(
                f"experts: the estimator reads mixtures of experts in decoders only, not an {self.architecture}"
            )
        set_(self, "num_labels", positive_int(self.num_labels, "num_labels"))
        if self.task == "image-classification":
            if isinstance(self.vocab, bool) or not isinstance(self.vocab, numbers.Integral) or self.vocab < 0:
                raise ValueError(f"vocab: must be an integer >= 0, got {self.vocab!r}")
            set_(self, "vocab", int(self.vocab))
        for key in ("image_tokens",):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{key}: must be an integer >= 0, got {v!r}")
        extra = tuple(self.extra_tensors)
        if any(isinstance(n, bool) or not isinstance(n, numbers.Integral) or n <= 0 for n in extra):
            raise ValueError(f"extra_tensors: must be positive element counts, got {self.extra_tensors!r}")
        set_(self, "extra_tensors", tuple(int(n) for n in extra))

    @property
    def layer_norms(self) -> int:
        """Norms of the hidden width a layer: one shared by parallel attention and MLP, two
        (before attention, before the MLP), or four with Gemma's norms after each."""
        return 1 if self.parallel_attention else 4 if self.sandwich_norm else 2

    @property
    def stacks(self) -> int:
        """Stacks of layers: 2 for an encoder-decoder, else 1 (each has its final norm and positions)."""
        return 2 if self.architecture == "encoder-decoder" else 1

    @property
    def total_layers(self) -> int:
        """Layers of every stack."""
        return self.layers + self.decoder_layers

    @property
    def vocab_head(self) -> bool:
        """Whether the head is a vocabulary-sized matrix (the ``*-lm`` tasks)."""
        return self.task in VOCAB_TASKS

    def _check_experts(self, set_) -> None:
        for key in ("experts", "experts_per_token", "shared_ffn", "dense_layers"):
            v = getattr(self, key)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 0:
                raise ValueError(f"{key}: must be an integer >= 0, got {v!r}")
            set_(self, key, int(v))
        if not isinstance(self.shared_gate, bool):
            raise ValueError(f"shared_gate: must be True or False, got {self.shared_gate!r}")
        if not self.experts:
            if self.experts_per_token or self.expert_ffn is not None or self.shared_ffn or self.dense_layers:
                raise ValueError(
                    "experts: experts_per_token, expert_ffn, shared_ffn and dense_layers describe a mixture of "
                    "experts; give its number of experts too"
                )
            return
        if not 1 <= self.experts_per_token <= self.experts:
            raise ValueError(
                f"experts_per_token: must be between 1 and experts ({self.experts}), got {self.experts_per_token!r}"
            )
        if self.dense_layers > self.layers:
            raise ValueError(f"dense_layers: {self.dense_layers} is more than the {self.layers} layers")
        set_(self, "expert_ffn", self.ffn if self.expert_ffn is None else positive_int(self.expert_ffn, "expert_ffn"))

    @property
    def moe_layers(self) -> int:
        """Layers with experts (0 for a dense model)."""
        return self.layers - self.dense_layers if self.experts else 0

    # -- parameter counts (elements) -------------------------------------------------------------
    def _mlp_parameters(self, width: int, t: int) -> tuple[int, int]:
        """(sharded, replicated) parameters of one ``mlp`` of ``width`` (Megatron's split)."""
        h = self.hidden
        mats = 2 if self.mlp == "gelu" else 3
        sharded, replicated = mats * h * width, 0
        if self.bias:
            sharded += (mats - 1) * width  # column-parallel biases
            replicated += h  # the row-parallel down projection's bias
        return sharded, replicated

    def cross_attention_parameters(self, tensor_parallel: int = 1) -> int:
        """A decoder layer's cross-attention (its norm, Q/K/V and output projections, as its
        self-attention's) on one tensor-parallel rank; 0 outside an encoder-decoder."""
        if self.architecture != "encoder-decoder":
            return 0
        h, t = self.hidden, tensor_parallel
        width = self.heads * self.head_dim
        qkv_out = width + 2 * self.kv_heads * self.head_dim
        sharded = h * qkv_out + width * h + (qkv_out if self.bias or self.qkv_bias else 0)
        return -(-sharded // t) + self._norm_parameters() + (h if self.bias else 0)

    def layer_parameters(self, tensor_parallel: int = 1, moe: bool | None = None) -> int:
        """Parameters of one transformer layer held by one tensor-parallel rank.

        Megatron's split (Shoeybi et al. 2019): the Q/K/V and first MLP projections are
        column-parallel (weights and biases divided by ``t``), the attention output and MLP down
        projections row-parallel (weights divided, biases replicated); norms are replicated.
        ``moe``: a layer with experts (the default for a mixture of experts: the largest layer),
        whose router and shared-expert gate are replicated and experts split as MLPs are.
        """
        h, t = self.hidden, tensor_parallel
        moe = bool(self.experts) if moe is None else moe and bool(self.experts)
        width = self.heads * self.head_dim  # h unless head_dim is set otherwise
        qkv_out = width + 2 * self.kv_heads * self.head_dim
        sharded = h * qkv_out + width * h
        replicated = self.layer_norms * self._norm_parameters() + self.qk_norm_parameters()
        if self.bias or self.qkv_bias:
            sharded += qkv_out  # column-parallel biases
        if self.bias:
            replicated += h  # the attention output's (row-parallel)
        if moe:
            mlp, rep = self._mlp_parameters(self.expert_ffn, t)
            sharded += self.experts * mlp
            replicated += self.experts * rep + h * self.experts  # the router
            if self.shared_ffn:
                mlp, rep = self._mlp_parameters(self.shared_ffn, t)
                sharded += mlp
                replicated += rep + (h if self.shared_gate else 0)
        else:
            mlp, rep = self._mlp_parameters(self.ffn, t)
            sharded += mlp
            replicated += rep
        return -(-sharded // t) + replicated

    def qk_norm_parameters(self) -> int:
        """A layer's query and key norms' weights (and biases, for LayerNorm)."""
        if self.qk_norm == "none":
            return 0
        width = 2 * self.head_dim if self.qk_norm == "head" else (self.heads + self.kv_heads) * self.head_dim
        return width * (2 if self.norm == "layernorm" else 1)

    def _norm_parameters(self) -> int:
        return 2 * self.hidden if self.norm == "layernorm" and self.norm_bias else self.hidden

    def parameters(self, seq: int = 0, tensor_parallel: int = 1) -> int:
        """All parameters (tied embeddings counted once) held by one tensor-parallel rank.

        The token embedding (and an untied head) is vocabulary-parallel: ``ceil(V/t)·h`` per rank.
        A learned position table needs ``max(max_positions, seq)`` rows and is replicated.
        """
        t = tensor_parallel
        vocab_rows = -(-self.vocab // t)
        moe = self.moe_layers
        n = moe * self.layer_parameters(t, moe=True) + (self.layers - moe) * self.layer_parameters(t, moe=False)
        n += self.decoder_layers * (self.layer_parameters(t) + self.cross_attention_parameters(t))
        n += self.stacks * self._norm_parameters()  # a final norm a stack (BERT: its embeddings' norm)
        n += vocab_rows * self.hidden * (1 if self.tied_embeddings or not self.vocab_head else 2)
        if self.positions == "learned":
            n += self.stacks * max(self.max_positions, seq) * self.hidden
        return n + sum(self.extra_tensors)

    def describe(self) -> str:
        kv = f", {self.kv_heads} kv heads" if self.kv_heads != self.heads else ""
        act = "" if self.activation == ("gelu" if self.mlp == "gelu" else "silu") else f", {self.activation}"
        mlp = f"ffn {self.ffn} ({self.mlp}{act})"
        if self.experts:
            shared = f" + shared {self.shared_ffn}" if self.shared_ffn else ""
            dense = f", {self.dense_layers} dense layers of ffn {self.ffn}" if self.dense_layers else ""
            mlp = (
                f"{self.experts} experts of ffn {self.expert_ffn} ({self.mlp}{act}), top-{self.experts_per_token}"
                f"{shared}{dense}"
            )
        layers = f"{self.layers} layers"
        if self.architecture == "encoder-decoder":
            layers = f"encoder {self.layers} + decoder {self.decoder_layers} layers (cross-attention)"
        elif self.architecture == "encoder":
            layers = f"encoder, {self.layers} layers"
        head = ""
        if self.task != "causal-lm":
            labels = "" if self.vocab_head else f", {self.num_labels} labels"
            head = f", task {self.task}{labels}"
        vocab = f", vocab {self.vocab}" if self.vocab else ""
        return f"{layers}, hidden {self.hidden}, {self.heads} heads{kv}, {mlp}{vocab}{head}"


def _gpt2(layers: int, hidden: int, heads: int, name: str) -> ModelConfig:
    # Radford et al. 2019; Hugging Face config: n_positions 1024, vocab 50257, dropout 0.1 everywhere,
    # activation "gelu_new" (elementwise operators).
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
        activation="gelu_new",
        name=name,
    )


def _llama(layers: int, hidden: int, heads: int, ffn: int, name: str, kv_heads: int | None = None) -> ModelConfig:
    # Touvron et al. 2023: RMSNorm (unfused, as in Meta's and Hugging Face's code), SwiGLU, rotary
    # positions, no biases, untied head, no dropout.
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


def resolve(model, task: str | None = None) -> tuple[ModelConfig, int | None]:
    """``(config, counted parameters or None)`` for a name, a dict, a dataclass, a Hugging Face
    config or an ``nn.Module``.

    An ``nn.Module`` is recognised without importing torch (only an imported torch can have made
    one); its parameters are counted (shared ones once) and its dimensions read from its ``cfg`` or
    ``config`` attribute (a Hugging Face config is read for its architecture too). ``task``: the
    head (see :class:`ModelConfig`); a Hugging Face model's class names its own, which a ``task``
    that differs contradicts (ValueError).
    """
    if task is not None:
        task = choice(task, "task", hf_encoders.TASKS)
    cfg, counted = _resolve(model, task)
    if task is not None and cfg.task != task:
        if counted is not None and is_hf_config(getattr(model, "config", None)):
            raise ValueError(f"task: {task!r}, but the model is a {type(model).__name__}, whose head is {cfg.task!r}")
        cfg = dataclasses.replace(cfg, task=task)
    return cfg, counted


def _resolve(model, task):
    if isinstance(model, ModelConfig):
        return model, None
    if isinstance(model, str):
        return lookup(model), None
    if isinstance(model, dict):
        return from_mapping(model), None
    if is_hf_config(model):  # (before dataclasses: Hugging Face's configs are dataclasses since 5.0)
        return from_hf_config(model, task), None
    if dataclasses.is_dataclass(model) and not isinstance(model, type):
        return from_mapping(dataclasses.asdict(model), name=type(model).__name__), None
    import sys

    torch = sys.modules.get("torch")
    if torch is not None and isinstance(model, torch.nn.Module):
        counted = sum(p.numel() for p in model.parameters())
        cfg = getattr(model, "cfg", None) or getattr(model, "config", None)
        if is_hf_config(cfg):
            hf_encoders.refuse_class(type(model).__name__, str(getattr(cfg, "model_type", "") or ""))
            own = hf_encoders.task_of_class(type(model).__name__)
            return from_hf_config(cfg, own if own is not None else task), counted
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
        f"model: expected a model name, a dict or dataclass of dimensions, a Hugging Face config or an nn.Module, "
        f"got {type(model).__name__}"
    )


def peft_base_model(model):
    """The model inside a PEFT wrapper (``model.get_base_model()``), else None."""
    get_base_model = getattr(type(model), "get_base_model", None)
    if not callable(get_base_model):
        return None
    base = model.get_base_model()
    return None if base is model else base


def fused_head_mark(model):
    """The :class:`llmmem.head.marker.FusedHead` mark of a model whose loss is the fused head
    (``llmmem.patch_lm_loss`` leaves it; on a PEFT wrapper, the model inside it carries it), else
    None. Imports nothing: a mark exists only once ``llmmem.head.marker`` is loaded, and a name,
    dict or config carries none."""
    marker = sys.modules.get("llmmem.head.marker")
    torch = sys.modules.get("torch")
    if marker is None or torch is None or not isinstance(model, torch.nn.Module):
        return None
    info = marker.fused_head(model)
    base = peft_base_model(model) if info is None else None
    return info if base is None else marker.fused_head(base)


# --------------------------------------------------------------------------------------------
# Hugging Face configs (read without importing transformers)

# activation names in Hugging Face configs -> how the activation is written (ACTIVATIONS)
_HF_ACTIVATIONS = {
    "gelu": "gelu",
    "gelu_pytorch_tanh": "gelu",  # torch's tanh GELU: one kernel
    "gelu_new": "gelu_new",
    "gelu_fast": "gelu_new",
    "quick_gelu": "gelu_new",
    "relu": "relu",
    "silu": "silu",
    "swish": "silu",
}
_HF_ATTENTION = {"eager": "explicit"}
# model types with an RMSNorm of the queries and keys: of each head, or of all of them together
_QK_NORMS = {
    "qwen3": "head",
    "qwen3_moe": "head",
    "gemma3": "head",
    "gemma3_text": "head",
    "olmo2": "width",
    "hunyuan_v1_moe": "head",
}  # sdpa, flash and flex attention keep no s x s tensor

# Model types whose Hugging Face model class cannot run SDPA (``_supports_sdpa`` false), so that HF
# runs eager attention when none is asked for. Read off transformers 5.24: the causal-LM classes of
# the model types whose configs from_hf_config reads. Used only when transformers cannot be imported.
_HF_TYPES_WITHOUT_SDPA = frozenset(
    (
        "big_bird", "bigbird_pegasus", "bloom", "cpmant", "deepseek_v4", "flint", "gemma2", "git",
        "gpt_neo", "gpt_neox_japanese", "gpt_oss", "granite_swa", "granitemoe_swa", "hy_v4",
        "inkling2_loop_text", "inkling2_text", "megatron-bert", "mimo_v2_flash", "mpt", "mvp",
        "openai-gpt", "prophetnet", "rembert", "roformer", "trocr", "vaultgemma", "xglm", "xlm",
    )
)  # fmt: skip


def hf_class_supports_sdpa(config) -> bool | None:
    """The ``_supports_sdpa`` flag of the installed ``transformers``' model class for ``config``
    (its ``architectures``, else its ``model_type``'s causal-LM or base class); None when
    transformers cannot be imported or has no such class. Imports transformers and the model's
    module (and so torch); builds no model and uses no network."""
    model_type = str(getattr(config, "model_type", "") or "")
    names = getattr(config, "architectures", None)
    names = list(names) if isinstance(names, (list, tuple)) else []
    try:
        import transformers
        from transformers.models.auto import modeling_auto

        auto = (modeling_auto.MODEL_FOR_CAUSAL_LM_MAPPING_NAMES, modeling_auto.MODEL_MAPPING_NAMES)
        names += [m.get(model_type) for m in auto]
    except Exception:  # not installed, or without a usable torch (its model classes are then stubs)
        return None
    for name in names:
        if not isinstance(name, str):
            continue
        try:
            flag = getattr(getattr(transformers, name, None), "_supports_sdpa", None)
        except Exception:  # a model module whose optional dependencies are missing
            continue
        if isinstance(flag, bool):
            return flag
    return None


def hf_default_attention(config) -> str:
    """The attention implementation Hugging Face gives ``config``'s model when the config names
    none: ``"sdpa"`` where the model class supports it, else ``"eager"``. Asks the installed
    transformers (:func:`hf_class_supports_sdpa`) when it is already loaded (a config object from
    it); else a table of model types, which spares a ``config.json`` read from the CLI the seconds of
    importing transformers and torch."""
    supports = hf_class_supports_sdpa(config) if sys.modules.get("transformers") is not None else None
    if supports is None:
        supports = str(getattr(config, "model_type", "") or "") not in _HF_TYPES_WITHOUT_SDPA
    return "sdpa" if supports else "eager"


def is_hf_config(obj) -> bool:
    """A Hugging Face ``PretrainedConfig`` (duck-typed: ``model_type`` and ``to_dict``)."""
    return obj is not None and hasattr(obj, "model_type") and callable(getattr(obj, "to_dict", None))


def from_hf_config(config, task: str | None = None) -> ModelConfig:
    """A :class:`ModelConfig` from a Hugging Face config, reading the architecture, not only the sizes:
    the norm (RMSNorm written from elementwise operators when ``rms_norm_eps`` is set, else
    LayerNorm), the activation and whether the MLP is gated, grouped key/value heads and
    ``head_dim``, rotary or learned positions, biases, dropout on attention and on the residual
    branches, tied embeddings, and the attention implementation (``eager`` materialises the scores;
    ``sdpa`` and flash attention do not; when the config names none, Hugging Face's default for the
    model class, :func:`hf_default_attention`). A multimodal config (a vision or audio tower beside
    its text model) is refused (:mod:`llmmem.estimation.hf_multimodal`); its ``text_config`` is read.

    The encoder-decoders T5, mT5, BART, mBART and the encoders BERT, RoBERTa, XLM-RoBERTa,
    CamemBERT, DistilBERT and ViT are read by :mod:`llmmem.estimation.hf_encoders`, with ``task``
    (None: the config's ``architectures``, else the family's default) saying which head the model
    has. Any other encoder, encoder-decoder or hybrid is refused by name.
    """
    raw = config.to_dict()
    if task is not None and not isinstance(task, str):
        raise ValueError(f"task: expected one of {', '.join(hf_encoders.TASKS)} or None, got {task!r}")
    fields = hf_encoders.encoder_fields(config, raw, task, _HF_ACTIVATIONS)
    if fields is not None:
        impl = getattr(config, "_attn_implementation", None) or hf_default_attention(config)
        model_type = str(getattr(config, "model_type", "") or raw.get("model_type") or "")
        name = str(getattr(config, "name_or_path", "") or model_type)
        return ModelConfig(**fields, attention=_HF_ATTENTION.get(impl, "sdpa"), name=name)
    # what the model is decides before the task asked of it: a Pegasus or a LLaVA is refused as
    # such, not for the seq2seq-lm head its class (or the caller) names
    _refuse_non_decoders(config, raw)  # before the text config: an encoder-decoder's is one of its stacks
    text = config.get_text_config() if callable(getattr(config, "get_text_config", None)) else config
    if text is not config:
        config, raw = text, text.to_dict()
        _refuse_non_decoders(config, raw)
    if task not in (None, "causal-lm"):
        raise ValueError(f"task: {task!r} is not a head the estimator reads on a decoder (causal-lm only)")
    if str(getattr(config, "model_type", "") or "") == "dbrx":  # its sizes nested in attn_config, ffn_config
        impl = getattr(config, "_attn_implementation", None) or hf_default_attention(config)
        raw = dict(hf_moe.flat_dbrx(raw), _attn_implementation=impl)
        config = HFConfigFile(raw, str(getattr(config, "name_or_path", "") or ""))
    sizes = {
        "layers": ("num_hidden_layers", "n_layer", "num_layers"),
        "hidden": ("hidden_size", "n_embd", "d_model"),
        "heads": ("num_attention_heads", "n_head"),
        "vocab": ("vocab_size",),
    }
    missing = [" / ".join(names) for names in sizes.values() if all(getattr(config, n, None) is None for n in names)]
    if missing:
        model_type = getattr(config, "model_type", None) or type(config).__name__
        raise ValueError(
            f"model: a Hugging Face config of model_type {model_type!r}, an architecture the estimator does not know: "
            f"it reads decoder-only transformers and found no {'; no '.join(missing)}"
        )

    def get(*names, default=None):
        for n in names:
            v = getattr(config, n, None)
            if v is not None:
                return v
        return default

    act_name = str(get("hidden_act", "activation_function", "activation", default="gelu")).lower()
    activation = _HF_ACTIVATIONS.get(act_name, "gelu")
    model_type = str(getattr(config, "model_type", "") or "")
    gated = activation == "silu" or model_type.startswith("gemma")
    rms = "rms_norm_eps" in raw or "rms_norm_epsilon" in raw
    rotary = any(k in raw for k in ("rope_theta", "rope_scaling", "rope_parameters", "rotary_dim", "rotary_pct"))
    hidden_dropout = get("resid_pdrop", "hidden_dropout", "hidden_dropout_prob", "dropout", default=0.0)
    attention_dropout = get("attn_pdrop", "attention_dropout", "attention_probs_dropout_prob", default=0.0)
    # HF picks sdpa when none is asked for, and eager for a model class that has no SDPA path (BLOOM)
    impl = getattr(config, "_attn_implementation", None) or hf_default_attention(config)
    bias = get("attention_bias", "bias")
    qkv_bias = bool(raw.get("qkv_bias", False)) or model_type in ("qwen2", "qwen2_moe")  # q/k/v only
    if model_type == "stablelm":  # LayerNorm, but biases on q/k/v only and only when use_qkv_bias
        bias, qkv_bias = False, bool(raw.get("use_qkv_bias"))
    if bias is None:
        bias = not rms  # GPT-2's family has biases; the RMSNorm family (Llama, Mixtral, Qwen) none past q/k/v
    heads = get("num_attention_heads", "n_head")
    kv_heads = get("num_key_value_heads", "num_kv_heads", "n_head_kv")
    if raw.get("multi_query") and (kv_heads is None or not raw.get("new_decoder_architecture")):
        kv_heads = 1  # Falcon's multi-query attention: one key/value head
    parallel, broadcast = _falcon_layout(raw) if model_type == "falcon" else (False, False)
    return ModelConfig(
        layers=get("num_hidden_layers", "n_layer", "num_layers"),
        hidden=get("hidden_size", "n_embd", "d_model"),
        heads=heads,
        vocab=get("vocab_size"),
        kv_heads=kv_heads,
        ffn=get("intermediate_size", "n_inner", "ffn_dim", "ffn_hidden_size"),  # the last: Falcon
        mlp="swiglu" if gated else "gelu",
        activation=activation,
        norm="rmsnorm" if rms else "layernorm",
        tied_embeddings=bool(get("tie_word_embeddings", default=True)),
        positions="rotary" if rotary else "learned",
        max_positions=max(0, int(get("max_position_embeddings", "n_positions", default=0) or 0)),
        bias=bool(bias),
        dropout=float(hidden_dropout or 0.0),
        hidden_dropout=float(hidden_dropout or 0.0),
        attention_dropout=float(attention_dropout or 0.0),
        attention=_HF_ATTENTION.get(impl, "sdpa"),
        head_dim=get("head_dim"),
        qkv_bias=qkv_bias,
        qk_norm=_QK_NORMS.get(model_type, "none"),
        sandwich_norm=model_type.startswith(("gemma2", "gemma3")),
        attention_softcap=bool(raw.get("attn_logit_softcapping")),
        logit_softcap=bool(raw.get("final_logit_softcapping")),
        norm_bias=model_type != "dbrx",
        clip_qkv=model_type == "dbrx" and raw.get("clip_qkv") is not None,
        parallel_attention=parallel,
        kv_broadcast=broadcast,
        **hf_moe.expert_fields(raw, get),
        name=str(getattr(config, "name_or_path", "") or model_type or type(config).__name__),
    )


# Model types that transformers also maps to a causal LM (as a decoder, with ``is_decoder=True``) but
# that are encoders, or no transformer decoder, as configured by default
_ENCODER_TYPES = frozenset(
    "albert bert bert-generation big_bird camembert convbert data2vec-text deberta deberta-v2 deit distilbert "
    "electra ernie ibert layoutlm megatron-bert modernbert mpnet nezha rembert roberta roberta-prelayernorm "
    "roformer squeezebert vit xlm xlm-roberta xlm-roberta-xl xmod yoso beit swin convnext dinov2 "
    "clip_vision_model siglip_vision_model".split()
)
_ATTENTION_LAYERS = ("attention", "full_attention", "sliding_attention", "chunked_attention")


# Model types transformers maps to no causal LM that a config reader could take for one (the
# command line reads config.json files without importing transformers, which imports torch)
_NON_CAUSAL_TYPES = frozenset(
    "canine clip_text_model data2vec-audio esm fnet funnel hubert layoutlmv2 layoutlmv3 lilt longformer luke "
    "markuplm mobilebert mra nomic_bert nystromformer sew sew-d siglip_text_model splinter tapas unispeech "
    "unispeech-sat visual_bert wav2vec2 wav2vec2-bert wav2vec2-conformer wavlm".split()
)


def _causal_lm_types():
    """(every model type transformers knows, those it maps to a causal LM), or None where asking
    would import transformers' model mappings (and torch) for this (the command line)."""
    if "torch" not in sys.modules or "transformers" not in sys.modules:
        return None
    try:
        from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    except Exception:  # not installed, or another layout: the lists above only
        return None
    return CONFIG_MAPPING_NAMES, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES


def _refuse_non_decoders(config, raw: dict) -> None:
    """ValueError, naming the model type and why, for a config that is not a decoder-only
    transformer (or its mixture of experts): an encoder-decoder, an encoder, a model type that
    transformers has no causal LM for, a hybrid with state-space or linear-attention layers. A
    model type transformers does not know (remote code) is read as a decoder."""
    model_type = str(getattr(config, "model_type", "") or type(config).__name__)
    kinds = raw.get("layer_types") or raw.get("layers_block_type") or []
    other = sorted({str(k) for k in kinds if str(k) not in _ATTENTION_LAYERS}) if isinstance(kinds, list) else []
    hf_multimodal.refuse_towers(model_type, raw)  # before the text config is read in its place
    known = _causal_lm_types()
    if raw.get("is_encoder_decoder"):
        kind = "an encoder-decoder model (two stacks, cross-attention)"
    elif model_type in _ENCODER_TYPES and not raw.get("is_decoder"):
        kind = "an encoder (no causal LM head)"
    elif model_type in _NON_CAUSAL_TYPES or (
        known is not None and model_type in known[0] and model_type not in known[1]
    ):
        kind = "not a causal language model (transformers maps no *ForCausalLM to it)"
    elif other or any(k.startswith("mamba_") for k in raw) or "attn_layer_period" in raw:
        kind = f"a hybrid whose layers are not all attention ({', '.join(other) or 'state-space layers'})"
    else:
        hf_moe.refuse_unread(model_type, raw)
        return
    raise ValueError(
        f"model: a Hugging Face config of model_type {model_type!r}, {kind}: the estimator reads decoder-only "
        "transformers and their mixtures of experts, the encoder-decoders T5, mT5, BART and mBART and the encoders "
        "BERT, RoBERTa, XLM-RoBERTa, CamemBERT, DistilBERT and ViT, and does not guess one from this config"
    )


def _falcon_layout(raw: dict) -> tuple[bool, bool]:
    """``(parallel_attention, kv_broadcast)`` of a Falcon config. Its layer runs attention and the
    MLP in parallel (``parallel_attn``, default true) from one norm's output, except the new decoder
    architecture with its two norms (``num_ln_in_parallel_attn`` 2, its default). Multi-query
    attention outside the new architecture hands SDPA its one key/value head unrepeated; the new
    architecture copies its grouped heads to every query head first (a fused kernel takes those)."""
    new = bool(raw.get("new_decoder_architecture"))
    one_norm = raw.get("parallel_attn", True) and (not new or raw.get("num_ln_in_parallel_attn") == 1)
    return bool(one_norm), bool(raw.get("multi_query", True)) and not new


class HFConfigFile:
    """A Hugging Face ``config.json`` read as a config object for :func:`from_hf_config`: its keys
    as attributes (a key the file lacks reads as absent, so :func:`from_hf_config`'s defaults
    apply), ``to_dict()``, and ``get_text_config()`` (the ``text_config`` of a multimodal config).
    Plain JSON: neither ``transformers`` nor any network access."""

    def __init__(self, mapping: dict, name_or_path: str = "") -> None:
        self._raw = dict(mapping)
        self.name_or_path = name_or_path

    def __getattr__(self, name: str):
        if name.startswith("__") or name == "_raw":
            raise AttributeError(name)
        raw = self.__dict__.get("_raw", {})
        if name == "_attn_implementation":  # saved, when at all, under either name
            return raw.get("_attn_implementation") or raw.get("attn_implementation")
        if name in raw:
            return raw[name]
        raise AttributeError(name)

    def to_dict(self) -> dict:
        return dict(self._raw)

    def get_text_config(self) -> HFConfigFile:
        text = self._raw.get("text_config")
        return HFConfigFile(text, self.name_or_path) if isinstance(text, dict) else self


def read_hf_config_file(path, name: str = "model", task: str | None = None) -> ModelConfig:
    """The :class:`ModelConfig` of a Hugging Face ``config.json``: ``path`` is that file or a directory
    holding one (a saved model). Read as :func:`from_hf_config` reads a config object (what the file
    does not list takes that function's defaults, not the model class's), offline. ValueError naming
    ``name`` for a missing or unreadable file and for a config the estimator does not know."""
    import json
    import os

    path = os.fspath(path)
    file = os.path.join(path, "config.json") if os.path.isdir(path) else path
    if not os.path.exists(file):
        where = f"the directory {path!r} holds no config.json" if os.path.isdir(path) else f"no such file {path!r}"
        raise ValueError(
            f"{name}: {where}; expected a model name ({', '.join(NAMED_MODELS)}), a Hugging Face config.json "
            "or a directory holding one"
        )
    try:
        with open(file, encoding="utf-8") as f:
            raw = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{name}: cannot read {file!r} as a Hugging Face config ({e})") from None
    if not isinstance(raw, dict):
        raise ValueError(f"{name}: {file!r} holds a JSON {type(raw).__name__}, not a Hugging Face config (an object)")
    try:
        return from_hf_config(HFConfigFile(raw, name_or_path=path), task=task)
    except ValueError as e:
        if str(e).startswith("task: "):
            raise
        detail = str(e).removeprefix("model: ")
        raise ValueError(f"{name}: {file!r}: {detail}") from None
