"""Tensor parallelism for Hugging Face causal LMs, in place: :func:`parallelize`.

``parallelize(model, group)`` swaps the large projections of a Llama-family or GPT-2 model for
llmmem's Megatron-style layers (:mod:`llmmem.parallel.layers`) holding this rank's slice, and leaves
everything else (the model's own forward, norms, rotary embeddings, masks, ``state_dict`` key
names) as it was. Which submodule is split how is data: one :class:`_Plan` table per family, read by
one applier, as torchtitan lays out its TP plans (adding a family is adding a table).

What it does not do, and why:

* The config is left whole (global head counts, vocabulary), so ``model.config`` keeps describing
  the full model. The attention modules of the supported families read no head count from the
  config at run time (they reshape with ``-1`` and ``head_dim``; ``num_key_value_groups`` is a ratio
  that splitting both counts by ``t`` keeps), so each attention's per-instance counts are set to
  this rank's and the shared config is not touched (tested: an attention handed a config with wrong
  counts computes the same loss).
* Sequence parallelism is applied inside the decoder stack only: the first layer takes this rank's
  slice of the sequence and the final norm all-gathers it back, because the model's own code builds
  positions and the attention mask from the length of the embedding output, which must stay whole.
  The attention and the MLP get the whole sequence too (all-gathered at their entry), because HF
  attention reshapes its projections by its input's length.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn

from llmmem.parallel import collectives
from llmmem.parallel.cross_entropy import vocab_parallel_cross_entropy
from llmmem.parallel.gpt import _qkv_master_by_rank
from llmmem.parallel.groups import get_tensor_parallel_group
from llmmem.parallel.layers import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
from llmmem.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    scatter_to_sequence_parallel_region,
)

__all__ = ["parallelize", "supported_classes"]


@dataclass(frozen=True)
class _Plan:
    """Where a family keeps its parts (dotted paths) and how each projection is split."""

    layers: str  # the decoder layers (an nn.ModuleList)
    embedding: str  # token embedding (vocabulary-parallel)
    head: str  # LM head (vocabulary-parallel, tied to the embedding when the model ties them)
    attention: str  # the attention module inside a layer: its head counts become this rank's
    mlp: str  # the MLP module inside a layer
    final_norm: str  # the norm after the decoder layers
    colwise: tuple[str, ...]  # inside a layer: output features split, output stays split
    rowwise: tuple[str, ...]  # inside a layer: input features split, output summed over ranks
    fused_qkv: str | None = None  # one [q | k | v] projection: split by heads within each of q, k, v
    # attention attributes -> what they become on this rank ("heads", "kv_heads" or "width": heads * head_dim)
    local_counts: dict = field(default_factory=dict)


_LLAMA = _Plan(
    layers="model.layers",
    embedding="model.embed_tokens",
    head="lm_head",
    attention="self_attn",
    mlp="mlp",
    final_norm="model.norm",
    colwise=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj"),
    rowwise=("self_attn.o_proj", "mlp.down_proj"),
    local_counts={"num_heads": "heads", "num_key_value_heads": "kv_heads"},  # where a version has them
)

_GPT2 = _Plan(
    layers="transformer.h",
    embedding="transformer.wte",
    head="lm_head",
    attention="attn",
    mlp="mlp",
    final_norm="transformer.ln_f",
    colwise=("mlp.c_fc",),
    rowwise=("attn.c_proj", "mlp.c_proj"),
    fused_qkv="attn.c_attn",
    # GPT2Attention splits c_attn's output with split_size: q, k and v of this rank's heads
    local_counts={"num_heads": "heads", "split_size": "width"},
)

# by class name, so that importing llmmem never imports transformers; subclasses are matched too
_PLANS = {
    "LlamaForCausalLM": _LLAMA,
    "MistralForCausalLM": _LLAMA,
    "Qwen2ForCausalLM": _LLAMA,
    "Qwen3ForCausalLM": _LLAMA,
    "GemmaForCausalLM": _LLAMA,
    "Gemma2ForCausalLM": _LLAMA,
    "GPT2LMHeadModel": _GPT2,
}


def supported_classes() -> tuple[str, ...]:
    """The Hugging Face model classes :func:`parallelize` has a plan for."""
    return tuple(_PLANS)


def _plan_for(model) -> _Plan:
    for cls in type(model).__mro__:
        plan = _PLANS.get(cls.__name__)
        if plan is not None and cls.__module__.startswith("transformers."):
            return plan
    raise TypeError(f"parallelize: no tensor-parallel plan for {type(model).__name__}; supported: {', '.join(_PLANS)}")


def _is_conv1d(module: nn.Module) -> bool:
    # transformers.pytorch_utils.Conv1D: y = x @ W + b with W stored (in, out)
    return type(module).__name__ == "Conv1D" and type(module).__module__.startswith("transformers.")


def _master(module: nn.Module, path: str) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The full weight as nn.Linear lays it out, (out, in), and the bias."""
    b = module.bias.detach() if getattr(module, "bias", None) is not None else None
    if isinstance(module, nn.Linear):
        return module.weight.detach(), b
    if _is_conv1d(module):
        return module.weight.detach().t().contiguous(), b
    raise TypeError(f"parallelize: {path} is a {type(module).__name__}, expected nn.Linear or transformers' Conv1D")


def _out_in(module: nn.Module, path: str) -> tuple[int, int]:
    if isinstance(module, nn.Linear):
        return module.out_features, module.in_features
    if _is_conv1d(module):
        return module.weight.shape[1], module.weight.shape[0]
    raise TypeError(f"parallelize: {path} is a {type(module).__name__}, expected nn.Linear or transformers' Conv1D")


def _parallel_linear(cls, w: torch.Tensor, b: torch.Tensor | None, group, **kwargs):
    return cls(
        w.shape[1],
        w.shape[0],
        bias=b is not None,
        process_group=group,
        device=w.device,
        dtype=w.dtype,
        _master=(w, b),
        **kwargs,
    )


def _set(root: nn.Module, path: str, module: nn.Module) -> None:
    parent, _, name = path.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, name, module)


@dataclass(frozen=True)
class _Sizes:
    heads: int
    kv_heads: int
    head_dim: int


def _sizes(model, plan: _Plan, layer: nn.Module) -> _Sizes:
    cfg = model.config
    heads = cfg.num_attention_heads  # GPT2Config maps n_head to it
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    attn = layer.get_submodule(plan.attention)
    head_dim = getattr(attn, "head_dim", None) or cfg.hidden_size // heads
    return _Sizes(heads, kv_heads, head_dim)


def _check(model, plan: _Plan, layers, sizes: _Sizes, t: int, vocab_parallel: bool) -> None:
    """Everything that can refuse, before the model is touched (a refusal leaves it whole)."""
    name = type(model).__name__

    def need(what: str, value: int) -> None:
        if value % t != 0:
            raise ValueError(
                f"parallelize({name}): {what} ({value}) is not divisible by the tensor-parallel size ({t})"
            )

    need("num_attention_heads", sizes.heads)
    need("num_key_value_heads", sizes.kv_heads)
    for i, layer in enumerate(layers):
        for path in plan.colwise + plan.rowwise:
            out_features, in_features = _out_in(layer.get_submodule(path), f"{plan.layers}.{i}.{path}")
            split = out_features if path in plan.colwise else in_features
            what = "intermediate size" if path.startswith(plan.mlp + ".") else "width"
            need(f"{what} of {plan.layers}.{i}.{path}", split)
        if plan.fused_qkv is not None:
            _out_in(layer.get_submodule(plan.fused_qkv), f"{plan.layers}.{i}.{plan.fused_qkv}")
    if vocab_parallel:
        embedding, head = model.get_submodule(plan.embedding), model.get_submodule(plan.head)
        _embedding_class(embedding, plan.embedding)
        if not isinstance(head, nn.Linear):
            raise TypeError(f"parallelize: {plan.head} is a {type(head).__name__}, expected nn.Linear")
        need(f"vocabulary size of {plan.embedding}", embedding.num_embeddings)
        need(f"vocabulary size of {plan.head}", head.out_features)


def _split_layer(layer: nn.Module, plan: _Plan, sizes: _Sizes, group, t: int, sp: bool) -> None:
    # The column-parallel layers leave the input's gradient alone: the entry hook of the attention
    # and of the MLP sums it once (Megatron fuses q/k/v and gate/up into one layer for the same end;
    # separately each would all-reduce it: five all-reduces a layer instead of two).
    for path in plan.colwise:
        w, b = _master(layer.get_submodule(path), path)
        _set(layer, path, _parallel_linear(ColumnParallelLinear, w, b, group, disable_grad_reduce=True))
    if plan.fused_qkv is not None:
        w, b = _master(layer.get_submodule(plan.fused_qkv), plan.fused_qkv)
        # a contiguous 1/t of [q | k | v] would hand rank 0 all of q; each rank needs its heads of each
        w = _qkv_master_by_rank(w, sizes.heads, t)
        b = _qkv_master_by_rank(b, sizes.heads, t) if b is not None else None
        _set(layer, plan.fused_qkv, _parallel_linear(ColumnParallelLinear, w, b, group, disable_grad_reduce=True))
    sp_kwargs = {"sequence_parallel": True, "sequence_dim": 1} if sp else {}
    for path in plan.rowwise:
        w, b = _master(layer.get_submodule(path), path)
        _set(layer, path, _parallel_linear(RowParallelLinear, w, b, group, input_is_parallel=True, **sp_kwargs))
    attn = layer.get_submodule(plan.attention)
    local = {"heads": sizes.heads // t, "kv_heads": sizes.kv_heads // t, "width": sizes.heads // t * sizes.head_dim}
    for attr, which in plan.local_counts.items():
        if hasattr(attn, attr):
            setattr(attn, attr, local[which])
    for name in (plan.attention, plan.mlp):
        # with sequence parallelism the module gets the whole sequence (HF attention reshapes by its
        # input's length); the all-gather's backward reduce-scatters the summed gradient
        layer.get_submodule(name).register_forward_pre_hook(_enter_region(group, sp), with_kwargs=True)

    split = {
        id(p)
        for m in layer.modules()
        if isinstance(m, (ColumnParallelLinear, RowParallelLinear))
        for p in m.parameters()
    }
    inside = {id(p) for name in (plan.attention, plan.mlp) for p in layer.get_submodule(name).parameters()}
    for p in layer.parameters():
        if id(p) in inside and id(p) not in split:
            # a whole weight applied to this rank's heads only (Qwen3's q/k norms): its gradient
            # covers those heads, so it is summed over the group as it is computed
            p.register_hook(_sum_over(group))
        elif sp and id(p) not in inside:
            # norms and residuals of the layer run on this rank's slice of the sequence: their
            # weights get a partial gradient (allreduce_sequence_parallel_grads sums it)
            p.sequence_parallel = True


def _on_hidden(args, kwargs, fn):
    """(args, kwargs) with ``fn`` applied to the hidden states, the first positional argument or
    ``hidden_states=`` (how transformers' layers call their attention, MLP and decoder layers)."""
    if args:
        return (fn(args[0]), *args[1:]), kwargs
    if "hidden_states" not in kwargs:
        raise TypeError("parallelize: a split module was called without its hidden states")
    return args, {**kwargs, "hidden_states": fn(kwargs["hidden_states"])}


def _enter_region(group, sp: bool):
    if sp:

        def enter(x):
            return gather_from_sequence_parallel_region(x, group, sequence_dim=1)
    else:

        def enter(x):
            return copy_to_tensor_parallel_region(x, group)

    def hook(module, args, kwargs):
        return _on_hidden(args, kwargs, enter)

    return hook


def _sum_over(group):
    def hook(grad: torch.Tensor) -> torch.Tensor:
        return collectives.all_reduce(grad, group)

    return hook


class _ScaledVocabParallelEmbedding(VocabParallelEmbedding):
    """A vocabulary-parallel copy of an embedding that multiplies its lookup by ``embed_scale``
    (Gemma's ``*TextScaledWordEmbedding``): the scale commutes with the sum over ranks."""

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> _ScaledVocabParallelEmbedding:
        new = super().from_embedding(embedding, **kwargs)
        new.register_buffer("embed_scale", embedding.embed_scale.detach().clone(), persistent=False)
        return new

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return super().forward(ids) * self.embed_scale.to(self.weight.dtype)


def _embedding_class(embedding: nn.Module, path: str):
    """The vocabulary-parallel class that computes what ``embedding`` computes."""
    if type(embedding) is nn.Embedding:
        return VocabParallelEmbedding
    if isinstance(embedding, nn.Embedding) and isinstance(getattr(embedding, "embed_scale", None), torch.Tensor):
        return _ScaledVocabParallelEmbedding
    raise TypeError(
        f"parallelize: {path} is a {type(embedding).__name__}; a vocabulary-parallel copy is made of "
        f"nn.Embedding or a scaled embedding (embed_scale); pass vocab_parallel=False to keep it whole"
    )


def _causal_lm_loss(
    logits,
    labels,
    vocab_size=None,
    num_items_in_batch=None,
    ignore_index=-100,
    shift_labels=None,
    *,
    group,
    **kwargs,
):
    """transformers' ``ForCausalLMLoss`` (labels shifted by one, mean over the tokens not ignored,
    or sum / ``num_items_in_batch``) on this rank's vocabulary slice of the logits."""
    if shift_labels is None:
        labels = nn.functional.pad(labels, (0, 1), value=ignore_index)
        shift_labels = labels[..., 1:]
    shift_labels = shift_labels.to(logits.device)
    if num_items_in_batch is None:
        return vocab_parallel_cross_entropy(logits, shift_labels, process_group=group, ignore_index=ignore_index)
    loss = vocab_parallel_cross_entropy(
        logits, shift_labels, process_group=group, ignore_index=ignore_index, reduction="sum"
    )
    if torch.is_tensor(num_items_in_batch):
        num_items_in_batch = num_items_in_batch.to(loss.device)
    return loss / num_items_in_batch


def _labels_index(model) -> int | None:
    """Position of ``labels`` among forward's positional arguments (None: keyword only)."""
    params = list(inspect.signature(model.forward).parameters.values())
    for i, p in enumerate(params):
        if p.name == "labels":
            return i if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) else None
    return None


def _gather_logits_unless_labels(head: ColumnParallelLinear, labels_at: int | None):
    # With labels the loss is computed on the logits' vocabulary slices; without, the caller
    # reads the logits (generate(), an evaluation, its own loss) and needs all of them.
    def hook(module, args, kwargs):
        labels = kwargs.get("labels")
        if labels is None and labels_at is not None and len(args) > labels_at:
            labels = args[labels_at]
        head.gather_output = labels is None

    return hook


class _SequenceSplit:
    """Hooks at the edges of the decoder stack for sequence parallelism: the first layer takes
    this rank's slice of the sequence, the final norm gets the whole sequence back.

    Not on the stack's last layer: a tool that replays single layers with the inputs it recorded
    (``auto_checkpoint``'s profiling) calls them through their hooks, and a replayed layer must see
    what it saw. For the same reason the first layer slices only an input as long as the model's.
    """

    def __init__(self, group) -> None:
        self.group, self.length = group, None

    def note_length(self, module, args, kwargs) -> None:  # forward pre-hook of the whole model
        if torch.compiler.is_compiling():
            # a compiled model's first layer always gets the model's input (no replay inside a graph),
            # and Dynamo would guard on the stored int: one recompilation per sequence length
            return
        x = kwargs.get("input_ids")
        if x is None:
            x = kwargs.get("inputs_embeds")
        if x is None and args:
            x = args[0]
        self.length = x.shape[1] if isinstance(x, torch.Tensor) and x.dim() >= 2 else None

    def scatter(self, module, args, kwargs):  # forward pre-hook of the first layer
        def take_slice(x):
            if not torch.compiler.is_compiling() and self.length is not None and x.shape[1] != self.length:
                return x  # a slice already: the layer replayed on what it got
            t = dist.get_world_size(self.group)
            if x.shape[1] % t:
                raise ValueError(
                    f"parallelize(sequence_parallel=True): the sequence length ({x.shape[1]}) must be divisible "
                    f"by the tensor-parallel size ({t}); generation feeds lengths that are not (the prompt, then "
                    "one token a step): generate with a model parallelized without sequence_parallel"
                )
            return scatter_to_sequence_parallel_region(x, self.group, sequence_dim=1)

        return _on_hidden(args, kwargs, take_slice)

    def gather(self, module, args):  # forward pre-hook of the final norm
        # what follows the stack (final norm, head) is replicated: each rank's gradient of the
        # gathered tensor is whole, so backward keeps this rank's slice instead of reduce-scattering
        x = gather_from_sequence_parallel_region(
            args[0], self.group, sequence_dim=1, tensor_parallel_output_grad=False
        )
        return (x, *args[1:])


def parallelize(model: nn.Module, group=None, *, sequence_parallel: bool = False, vocab_parallel: bool = True):
    """Split a Hugging Face causal LM across the tensor-parallel group, in place; returns ``model``.

    Supported: ``LlamaForCausalLM``, ``MistralForCausalLM``, ``Qwen2ForCausalLM``,
    ``Qwen3ForCausalLM``, ``GemmaForCausalLM``, ``Gemma2ForCausalLM`` and ``GPT2LMHeadModel`` (and
    their subclasses). Every rank of ``group`` must call it on a model holding the same values
    (same seed or same checkpoint), then train it on the same batch.

    Per decoder layer, Megatron's split: q, k, v and the MLP's gate/up (GPT-2: ``c_fc``) are
    column-parallel, each rank computing its own attention heads (GPT-2's fused ``c_attn`` is
    regrouped so that each rank gets its heads of q, of k and of v); the output and down
    projections (GPT-2: both ``c_proj``) are row-parallel, summed over the group. Norms, rotary and
    position embeddings stay whole. Attention modules' head-count attributes become this rank's;
    ``model.config`` keeps the full model's counts. Parameters are this rank's slices in
    ``nn.Linear``'s layout ``(out, in)`` (GPT-2's ``Conv1D`` weights are transposed), with
    ``tensor_parallel_dim`` saying which dimension is split; ``state_dict`` key names are unchanged.

    :param group: the tensor-parallel process group (default: :func:`llmmem.parallel.init`'s, else
        the world group). torch.distributed must be initialised.
    :param vocab_parallel: split the token embedding and the LM head along the vocabulary (a tied
        head stays tied to the embedding's slice). Then, **with** ``labels=``, the loss is the
        vocabulary-parallel cross-entropy (transformers' causal-LM loss: shifted labels, ``-100``
        ignored, ``num_items_in_batch`` honoured) and ``output.logits`` is this rank's slice
        ``(batch, seq, vocab / t)`` (ids ``[r*V/t, (r+1)*V/t)``): the full logits are never built.
        **Without** ``labels`` the logits are all-gathered to the whole vocabulary, so
        ``generate()``, evaluation code and a loss of the caller's own see what the unsplit model
        gives. ``False`` keeps embedding, head and loss whole on every rank.
    :param sequence_parallel: also split the decoder layers' norms, residuals and dropouts along
        the sequence (the sequence length must be divisible by ``t``): the first layer takes this
        rank's slice of the sequence, the attention and the MLP all-gather it at their entry, the
        row-parallel layers reduce-scatter, the final norm gets it whole again. Call
        :func:`llmmem.parallel.allreduce_sequence_parallel_grads` after backward (the norms' weights
        get partial gradients). ``output_hidden_states`` then holds the layers' sequence slices.
    :raises TypeError: the model's class has no plan (the message names it).
    :raises ValueError: heads, key/value heads, a projection's split width or (with
        ``vocab_parallel``) the vocabulary is not divisible by the group's size; or the model was
        parallelized already.
    :raises RuntimeError: torch.distributed is not initialised.

    Dropout: attention-probability dropout on each rank's heads, and (with sequence parallelism)
    the residual dropouts on each rank's positions, draw from the default generator, which must be
    seeded alike on every rank: masks of different ranks' heads (positions) are then the same draws,
    unlike the single-device model's. Compose in torchtitan's order: ``parallelize`` first, then
    ``llmmem.auto_checkpoint`` (with ``repeats=0``: plans from counted work, the same on every rank;
    a rank recomputing what another does not would desynchronise the collectives), then compile.
    Memory: each slice is copied out of the full weight, which is freed when its module is swapped
    out (unless referenced elsewhere): at most the model plus one projection's full copy (GPT-2:
    transposed, regrouped) and slice at a time.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"parallelize: model must be a Hugging Face model (nn.Module), got {type(model).__name__}")
    plan = _plan_for(model)
    group = get_tensor_parallel_group(group)
    if getattr(model, "_llmmem_tensor_parallel", None) is not None:
        raise ValueError(f"parallelize: this {type(model).__name__} is tensor-parallel already")
    t = dist.get_world_size(group)
    layers = model.get_submodule(plan.layers)
    if len(layers) == 0:
        raise ValueError(f"parallelize: {type(model).__name__} has no decoder layers ({plan.layers} is empty)")
    sizes = _sizes(model, plan, layers[0])
    _check(model, plan, layers, sizes, t, vocab_parallel)

    for layer in layers:
        _split_layer(layer, plan, sizes, group, t, sequence_parallel)
    if sequence_parallel:
        edges = _SequenceSplit(group)
        model.register_forward_pre_hook(edges.note_length, with_kwargs=True)
        layers[0].register_forward_pre_hook(edges.scatter, with_kwargs=True)
        model.get_submodule(plan.final_norm).register_forward_pre_hook(edges.gather)
    if vocab_parallel:
        embedding, head = model.get_submodule(plan.embedding), model.get_submodule(plan.head)
        tied = head.weight is embedding.weight
        new_embedding = _embedding_class(embedding, plan.embedding).from_embedding(embedding, process_group=group)
        w, b = _master(head, plan.head)
        new_head = _parallel_linear(ColumnParallelLinear, w, b, group)
        if tied:
            new_head.weight = new_embedding.weight  # both keep rows [r*V/t, (r+1)*V/t) of one table
        _set(model, plan.embedding, new_embedding)
        _set(model, plan.head, new_head)
        model.loss_function = _vocab_parallel_loss(group)
        model.register_forward_pre_hook(_gather_logits_unless_labels(new_head, _labels_index(model)), with_kwargs=True)
    model._llmmem_tensor_parallel = {  # what was done, and a mark against doing it twice
        "size": t,
        "sequence_parallel": bool(sequence_parallel),
        "vocab_parallel": bool(vocab_parallel),
    }
    return model


def _vocab_parallel_loss(group):
    def loss_function(*args, **kwargs):
        return _causal_lm_loss(*args, group=group, **kwargs)

    return loss_function
