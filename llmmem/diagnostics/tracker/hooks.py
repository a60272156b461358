"""The tracker's hooks: module forward (global hooks), backward (gradient hooks on each module's
outputs and inputs), the optimizer's step, parameters' gradients, and tensors saved for backward.
A part of :class:`~llmmem.diagnostics.tracker.MemoryTracker` (it holds the state they update)."""

from __future__ import annotations

import weakref

import torch
from torch.utils._pytree import tree_leaves

__all__ = ["ModuleHooks", "BackwardMark", "pop_module", "unpack"]


class ModuleHooks:
    """The hooks of :class:`~llmmem.diagnostics.tracker.MemoryTracker` (mixed into it)."""

    # =============================================================================================
    # modules, inputs, parameters
    # =============================================================================================
    def _name_of(self, module) -> str:
        name = self._names.get(module)
        if name is None:
            name = type(module).__name__
            self._names[module] = name
        return name

    def _adopt(self, root: torch.nn.Module) -> None:
        """Names ``root``'s modules, counts its parameters/buffers/gradients, hooks its gradients."""
        if root in self._adopted:
            return
        prefix = self._names.get(root) or type(root).__name__
        for sub_name, sub in root.named_modules(remove_duplicate=True):
            self._names.setdefault(sub, f"{prefix}.{sub_name}" if sub_name else prefix)
        if "." not in prefix and not any(r() is root for r in self._roots):
            self._roots.append(weakref.ref(root))
        # The global pre-forward hook sees no keyword arguments (Hugging Face models take
        # input_ids=...): the outermost module gets its own hook for them.
        self._param_handles.append(root.register_forward_pre_hook(self._root_kwargs, with_kwargs=True))
        seen = set()
        for sub in root.modules():
            if sub in self._adopted:
                continue
            self._adopted.add(sub)
            owner = self._name_of(sub)
            for p in sub.parameters(recurse=False):
                if id(p) in seen:
                    continue
                seen.add(id(p))
                self._param_names.setdefault(id(p), owner)
                self._label(p, "parameters", module=owner)
                if p.grad is not None:
                    self._label(p.grad, "gradients", module=owner)
                if p.requires_grad:
                    handle = p.register_post_accumulate_grad_hook(self._grad_hook)
                    run_first(p, handle)
                    self._param_handles.append(handle)
            for b in sub.buffers(recurse=False):
                self._label(b, "buffers", module=owner)

    def _grad_hook(self, p) -> None:
        if self._active and p.grad is not None:
            self._label(p.grad, "gradients", module=self._param_names.get(id(p)))

    def _adopt_optimizer(self, opt) -> None:
        self._seen_optimizers.add(opt)
        for p, state in list(opt.state.items()):
            owner = self._param_names.get(id(p))
            for v in state.values() if isinstance(state, dict) else ():
                self._label(v, "optimizer_state", module=owner)

    def _pre_forward(self, module, args):
        if not self._here():
            return
        with self._lock:
            if torch._C._current_graph_task_id() != -1:
                name = self._name_of(module)
                self._rstack.append((name, self._open(name, "recompute", outermost=not self._rstack)))
                return
            if not self._stack:
                self._enter_root(module, args)
            name = self._name_of(module)
            self._stack.append((name, self._open(name, "forward")))
            if args and isinstance(args[0], torch.Tensor):
                x = args[0]
                self.module_inputs[name] = (tuple(x.shape), x.dtype, x.device)

    def _enter_root(self, module, args) -> None:
        if self._in_bw or self._in_optimizer:  # the last backward or step raised: its end never came
            self._finish_backward()
            self._in_optimizer = 0
        if self._step_done:
            self._step += 1
            self.steps += 1
            self._step_done = False
            self._inputs = []
            self.input_shapes = []
            self.named_inputs = {}
            self._sample_cuda("step")
        kind = torch.device(self.device).type
        self.autocast_dtype = torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind) else None
        self._fwd_active = True
        if module not in self._adopted:
            self._adopt(module)
        self._mark_phase("forward")
        self._label_inputs(args)

    def _root_kwargs(self, module, args, kwargs):
        if self._here() and len(self._stack) == 1 and torch._C._current_graph_task_id() == -1:
            with self._lock:
                self._label_inputs(kwargs)
                for key, value in kwargs.items():
                    if isinstance(value, torch.Tensor):
                        self.named_inputs[key] = (tuple(value.shape), value.dtype)

    def _label_inputs(self, obj) -> None:
        for t in tree_leaves(obj):
            if isinstance(t, torch.Tensor) and not isinstance(t, torch.nn.Parameter):
                self._label(t, "inputs")
                self.input_shapes.append((tuple(t.shape), t.dtype))
                if t.requires_grad and t.is_leaf:
                    self._inputs.append(weakref.ref(t))

    def _post_forward(self, module, args, *rest):
        # (kwargs, output) normally; torch calls a global with_kwargs hook with (output,) only when
        # the forward raised (an out-of-memory error, checkpointing's early stop): pop, hook nothing.
        if not self._here():
            return
        failed = len(rest) != 2
        kwargs, output = ({}, None) if failed else rest
        with self._lock:
            name = self._name_of(module)
            if torch._C._current_graph_task_id() != -1:
                pop_module(self._rstack, name, self._close)
                return
            pop_module(self._stack, name, self._close)
            if not self._stack:
                if failed:  # the attempt is over: a retry is the next step
                    self._step_done = True
                    self._fwd_active = False
                    self._mark_phase("other")
        if failed or not torch.is_grad_enabled():
            return
        outs = [t for t in tree_leaves(output) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if not outs:
            return
        me = weakref.ref(self)
        push = BackwardMark(me, name, True)
        for t in outs:
            t.register_hook(push)
        # Leaves are skipped: a hook on a leaf stays on it after the step. Without a non-leaf input,
        # the module leaves backward when backward ends.
        ins = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor) and t.grad_fn is not None]
        if ins:
            pop = BackwardMark(me, name, False)
            for t in ins:
                t.register_hook(pop)

    def _open(self, name: str, phase: str, outermost: bool = False) -> int:
        self._intervals.append([name, phase, self._step, self.events, None, outermost])
        return len(self._intervals) - 1

    def _close(self, index: int) -> None:
        self._intervals[index][4] = self.events

    def _bw_mark(self, name: str, push: bool) -> None:
        if not self._active:
            return
        with self._lock:
            if not self._in_bw:
                self._begin_backward()
            entry = self._bw_active.get(name)
            if push:
                if entry is None:
                    self._bw_active[name] = [1, self._open(name, "backward")]
                else:
                    entry[0] += 1
            elif entry is not None:
                entry[0] -= 1
                if entry[0] == 0:
                    del self._bw_active[name]
                    self._close(entry[1])

    def _begin_backward(self) -> None:
        self._in_bw = True
        self._fwd_active = False
        self._step_done = True
        self._bw_start.setdefault(self._step, self.events)
        self._mark_phase("backward")
        me = weakref.ref(self)
        torch.autograd.Variable._execution_engine.queue_callback(lambda: call_method(me, "_end_backward"))

    def _finish_backward(self) -> None:
        for _, index in self._bw_active.values():
            self._close(index)
        self._bw_active.clear()
        while self._rstack:
            self._close(self._rstack.pop()[1])
        self._in_bw = False
        self._mark_phase("other")

    def _end_backward(self) -> None:
        with self._lock:
            self._finish_backward()
            inputs = [r() for r in self._inputs]
        for t in inputs:
            if t is not None and t.grad is not None:
                self._label(t.grad, "gradients")
        self._sample_cuda("backward end")

    def _pre_step(self, opt, args, kwargs):
        if not self._here():
            return
        with self._lock:
            if opt not in self._seen_optimizers:
                self._adopt_optimizer(opt)
            self._in_optimizer += 1
            self._fwd_active = False
            self._step_done = True
            self._mark_phase("optimizer")

    def _post_step(self, opt, args, kwargs):
        if not self._here():
            return
        with self._lock:
            self._adopt_optimizer(opt)
            self._in_optimizer = max(0, self._in_optimizer - 1)
            self._mark_phase("other")
        self._sample_cuda("optimizer end")

    def _pack(self, t: torch.Tensor):
        # Only the innermost saved_tensors_hooks run (they are thread-local, and autograd's threads
        # inherit them): this tracker labels the tensor for itself and for the trackers it was
        # entered inside on its thread (an oom_report inside a profiling tracker), never for a
        # tracker of another thread.
        if self._active:
            self._label(t, saved=True)
        for ref in self._outer:
            tracker = ref()
            if tracker is not None and tracker._active:
                tracker._label(t, saved=True)
        # A saved output returned as itself would hold its own grad_fn: a reference cycle through C++
        # that leaks when a forward is abandoned (an out-of-memory error). Detached: same storage and
        # version counter, so backward computes the same thing. The version goes with it: torch
        # checks it only for tensors saved without hooks (see unpack).
        return (t if t.grad_fn is None else t.detach()), (None if t.is_inference() else t._version)

    def _kept(self, t: torch.Tensor) -> None:
        if self._active:
            self._label(t, saved=True)


class BackwardMark:
    """A gradient hook on a module's outputs (it enters backward at the first of their gradients)
    or on its inputs (it leaves at the first of theirs: exact for one input, early for several).

    Holds nothing but a weak reference to the tracker: torch's ``register_multi_grad_hook`` keeps
    the inputs' autograd nodes in the hook stored on those nodes, a reference cycle through C++
    that the garbage collector cannot break, so an abandoned graph (an out-of-memory error in the
    forward) would keep every activation alive."""

    __slots__ = ("tracker", "name", "push", "task")

    def __init__(self, tracker, name: str, push: bool) -> None:
        self.tracker, self.name, self.push, self.task = tracker, name, push, None

    def __call__(self, grad):
        task = torch._C._current_graph_task_id()
        if task == self.task:  # once per backward pass
            return
        self.task = task
        tracker = self.tracker()
        if tracker is not None:
            tracker._bw_mark(self.name, self.push)


def run_first(p: torch.Tensor, handle) -> None:
    """Puts the post-accumulate-grad hook of ``handle`` before ``p``'s other ones, so that it sees the
    gradient before a hook that steps and frees it (``llmmem.optim.step_in_backward``, torch's
    optimizer-in-backward recipe): a gradient never labelled as one would count as a temporary.
    torch runs them in the order of the underlying dict (an ``OrderedDict``'s ``move_to_end`` does
    not change it), so the same dict is refilled: the other hooks' handles still remove theirs."""
    hooks = getattr(p, "_post_accumulate_grad_hooks", None)
    if not isinstance(hooks, dict) or len(hooks) < 2 or next(iter(hooks)) == handle.id:
        return
    mine = hooks.pop(handle.id, None)
    if mine is None:
        return
    others = list(hooks.items())
    hooks.clear()
    hooks[handle.id] = mine
    hooks.update(others)


def call_method(ref, method: str) -> None:
    obj = ref()
    if obj is not None:
        getattr(obj, method)()


def unpack(packed):
    """The tracker's unpack hook: the saved tensor, after autograd's check that it was not modified
    in place since it was saved (torch makes that check only for tensors saved without hooks, so
    without this a tracked backward would compute a wrong gradient where an untracked one raises)."""
    t, version = packed
    if version is not None and t._version != version:
        shape = ", ".join(str(n) for n in t.shape)
        raise RuntimeError(
            "one of the variables needed for gradient computation has been modified by an inplace operation: "
            f"[{t.type()} [{shape}]] is at version {t._version}; expected version {version} instead "
            "(checked by llmmem's MemoryTracker, whose saved-tensor hooks stand in for autograd's own check). "
            "Hint: enable anomaly detection to find the operation that failed to compute its gradient, with "
            "torch.autograd.set_detect_anomaly(True)."
        )
    return t


def pop_module(stack: list, name: str, close) -> None:
    """Pops ``name`` (and anything above it, left by an exception) from a module stack."""
    for i in range(len(stack) - 1, -1, -1):
        if stack[i][0] == name:
            while len(stack) > i:
                close(stack.pop()[1])
            return
