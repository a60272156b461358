"""The ``"recompute-cheap"`` mode: keep a block's tape, except the saved tensors that a cheap
elementwise operator rebuilds from tensors autograd keeps anyway; rebuild those in backward.

Why: a transformer block keeps large tensors that are one elementwise operator away from tensors
it keeps for other reasons: the GELU/SiLU output (saved by the next matmul; GELU keeps its own
input), the dropped-out attention probabilities (saved by the ``probs @ v`` matmul; the softmax
keeps its result and the dropout multiply keeps its mask), SwiGLU's ``silu(gate) * up``, and the
LayerNorm outputs (saved by the next matmul; LayerNorm keeps its input). Dropping them frees about
a third of a GPT block's activations (fp32, explicit attention) for a GELU, a multiply and two
LayerNorms in backward: several times less time per freed byte than recomputing the block, and
nothing random is rerun (the dropout mask is kept), so no RNG state is replayed. The rebuilt
tensors are bitwise those of the forward (same operator, same inputs).

How: ``with llmmem.recompute_cheap(block): y = block(x)`` installs ``saved_tensors_hooks`` whose pack
hook looks at each saved tensor's autograd node (``t.grad_fn``, or its base's for a view): if it is one
of :data:`REBUILDABLE` and each operand can be had at backward time from what autograd keeps (the
node's own saved inputs, possibly themselves rebuilt, or the saved result of the node that made
the operand, e.g. a softmax), it keeps a small handle (the node and the view's geometry)
instead of the tensor. The unpack hook reruns the operator (no grad, autocast off). No Python runs
per operator in the forward (a dispatch mode would: on the CPU that costs more than it saves).

Correctness: a consumer's backward always runs before the backward of the node that made its
input (which frees that node's saved tensors), so the operands are still there. Autograd does not
check versions of tensors saved through hooks, so the kept ones carry their version and an
in-place change after the forward raises ``CheckpointError`` (as autograd would), also when it
hits an operand of a rebuild. Memory: the kept tensors (reported to
``llmmem.checkpointing.meters.measure_saved_bytes``) and one small handle per dropped tensor. Not nestable
inside a checkpointed region (its hooks would hide the tensors from the region's); the planner uses
it at the top level only.
"""

from __future__ import annotations

import contextlib
import threading
import time
import weakref

import torch

from llmmem.checkpointing.errors import CheckpointError
from llmmem.checkpointing.observers import notify_kept

__all__ = ["recompute_cheap", "REBUILDABLE", "hook_clock"]

# Autograd node -> how to run its forward again from its operands. Only elementwise operators, and
# only nodes that keep their inputs (or whose inputs can be had otherwise, see _operand).
REBUILDABLE = {
    "GeluBackward0": lambda node, ops: torch.nn.functional.gelu(ops[0], approximate=node._saved_approximate),
    "SiluBackward0": lambda node, ops: torch.nn.functional.silu(ops[0]),
    "MulBackward0": lambda node, ops: torch.mul(ops[0], ops[1]),
}
# Where each REBUILDABLE node keeps its operands (their count is the node's arity).
_OPERAND_FIELDS = {
    "GeluBackward0": ("_saved_self",),
    "SiluBackward0": ("_saved_self",),
    "MulBackward0": ("_saved_self", "_saved_other"),
}
# Nodes whose output autograd keeps (as ``_saved_result``): an operand they made is available.
_RESULT_SAVED = frozenset(
    {"SoftmaxBackward0", "LogSoftmaxBackward0", "TanhBackward0", "SigmoidBackward0", "ExpBackward0", "ReluBackward0"}
)


def _name(node) -> str:
    return type(node).__name__


def _operand_saved(node, i: int) -> bool:
    """Does the node keep operand i itself? (For a multiply: operand i is kept when the other
    operand needs a gradient, i.e. has an autograd edge.)"""
    name = _name(node)
    if name == "MulBackward0":
        return node.next_functions[1 - i][0] is not None
    return True  # GELU and SiLU keep their input


def _operand_ok(node, i: int) -> bool:
    if _operand_saved(node, i):
        return True
    maker, nr = node.next_functions[i]
    if maker is None or nr != 0:
        return False
    # Only a kept result, whose version autograd checks. Rebuilding an operand that nothing keeps
    # (e.g. GELU's output in gelu(h) * mask) would miss a change made to it under no_grad before
    # this node used it: no version of it is recorded anywhere.
    return _name(maker) in _RESULT_SAVED


def _operands_available(node, name: str) -> bool:
    """Can every operand of ``node``, a REBUILDABLE node named ``name``, be had at backward time?"""
    return all(_operand_ok(node, i) for i in range(len(_OPERAND_FIELDS[name])))


class _Memo:
    """Rebuilt outputs of one forward's nodes, weakly (two views of one tensor rebuild it once)."""

    def __init__(self) -> None:
        self.results: dict = {}  # id(node) -> (node, weak reference to the rebuilt output)
        self.clock: list | None = None  # hook_clock's, when timed

    def run(self, op, *args) -> torch.Tensor:
        if self.clock is None:
            return op(*args)
        t0 = time.perf_counter()
        try:
            return op(*args)
        finally:
            self.clock[2] += time.perf_counter() - t0

    def output(self, node) -> torch.Tensor:
        hit = self.results.get(id(node))
        if hit is not None and hit[0] is node:
            done = hit[1]()
            if done is not None:
                return done
        name = _name(node)
        ops = [self.operand(node, i) for i in range(len(_OPERAND_FIELDS[name]))]
        out = self.run(REBUILDABLE[name], node, ops)
        key = id(node)
        # The entry (which holds the node) goes when the rebuilt output does: a node held here for
        # longer closes a cycle through C++ (node -> next node -> saved handle -> memo -> node)
        # that the garbage collector cannot see, and a graph kept by retain_graph, or not fully
        # run by autograd.grad, would never be freed.
        self.results[key] = (node, weakref.ref(out, lambda ref: self._forget(key, ref)))
        return out

    def _forget(self, key, ref) -> None:
        hit = self.results.get(key)
        if hit is not None and hit[1] is ref:
            self.results.pop(key, None)  # (a callback may run on a backward thread)

    def operand(self, node, i: int) -> torch.Tensor:
        if _operand_saved(node, i):
            return getattr(node, _OPERAND_FIELDS[_name(node)][i])
        return node.next_functions[i][0]._saved_result  # a kept result (_operand_ok)


def _layer_norm_operands(node) -> tuple:
    """What LayerNorm's node keeps, read before the rebuild is timed (a read may rebuild an operand)."""
    return node._saved_input, node._saved_normalized_shape, node._saved_weight, node._saved_bias, node._saved_result2


def _layer_norm(operands: tuple, eps: float) -> torch.Tensor:
    """LayerNorm's output again, from what its node keeps (eps is not among it: see _Hooks). The
    recomputed 1/std is checked against the saved one, so that an eps other than the forward's
    raises instead of giving wrong gradients."""
    x, shape, weight, bias, saved_rstd = operands
    out, _, rstd = torch.native_layer_norm(x, shape, weight, bias, eps)
    if not torch.equal(rstd, saved_rstd):
        raise RuntimeError(f"its statistics differ from the forward's with eps = {eps}")
    return out


class _Handle:
    """What the pack hook keeps instead of a dropped tensor: the node that made it (or its base),
    the view's geometry, and for a LayerNorm its eps."""

    __slots__ = ("node", "memo", "eps", "base_shape", "size", "stride", "offset")

    def __init__(self, node, memo: _Memo, base: torch.Tensor, t: torch.Tensor, eps=None) -> None:
        self.node, self.memo, self.eps = node, memo, eps
        self.base_shape = tuple(base.shape)
        self.size, self.stride, self.offset = tuple(t.shape), tuple(t.stride()), t.storage_offset()

    def rebuild(self) -> torch.Tensor:
        try:
            if self.eps is None:
                base = self.memo.output(self.node)
            else:
                base = self.memo.run(_layer_norm, _layer_norm_operands(self.node), self.eps)
        except RuntimeError as exc:
            raise CheckpointError(
                f"llmmem recompute-cheap: cannot rebuild the output of {_name(self.node)} for backward ({exc}). Its "
                "inputs are gone or were modified, e.g. that part of the graph was already differentiated; run this "
                "block in store-all mode instead"
            ) from exc
        if tuple(base.shape) != self.base_shape or not base.is_contiguous():
            raise CheckpointError(
                f"llmmem recompute-cheap: rebuilding {_name(self.node)} gave shape "
                f"{tuple(base.shape)} (contiguous: {base.is_contiguous()}), the forward had "
                f"{self.base_shape} (contiguous)"
            )
        if self.size == self.base_shape and self.offset == 0 and self.stride == tuple(base.stride()):
            return base
        return base.as_strided(self.size, self.stride, self.offset)


class _Kept:
    """A saved tensor kept as it is. Detached (same storage and version counter): a saved output
    kept as itself would hold its own grad_fn, a cycle through C++ that leaks when no backward
    runs. With saved_tensors_hooks autograd does not check versions itself, so this does: an
    in-place change after the forward saved the tensor raises instead of giving wrong gradients."""

    __slots__ = ("tensor", "version")

    def __init__(self, t: torch.Tensor) -> None:
        self.tensor, self.version = t.detach(), t._version

    def get(self) -> torch.Tensor:
        if self.tensor._version != self.version:
            raise CheckpointError(
                f"llmmem recompute-cheap: a tensor of shape {tuple(self.tensor.shape)} saved for backward was "
                f"modified by an inplace operation after the forward (version {self.version} -> "
                f"{self.tensor._version})"
            )
        return self.tensor


class _Hooks:
    def __init__(self, module) -> None:
        self.memo = _Memo()
        # LayerNorm's node keeps its input, weight and bias but not eps. The outputs of the module's
        # nn.LayerNorm calls are recorded with their eps by forward hooks (id -> (weak ref, eps)):
        # matching nodes to modules by their weight would take the module's eps for a functional
        # call with that weight and another eps, or for a subclass whose forward uses another eps
        # (only modules that run nn.LayerNorm's own forward are hooked).
        self.layer_norms = []
        if module is not None:
            self.layer_norms = [
                m
                for m in module.modules()
                if isinstance(m, torch.nn.LayerNorm) and type(m).forward is torch.nn.LayerNorm.forward
            ]
        self.ln_outputs: dict = {}

    def record_layer_norm(self, m, args, out) -> None:
        if isinstance(out, torch.Tensor):
            self.ln_outputs[id(out)] = (weakref.ref(out), m.eps)

    def _droppable(self, base) -> bool:
        # (version 0: not changed since its operator made it; a change under no_grad keeps the
        # grad_fn, and the rebuild would give the values before it)
        return (
            base.layout == torch.strided
            and base.is_contiguous()
            and base.storage_offset() == 0
            and base.untyped_storage().nbytes() == base.nbytes
            and base.output_nr == 0
            and base._version == 0
        )

    def pack(self, t: torch.Tensor):
        base = t._base if t._is_view() else t
        node = base.grad_fn if base is not None else None
        # (the name test first: it rejects most saved tensors, and this runs once per saved tensor)
        name = type(node).__name__ if node is not None else ""
        if name in REBUILDABLE and self._droppable(base) and _operands_available(node, name):
            return _Handle(node, self.memo, base, t)
        if name == "NativeLayerNormBackward0" and self.ln_outputs and self._droppable(base):
            hit = self.ln_outputs.get(id(base))
            if hit is not None and hit[0]() is base:
                return _Handle(node, self.memo, base, t, hit[1])
        notify_kept(t)
        return _Kept(t)

    @staticmethod
    def unpack(packed):
        if isinstance(packed, _Kept):
            return packed.get()
        with torch.no_grad(), contextlib.ExitStack() as stack:
            stack.enter_context(torch.autocast("cpu", enabled=False))
            if torch.cuda.is_available():
                stack.enter_context(torch.autocast("cuda", enabled=False))
            return packed.rebuild()


def recompute_cheap(module=None):
    """Context manager: run a forward in the ``"recompute-cheap"`` mode (module docstring).

    ``with llmmem.recompute_cheap(block): y = block(x)``; then backward as usual, inside or
    outside the context. Gradients are bitwise those of running ``block`` plainly. ``module``
    (optional): the outputs of its ``nn.LayerNorm`` submodules (those that run ``nn.LayerNorm``'s
    own forward) are rebuilt too: forward hooks record each output with its module's ``eps``
    (autograd does not keep it).
    """
    return _context(_Hooks(module))


# [pack seconds, unpack seconds, seconds of the rebuilding operators inside the unpacks] of the
# contexts entered inside hook_clock() on this thread (another thread's contexts are not the block's)
_clocks = threading.local()


def _clock() -> list | None:
    return getattr(_clocks, "clock", None)


@contextlib.contextmanager
def hook_clock():
    """Inside: the seconds spent in the pack and in the unpack hooks of every ``recompute_cheap``
    context entered inside on this thread, and in the operators that rebuild tensors within those
    unpacks (their operands fetched first), accumulate in the yielded ``[pack, unpack, operators]``
    (also when the backward runs after the context's exit). The innermost clock takes what runs
    inside it. The planner prices the mode's Python by the hooks' time less the operators', and the
    operators by their counted work (:mod:`llmmem.checkpointing.plan`)."""
    outer = _clock()
    _clocks.clock = [0.0, 0.0, 0.0]
    try:
        yield _clocks.clock
    finally:
        _clocks.clock = outer


def _timed(hook, clock: list, part: int):
    depth = [0]  # an unpack may need another (a rebuilt operand): count the outermost only

    def timed(x):
        depth[0] += 1
        t0 = time.perf_counter()
        try:
            return hook(x)
        finally:
            depth[0] -= 1
            if depth[0] == 0:
                clock[part] += time.perf_counter() - t0

    return timed


@contextlib.contextmanager
def _context(hooks: _Hooks):
    pack, unpack = hooks.pack, hooks.unpack
    clock = _clock()
    if clock is not None:
        pack, unpack = _timed(pack, clock, 0), _timed(unpack, clock, 1)
        hooks.memo.clock = clock
    handles = [m.register_forward_hook(hooks.record_layer_norm) for m in hooks.layer_norms]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, unpack):
            yield
    finally:
        for h in handles:
            h.remove()
