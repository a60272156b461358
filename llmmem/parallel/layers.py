"""Tensor-parallel layers with Megatron semantics: ``ColumnParallelLinear``, ``RowParallelLinear``,
``VocabParallelEmbedding``.

Each layer holds a 1/t slice of the weight of the equivalent ``nn.Linear`` / ``nn.Embedding``
(t = size of the tensor-parallel group). Initialisation builds the *full* (master) weight with the
same calls, in the same order, as the torch module would and then keeps this rank's slice, so a
model built with the same seed on every rank equals the single-device model built with that seed
(cost: the full weight is materialised once, transiently, on ``device``). ``from_linear`` /
``from_embedding`` slice an existing (pretrained) module instead; ``full_weight()`` gathers back.
"""

from __future__ import annotations

import math
from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from llmmem.amp.sharded import mark_tensor_parallel
from llmmem.parallel import collectives
from llmmem.parallel.groups import get_tensor_parallel_group
from llmmem.parallel.mappings import (
    copy_to_tensor_parallel_region,
    gather_from_sequence_parallel_region,
    gather_from_tensor_parallel_region,
    reduce_from_tensor_parallel_region,
    reduce_scatter_to_sequence_parallel_region,
    scatter_to_tensor_parallel_region,
)


def _check_size(cls: str, name: str, value, t: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ValueError(f"{cls}: {name} must be a positive int, got {value!r}")
    if value % t != 0:
        raise ValueError(f"{cls}: {name} ({value}) must be divisible by the tensor-parallel size ({t})")


def _linear_master_init(weight: torch.Tensor, bias: torch.Tensor | None, init_method) -> None:
    """Initialise the full weight/bias exactly as ``nn.Linear.reset_parameters`` (or ``init_method``)."""
    if init_method is None:
        nn.init.kaiming_uniform_(weight, a=math.sqrt(5))
        if bias is not None:
            fan_in = weight.shape[1]
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            nn.init.uniform_(bias, -bound, bound)
    else:
        init_method(weight)
        if bias is not None:
            nn.init.zeros_(bias)  # Megatron: a custom init_method means zero biases


class _ParallelLinearBase(nn.Module):
    # dimension of the full weight (out, in) that is split across ranks
    _split_dim: int

    def __init__(
        self,
        in_features,
        out_features,
        bias,
        process_group,
        sequence_parallel,
        sequence_dim,
        skip_bias_add,
        init_method,
        device,
        dtype,
        _master,
    ) -> None:
        super().__init__()
        cls = type(self).__name__
        self.process_group = get_tensor_parallel_group(process_group)
        t = dist.get_world_size(self.process_group)
        self.tp_size, self.tp_rank = t, dist.get_rank(self.process_group)
        split_name, split_value = (
            ("out_features", out_features) if self._split_dim == 0 else ("in_features", in_features)
        )
        other_name, other_value = (
            ("in_features", in_features) if self._split_dim == 0 else ("out_features", out_features)
        )
        _check_size(cls, other_name, other_value, 1)
        _check_size(cls, split_name, split_value, t)
        if init_method is not None and not callable(init_method):
            raise TypeError(f"{cls}: init_method must be callable(weight) or None, got {type(init_method).__name__}")
        self.in_features, self.out_features = in_features, out_features
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        self.skip_bias_add = bool(skip_bias_add)
        factory = {"device": device, "dtype": dtype}
        if _master is None:
            w_full = torch.empty(out_features, in_features, **factory)
            b_full = torch.empty(out_features, **factory) if bias else None
            with torch.no_grad():
                _linear_master_init(w_full, b_full, init_method)
        else:
            w_full, b_full = _master
        with torch.no_grad():
            w_local = w_full.chunk(t, dim=self._split_dim)[self.tp_rank].clone()
            if b_full is None:
                b_local = None
            elif self._split_dim == 0:
                b_local = b_full.chunk(t)[self.tp_rank].clone()
            else:
                b_local = b_full.clone()  # a row-parallel bias is added once, after the reduction
        self.weight = nn.Parameter(w_local)
        if b_local is not None:
            self.bias = nn.Parameter(b_local)
            if self._split_dim == 1 and self.sequence_parallel:
                # each rank only sees its slice of the sequence: the bias gradient is partial and must be
                # summed over the group (see llmmem.parallel.allreduce_sequence_parallel_grads)
                self.bias.sequence_parallel = True
        else:
            self.register_parameter("bias", None)
        # parameters sliced along a dimension, so checkpoint tools know how to reassemble them
        self.weight.tensor_parallel_dim = self._split_dim
        _mark_group(self)
        if self.bias is not None and self._split_dim == 0:
            self.bias.tensor_parallel_dim = 0

    def _check_width(self, x: torch.Tensor, expected: int) -> None:
        if x.dim() == 0 or x.shape[-1] != expected:
            shape = tuple(x.shape)
            raise RuntimeError(
                f"{type(self).__name__}: mat1 and mat2 shapes cannot be multiplied: input of shape "
                f"{shape} needs last dimension {expected}"
            )

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The whole ``(out_features, in_features)`` weight, gathered from every rank (collective)."""
        return collectives.all_gather(self.weight.detach(), self._split_dim, self.process_group).clone()

    @torch.no_grad()
    def full_bias(self) -> torch.Tensor | None:
        """The whole ``(out_features,)`` bias (collective for a column-parallel layer), or None."""
        if self.bias is None:
            return None
        if self._split_dim == 0:
            return collectives.all_gather(self.bias.detach(), 0, self.process_group).clone()
        return self.bias.detach().clone()

    @classmethod
    def from_linear(cls, linear: nn.Linear, **kwargs):
        """A parallel layer holding this rank's slice of ``linear`` (e.g. pretrained weights).

        ``linear`` must hold the same values on every rank. Keyword arguments are those of the
        constructor (``bias``, ``device`` and ``dtype`` come from ``linear``).
        """
        if not isinstance(linear, nn.Linear):
            raise TypeError(f"{cls.__name__}.from_linear: expected an nn.Linear, got {type(linear).__name__}")
        for k in ("bias", "device", "dtype", "init_method"):
            if k in kwargs:
                raise TypeError(f"{cls.__name__}.from_linear: {k}= is taken from the nn.Linear and cannot be passed")
        w = linear.weight.detach()
        b = linear.bias.detach() if linear.bias is not None else None
        return cls(
            linear.in_features,
            linear.out_features,
            bias=b is not None,
            device=w.device,
            dtype=w.dtype,
            _master=(w, b),
            **kwargs,
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}, "
            f"skip_bias_add={self.skip_bias_add}"
        )


def _mark_group(module: nn.Module) -> None:
    """Tag the module's parameters with its group: llmmem.GradScaler then skips a step on every rank
    of the group when one rank's shards overflowed (see llmmem.amp.sharded)."""
    for p in module.parameters(recurse=False):
        mark_tensor_parallel(p, module.process_group)


class ColumnParallelLinear(_ParallelLinearBase):
    """``y = x A^T + b`` with ``A`` split by rows (output features): weight ``(out/t, in)``.

    :param gather_output: all-gather the output so every rank gets all ``out_features`` (otherwise
        each rank returns its ``out/t`` slice, ready for a :class:`RowParallelLinear`).
    :param sequence_parallel: the input is this rank's slice of the sequence dimension
        (``sequence_dim``, default 0 = Megatron's ``[s, b, h]``); it is all-gathered before the
        matmul and the gradient reduce-scattered. Incompatible with ``gather_output``.
    :param skip_bias_add: return ``(output, bias)`` without adding the bias, so the caller can
        fuse it (the bias is this rank's slice, or the whole bias when ``gather_output``).
    :param disable_grad_reduce: do not sum the input's gradient over the group (Megatron's name):
        the caller does it once for several layers that read the same input, e.g. separate q, k
        and v projections behind one :func:`copy_to_tensor_parallel_region` (one all-reduce in
        backward instead of three). Incompatible with ``sequence_parallel``.
    :param init_method: ``callable(weight)`` applied to the full weight (then biases are zeroed);
        default: ``nn.Linear``'s initialisation.

    Memory: weight and bias are 1/t of ``nn.Linear``'s; the forward keeps the (gathered) input
    for backward, as ``nn.Linear`` does.
    """

    _split_dim = 0

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        gather_output: bool = False,
        process_group=None,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        disable_grad_reduce: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        device=None,
        dtype=None,
        _master=None,
    ) -> None:
        if sequence_parallel and gather_output:
            raise ValueError(
                "ColumnParallelLinear: gather_output=True cannot be combined with sequence_parallel=True "
                "(the output is sharded by features; gather it explicitly if you need it)"
            )
        if sequence_parallel and disable_grad_reduce:
            raise ValueError(
                "ColumnParallelLinear: disable_grad_reduce=True cannot be combined with sequence_parallel=True "
                "(the sequence all-gather's backward is the reduction)"
            )
        super().__init__(
            in_features,
            out_features,
            bias,
            process_group,
            sequence_parallel,
            sequence_dim,
            skip_bias_add,
            init_method,
            device,
            dtype,
            _master,
        )
        self.gather_output = bool(gather_output)
        self.disable_grad_reduce = bool(disable_grad_reduce)

    def forward(self, x: torch.Tensor):
        self._check_width(x, self.in_features)
        if self.sequence_parallel:
            x = gather_from_sequence_parallel_region(x, self.process_group, sequence_dim=self.sequence_dim)
        elif not self.disable_grad_reduce:
            x = copy_to_tensor_parallel_region(x, self.process_group)
        bias = None if self.skip_bias_add else self.bias
        y = F.linear(x, self.weight, bias)
        if self.gather_output:
            y = gather_from_tensor_parallel_region(y, self.process_group)
        if not self.skip_bias_add:
            return y
        out_bias = self.bias
        if out_bias is not None and self.gather_output:
            out_bias = gather_from_tensor_parallel_region(out_bias, self.process_group)
        return y, out_bias

    def extra_repr(self) -> str:
        return (
            super().extra_repr()
            + f", gather_output={self.gather_output}"
            + (", disable_grad_reduce=True" if self.disable_grad_reduce else "")
        )


class RowParallelLinear(_ParallelLinearBase):
    """``y = x A^T + b`` with ``A`` split by columns (input features): weight ``(out, in/t)``.

    The partial products are summed over the group (all-reduce, or reduce-scatter along the
    sequence dimension when ``sequence_parallel``), then the bias is added once.

    :param input_is_parallel: the input is already split along its last dimension (the output of a
        :class:`ColumnParallelLinear` with ``gather_output=False``); otherwise this rank's slice is
        taken here. Must be True with ``sequence_parallel``.
    :param skip_bias_add: return ``(output, bias)`` with the (whole, replicated) bias not added.

    With ``sequence_parallel`` the bias gradient on each rank covers only its slice of the
    sequence: sum it over the group with :func:`llmmem.parallel.allreduce_sequence_parallel_grads`
    before the optimizer step (the bias carries ``bias.sequence_parallel = True``).
    """

    _split_dim = 1

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool = True,
        *,
        input_is_parallel: bool = True,
        process_group=None,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        skip_bias_add: bool = False,
        init_method: Callable[[torch.Tensor], object] | None = None,
        device=None,
        dtype=None,
        _master=None,
    ) -> None:
        if sequence_parallel and not input_is_parallel:
            raise ValueError("RowParallelLinear: sequence_parallel=True requires input_is_parallel=True")
        super().__init__(
            in_features,
            out_features,
            bias,
            process_group,
            sequence_parallel,
            sequence_dim,
            skip_bias_add,
            init_method,
            device,
            dtype,
            _master,
        )
        self.input_is_parallel = bool(input_is_parallel)

    def forward(self, x: torch.Tensor):
        if self.input_is_parallel:
            self._check_width(x, self.in_features // self.tp_size)
        else:
            self._check_width(x, self.in_features)
            x = scatter_to_tensor_parallel_region(x, self.process_group)
        y = F.linear(x, self.weight)
        if self.sequence_parallel:
            y = reduce_scatter_to_sequence_parallel_region(y, self.process_group, sequence_dim=self.sequence_dim)
        else:
            y = reduce_from_tensor_parallel_region(y, self.process_group)
        if self.skip_bias_add:
            return y, self.bias
        return y + self.bias if self.bias is not None else y

    def extra_repr(self) -> str:
        return super().extra_repr() + f", input_is_parallel={self.input_is_parallel}"


class VocabParallelEmbedding(nn.Module):
    """``nn.Embedding`` with the vocabulary split across ranks: weight ``(num_embeddings/t, dim)``.

    Rank ``r`` owns token ids ``[r*V/t, (r+1)*V/t)``; each rank looks up the ids it owns (zeros for
    the others) and the results are summed over the group (reduce-scattered along ``sequence_dim``
    when ``sequence_parallel``). Initialisation is ``nn.Embedding``'s (``normal_(0, 1)``, padding
    row zeroed) on the full table, then sliced; ``init_method`` replaces the normal draw.

    Ids outside ``[0, num_embeddings)`` raise ``IndexError`` as ``nn.Embedding`` does (checked
    on the host for CPU inputs, with an asynchronous device assert for CUDA inputs).
    """

    def __init__(
        self,
        num_embeddings: int,
        embedding_dim: int,
        padding_idx: int | None = None,
        *,
        process_group=None,
        sequence_parallel: bool = False,
        sequence_dim: int = 0,
        init_method: Callable[[torch.Tensor], object] | None = None,
        device=None,
        dtype=None,
        _master=None,
    ) -> None:
        super().__init__()
        self.process_group = get_tensor_parallel_group(process_group)
        t = dist.get_world_size(self.process_group)
        self.tp_size, self.tp_rank = t, dist.get_rank(self.process_group)
        _check_size("VocabParallelEmbedding", "embedding_dim", embedding_dim, 1)
        _check_size("VocabParallelEmbedding", "num_embeddings", num_embeddings, t)
        if padding_idx is not None:
            if not isinstance(padding_idx, int) or not -num_embeddings <= padding_idx < num_embeddings:
                raise ValueError(
                    f"VocabParallelEmbedding: padding_idx must be within num_embeddings "
                    f"({num_embeddings}), got {padding_idx!r}"
                )
            padding_idx %= num_embeddings
        self.num_embeddings, self.embedding_dim, self.padding_idx = num_embeddings, embedding_dim, padding_idx
        self.sequence_parallel, self.sequence_dim = bool(sequence_parallel), sequence_dim
        per = num_embeddings // t
        self.vocab_start, self.vocab_end = self.tp_rank * per, (self.tp_rank + 1) * per
        if _master is None:
            full = torch.empty(num_embeddings, embedding_dim, device=device, dtype=dtype)
            with torch.no_grad():
                (init_method or nn.init.normal_)(full)
                if padding_idx is not None:
                    full[padding_idx].fill_(0)
        else:
            full = _master
        self.weight = nn.Parameter(full.detach()[self.vocab_start : self.vocab_end].clone())
        self.weight.tensor_parallel_dim = 0
        _mark_group(self)
        # padding row as an index into this rank's slice, when this rank owns it
        self._local_padding_idx = (
            padding_idx - self.vocab_start
            if padding_idx is not None and self.vocab_start <= padding_idx < self.vocab_end
            else None
        )

    @classmethod
    def from_embedding(cls, embedding: nn.Embedding, **kwargs) -> VocabParallelEmbedding:
        """This rank's slice of an existing ``nn.Embedding`` (same values on every rank)."""
        if not isinstance(embedding, nn.Embedding):
            raise TypeError(
                f"VocabParallelEmbedding.from_embedding: expected an nn.Embedding, got {type(embedding).__name__}"
            )
        return cls(
            embedding.num_embeddings,
            embedding.embedding_dim,
            embedding.padding_idx,
            _master=embedding.weight.detach(),
            **kwargs,
        )

    @torch.no_grad()
    def full_weight(self) -> torch.Tensor:
        """The whole ``(num_embeddings, embedding_dim)`` table, gathered from every rank (collective)."""
        return collectives.all_gather(self.weight.detach(), 0, self.process_group).clone()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if ids.dtype not in (torch.int64, torch.int32):
            raise TypeError(f"VocabParallelEmbedding: ids must be int64 or int32, got {ids.dtype}")
        # the range check reads the ids on the host: not while Dynamo traces (a data-dependent guard)
        if ids.device.type == "cpu" and not torch.compiler.is_compiling():
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= self.num_embeddings):
                raise IndexError(
                    f"VocabParallelEmbedding: index out of range: ids must be in "
                    f"[0, {self.num_embeddings}), got [{int(ids.min())}, {int(ids.max())}]"
                )
        else:
            torch._assert_async(
                ((ids >= 0) & (ids < self.num_embeddings)).all(), "VocabParallelEmbedding: index out of range"
            )
        if self.tp_size == 1:
            out = F.embedding(ids, self.weight, self._local_padding_idx)
        else:
            foreign = (ids < self.vocab_start) | (ids >= self.vocab_end)
            local = (ids - self.vocab_start).masked_fill(foreign, 0)
            out = F.embedding(local, self.weight, self._local_padding_idx)
            out = out.masked_fill(foreign.unsqueeze(-1), 0.0)
        if self.sequence_parallel:
            return reduce_scatter_to_sequence_parallel_region(out, self.process_group, sequence_dim=self.sequence_dim)
        return reduce_from_tensor_parallel_region(out, self.process_group)

    def extra_repr(self) -> str:
        return (
            f"{self.num_embeddings}, {self.embedding_dim}, padding_idx={self.padding_idx}, "
            f"tp_size={self.tp_size}, sequence_parallel={self.sequence_parallel}"
        )


def allreduce_sequence_parallel_grads(module: nn.Module, process_group=None) -> int:
    """Sum over the tensor-parallel group the gradients of parameters marked ``sequence_parallel``.

    Parameters replicated across ranks but applied to a sequence slice (a row-parallel bias,
    LayerNorms inside a sequence-parallel region: mark them with ``p.sequence_parallel = True``)
    get only a partial gradient on each rank. Call this after ``backward()`` and before the
    optimizer step. Returns the number of gradients reduced. Collective: every rank must call it.
    """
    group = get_tensor_parallel_group(process_group)
    grads = [p.grad for p in module.parameters() if getattr(p, "sequence_parallel", False) and p.grad is not None]
    if not grads or dist.get_world_size(group) == 1:
        return len(grads)
    flat = torch.cat([g.reshape(-1) for g in grads])
    collectives.all_reduce_(flat, group)
    offset = 0
    for g in grads:
        g.copy_(flat[offset : offset + g.numel()].view_as(g))
        offset += g.numel()
    return len(grads)
