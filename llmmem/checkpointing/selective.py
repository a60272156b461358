"""Selective recompute (Megatron-LM style) as a ``context_fn`` for :func:`llmmem.checkpoint`.

``llmmem.checkpoint(block, x, context_fn=selective_context_fn)`` keeps the outputs of the
expensive operators (matrix multiplies: the Linear layers; fused attention kernels) and recomputes
everything else in backward: normalisations, activations, softmax, dropout, and the explicit
attention products ``QK^T`` / ``PV`` whose ``(b, heads, s, s)`` tensors are the large term of a
transformer layer's activations (Korthikanti et al. 2022: keep ``34·sbh``, drop ``5·as²b``).

How: during the forward a dispatch mode stores a detached reference to each kept operator's output;
during the recompute a second mode hands those outputs back, in order, instead of running the
operator again. Memory cost: the kept outputs (plus the block input, kept by the checkpoint) until
backward has used them. Time cost: recomputing the cheap operators.

Not nestable: the kept outputs are held by this mode, outside the saved-tensor mechanism, so a
selective block inside a checkpointed region would still hold them during the forward. The planner
only uses this mode at the top level.

Outside the saved-tensor mechanism also means that ``saved_tensors_hooks`` the caller has active
(``save_on_cpu``, an offloader) do not see the kept outputs, as with torch's selective contexts;
``llmmem.checkpoint(..., respect_saved_tensors_hooks=True)`` hands each one to those hooks as it is
kept (:class:`ThroughHooks`) and takes it back through them when the recompute needs it.
"""

from __future__ import annotations

import weakref
from collections import deque

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from llmmem.checkpointing.errors import CheckpointError
from llmmem.checkpointing.observers import notify_kept

__all__ = ["selective_context_fn", "compiled_selective_context_fn", "KEPT_OPERATORS", "ThroughHooks"]

_aten = torch.ops.aten


def _overloads(*names):
    found = []
    for name in names:
        packet = getattr(_aten, name, None)
        if packet is not None:
            found.append(packet)
    return frozenset(found)


# Operators whose outputs are kept: they are the costly ones to recompute (matmul FLOPs).
KEPT_OPERATORS = _overloads(
    "mm",
    "addmm",
    "_scaled_mm",
    "_int_mm",
    "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention",
    "_scaled_dot_product_cudnn_attention",
    "_scaled_dot_product_flash_attention_for_cpu",
    "_flash_attention_forward",
    "_efficient_attention_forward",
)


class ThroughHooks:
    """A kept tensor handed to a pair of saved-tensor hooks: packed now, unpacked on demand.

    What ``respect_saved_tensors_hooks=True`` stores instead of the tensor itself. ``version`` is
    the tensor's version when the policy kept it (its version counter is shared with the output it
    aliases); :meth:`mutated` says whether it was changed in place since, as far as that can still
    be seen: once a pack hook has copied the data and the tensor is gone, the copy holds the value
    the forward used, which is what the recompute needs.
    """

    __slots__ = ("_packed", "_unpack", "_ref", "_version", "_mutated")

    def __init__(self, t: torch.Tensor, pack, unpack, version: int | None = None) -> None:
        self._version = t._version if version is None else version
        self._mutated = t._version != self._version  # changed before it reached the hooks
        self._ref = weakref.ref(t)
        with torch.no_grad():  # as autograd calls a pack hook
            self._packed = pack(t)
        self._unpack = unpack

    def mutated(self) -> bool:
        t = self._ref()
        return self._mutated or (t is not None and t._version != self._version)

    def unpack(self) -> torch.Tensor:
        return self._unpack(self._packed)


def _alias(t: torch.Tensor) -> torch.Tensor:
    """A detached alias of ``t`` that shares its version counter. Below autograd (inside a dispatch
    mode) a plain ``detach()`` gets a counter of its own, so an in-place change of the output after
    it was kept would go unseen and the recompute would replay the changed values: wrong gradients."""
    with torch._C._SetExcludeDispatchKeyGuard(torch._C.DispatchKey.ADInplaceOrView, False):
        return t.detach()


class _Keep(TorchDispatchMode):
    def __init__(self, store: deque) -> None:
        super().__init__()
        self.store = store
        self.hooks = None  # (pack, unpack) of the caller, set by llmmem.checkpoint to route kept outputs

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.overloadpacket in KEPT_OPERATORS:
            kept = torch.utils._pytree.tree_map_only(torch.Tensor, _alias, out)
            torch.utils._pytree.tree_map_only(torch.Tensor, notify_kept, kept)
            if self.hooks is None:
                versions = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t._version, out)
            else:
                kept = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: ThroughHooks(t, *self.hooks), kept)
                versions = None  # each ThroughHooks checks its own
            self.store.append((func, kept, versions))
        return out


class _Replay(TorchDispatchMode):
    def __init__(self, store: deque) -> None:
        super().__init__()
        self.store = store

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in KEPT_OPERATORS and self.store and self.store[0][0] == func:
            _, kept, versions = self.store.popleft()
            if versions is None:
                routed = torch.utils._pytree.tree_leaves(kept)
                changed = any(isinstance(r, ThroughHooks) and r.mutated() for r in routed)
                kept = torch.utils._pytree.tree_map_only(ThroughHooks, ThroughHooks.unpack, kept)
            else:
                now = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t._version, kept)
                changed = now != versions
            if changed:
                raise CheckpointError(
                    f"llmmem selective recompute: the output of {func} was modified in place after "
                    "the forward kept it; run this block in store-all mode instead"
                )
            return kept
        return func(*args, **(kwargs or {}))


def selective_context_fn():
    """``context_fn`` for :func:`llmmem.checkpoint`: keep matmul/attention outputs, recompute the rest."""
    store: deque = deque()
    return _Keep(store), _Replay(store)


def _compiled_policy(ctx, func, *args, **kwargs):
    from torch.utils.checkpoint import CheckpointPolicy

    kept = getattr(func, "overloadpacket", func) in KEPT_OPERATORS
    return CheckpointPolicy.MUST_SAVE if kept else CheckpointPolicy.PREFER_RECOMPUTE


def compiled_selective_context_fn():
    """The same policy as :func:`selective_context_fn` in the form ``torch.compile`` carries into its
    graph (torch's selective-checkpoint contexts, tagging each operator to save or recompute): while
    Dynamo traces a region, llmmem's own dispatch modes would run on fake tensors and the partitioner
    would keep every activation (measured on a GPT block: 11.5 MiB kept, as without checkpointing,
    against 4.0 with this policy)."""
    from torch.utils.checkpoint import create_selective_checkpoint_contexts

    return create_selective_checkpoint_contexts(_compiled_policy)
