"""What a failed training step changed: which parameters an optimizer step had already written when
it failed, and whether anything was written at all.

:class:`StepWatch` is entered around a block (by :func:`llmmem.oom_report`). It keeps cheap markers
— each tensor's version counter (bumped by every in-place write), data pointer and shape; each
optimizer's per-parameter state (tensors by marker, numbers by value) and group settings — taken
when the block begins and again when each optimizer step begins (torch's global step hooks, so any
``torch.optim.Optimizer`` subclass is seen, whatever it does inside). After a failure,
:meth:`StepWatch.changes` compares them with the tensors as they are: an optimizer step that
began and never finished, and wrote some parameters or state before it failed, leaves the model
half-updated, and the report says so and which.

Given a :class:`~llmmem.diagnostics.live.LiveBytes` (the tracker's, as ``oom_report`` does), it
also hears every operator that writes in place, from the operator's schema, and marks the watched
storages it wrote. That sees what version counters miss: fused kernels (``fused=True``: torch's
``_fused_adamw_`` bumps none), BatchNorm's running statistics, writes through ``p.data`` (a
tensor with a version counter of its own). (Foreach kernels, which bump none under a dispatch mode,
are bumped by the mode itself.)

What it cannot see: C extensions writing through ``data_ptr()``, and, without a ``LiveBytes``,
the writes above — so a step that failed with no write seen is reported as not proven unchanged,
never as untouched; and optimizers that are not ``torch.optim.Optimizer`` subclasses (their
writes to the parameters are still seen, as writes outside a step).

Cost: a few attribute reads per parameter and per state tensor at the block's start and at each
optimizer step; with a ``LiveBytes``, a set lookup per tensor an operator writes in place. No
tensor is made, copied or synchronised.
"""

from __future__ import annotations

import threading

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from llmmem.dtensors import local

__all__ = ["StepWatch"]

_SHOWN = 8  # names listed in the text; the dict has them all


def _key(t: torch.Tensor):
    """The id of ``t``'s storage (stable while it lives; views and ``.data`` share it), or None. A
    DTensor's is its local shard's: the mode hears writes to the DTensor, the step writes the shard."""
    try:
        return id(local(t).untyped_storage())
    except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass, a meta tensor)
        return None


def _state_keys(opt, p) -> list:
    state = opt.state.get(p)
    if not isinstance(state, dict):
        return []
    return [k for k in (_key(v) for v in state.values() if isinstance(v, torch.Tensor)) if k is not None]


def _marker(t: torch.Tensor):
    t = local(t)  # a DTensor's data_ptr() is not its data's
    try:
        ptr = t.data_ptr()
    except (RuntimeError, NotImplementedError):  # no storage (a wrapper subclass, a meta tensor)
        ptr = None
    return (t._version, ptr, tuple(t.shape))


def _value(v):
    if isinstance(v, torch.Tensor):
        return ("tensor", _marker(v))
    if v is None or isinstance(v, (bool, int, float, complex, str)):
        return ("value", v)
    if isinstance(v, (list, tuple)):
        return ("seq", tuple(_value(x) for x in v))
    if isinstance(v, dict):
        return ("dict", tuple((k, _value(x)) for k, x in v.items()))
    return ("object", id(v))


def _state_of(opt, p):
    state = opt.state.get(p)  # .get: the state is a defaultdict, do not make an entry
    if state is None:
        return None
    if not isinstance(state, dict):
        return _value(state)
    return {k: _value(v) for k, v in state.items()}


def _groups_of(opt):
    return [{k: _value(v) for k, v in g.items() if k != "params"} for g in opt.param_groups]


class _OptimizerMarks:
    """Markers of an optimizer's parameters and state at one moment (``epoch``: the watch's count of
    marks taken then; writes heard since carry it or a later one)."""

    def __init__(self, opt, watch: StepWatch) -> None:
        self.params = [p for g in opt.param_groups for p in g["params"]]
        self.param_marks = [_marker(p) for p in self.params]
        self.state_marks = [_state_of(opt, p) for p in self.params]
        self.groups = _groups_of(opt)
        self.epoch = watch._new_epoch()
        if watch.live is not None:
            self.param_keys = [_key(p) for p in self.params]
            self.state_keys = [_state_keys(opt, p) for p in self.params]
            watch._watch_keys(self.param_keys)
            for keys in self.state_keys:
                watch._watch_keys(keys)

    def diff(self, opt, watch: StepWatch) -> tuple[list[int], list[int], bool]:
        """(indices of parameters written, indices whose state changed, group settings changed)."""
        written = [
            i
            for i, p in enumerate(self.params)
            if _marker(p) != self.param_marks[i]
            or (watch.live is not None and watch._written_since(self.param_keys[i], self.epoch))
        ]
        state = [
            i
            for i, p in enumerate(self.params)
            if _state_of(opt, p) != self.state_marks[i]
            or (watch.live is not None and any(watch._written_since(k, self.epoch) for k in self.state_keys[i]))
        ]
        return written, state, _groups_of(opt) != self.groups


def _names(model, opt) -> dict[int, str]:
    """id(parameter) -> a name: the model's, else its place in the optimizer's groups."""
    names = {}
    if opt is not None:
        for gi, g in enumerate(opt.param_groups):
            for pi, p in enumerate(g["params"]):
                names[id(p)] = f"{type(opt).__name__}.param_groups[{gi}]['params'][{pi}]"
    if model is not None:
        for name, p in model.named_parameters():
            names[id(p)] = name
    return names


def _listed(names: list[str]) -> str:
    shown = ", ".join(names[:_SHOWN])
    return shown + (f", ... {len(names) - _SHOWN} more" if len(names) > _SHOWN else "")


class StepWatch:
    """Context manager: what the optimizer steps run inside it (on the entering thread) and the
    writes to ``model``'s parameters and buffers changed. See the module docstring.

    :param model: its parameters and buffers are marked on entry (optional).
    :param optimizer: its parameters, state and settings are marked on entry (optional); every
        other optimizer is marked when its step begins.
    :param live: a :class:`~llmmem.diagnostics.live.LiveBytes` whose writes to watched storages are
        recorded while the watch is entered (optional; see the module docstring). The watch does
        not enter it.
    """

    def __init__(self, model=None, optimizer=None, *, live=None) -> None:
        self.model, self.optimizer, self.live = model, optimizer, live
        self._epoch = 0
        self._watched: set[int] = set()  # storage ids of the parameters, buffers and state marked
        self._written: dict[int, int] = {}  # storage id -> the epoch of its last write heard
        self._handles: list = []
        self._thread = None
        self._entry_params: dict[int, tuple] = {}  # id -> (parameter, marker)
        self._entry_buffers: dict[str, tuple] = {}  # name -> (buffer, marker)
        self._entry_opt: _OptimizerMarks | None = None
        self._running: dict[int, tuple] = {}  # id(optimizer) -> (optimizer, marks at its step's start)
        self._completed: dict[int, list] = {}  # id(optimizer) -> [optimizer, steps completed]

    def __enter__(self):
        self._thread = threading.get_ident()
        self._running, self._completed = {}, {}
        self._watched, self._written = set(), {}
        self._entry_epoch = self._new_epoch()
        if self.model is not None:
            self._entry_params = {id(p): (p, _marker(p)) for p in self.model.parameters()}
            self._entry_buffers = {n: (b, _marker(b)) for n, b in self.model.named_buffers()}
        if self.optimizer is not None:
            self._entry_opt = _OptimizerMarks(self.optimizer, self)
            for p in self._entry_opt.params:
                self._entry_params.setdefault(id(p), (p, _marker(p)))
        if self.live is not None:
            self._watch_keys(_key(p) for p, _ in self._entry_params.values())
            self._watch_keys(_key(b) for b, _ in self._entry_buffers.values())
            self.live.write_listeners.append(self._on_write)
        self._handles = [
            register_optimizer_step_pre_hook(self._pre_step),
            register_optimizer_step_post_hook(self._post_step),
        ]
        return self

    def __exit__(self, *exc):
        for h in self._handles:
            h.remove()
        self._handles = []
        if self.live is not None and self._on_write in self.live.write_listeners:
            self.live.write_listeners.remove(self._on_write)
        return False

    # -- writes heard from the dispatch mode (any thread it runs on: autograd's too) -------------
    def _new_epoch(self) -> int:
        self._epoch += 1
        return self._epoch

    def _watch_keys(self, keys) -> None:
        self._watched.update(k for k in keys if k is not None)

    def _on_write(self, func, tensors) -> None:
        # Only watched storages are remembered: a long block writes many temporaries in place.
        watched, epoch = self._watched, self._epoch
        for t in tensors:
            key = _key(t)
            if key in watched:
                self._written[key] = epoch

    def _written_since(self, key, epoch: int) -> bool:
        return key is not None and self._written.get(key, 0) >= epoch

    def _changed_since_entry(self, t: torch.Tensor, mark) -> bool:
        if _marker(t) != mark:
            return True
        return self.live is not None and self._written_since(_key(t), self._entry_epoch)

    def _pre_step(self, opt, args, kwargs) -> None:
        if threading.get_ident() == self._thread:
            self._running[id(opt)] = (opt, _OptimizerMarks(opt, self))

    def _post_step(self, opt, args, kwargs) -> None:
        if threading.get_ident() == self._thread:
            self._running.pop(id(opt), None)
            self._completed.setdefault(id(opt), [opt, 0])[1] += 1

    # ---------------------------------------------------------------------------------------------
    def changes(self, model=None) -> dict:
        """What changed since entry, as a dict; ``text`` says it in a line.

        ``consistent``: False when an optimizer step failed after writing some parameters or its
        state (restore the step from a checkpoint); True when no optimizer step was cut short and
        no parameter was written outside one; None when it cannot be told: nothing known to watch,
        parameters written outside any optimizer step, or a step that failed with no write seen
        (a C extension writes without version counters or an operator; without a ``live``, so does
        a fused kernel). ``failed_steps``: one dict per optimizer whose step began and did not
        finish (``optimizer``, ``parameters``, ``updated`` and ``state_changed`` names,
        ``settings_changed``, ``fused``, ``writes_heard``: whether operators' in-place writes were
        watched, not only version counters).
        ``completed_steps``: ``{optimizer class: steps}``. ``changed_outside_steps``: parameters
        written while no optimizer step ran on them. ``buffers_changed``: names of buffers
        written in place."""
        model = model if model is not None else self.model
        out = {
            "consistent": None,
            "failed_steps": [],
            "completed_steps": {},
            "changed_outside_steps": [],
            "buffers_changed": [],
        }
        stepped: set[int] = set()  # parameters an optimizer step ran on
        for opt, marks in self._running.values():
            names = _names(model, opt)
            written, state, settings = marks.diff(opt, self)
            stepped.update(id(p) for p in marks.params)
            out["failed_steps"].append(
                {
                    "optimizer": type(opt).__name__,
                    "parameters": len(marks.params),
                    "updated": [names[id(marks.params[i])] for i in written],
                    "state_changed": [names[id(marks.params[i])] for i in state],
                    "settings_changed": settings,
                    "fused": any(g.get("fused") for g in opt.param_groups),
                    "writes_heard": self.live is not None,
                }
            )
        for opt, count in self._completed.values():
            key = type(opt).__name__
            out["completed_steps"][key] = out["completed_steps"].get(key, 0) + count
            stepped.update(id(p) for g in opt.param_groups for p in g["params"])
        names = _names(model, self.optimizer)
        out["changed_outside_steps"] = [
            names.get(pid, "?")
            for pid, (p, mark) in self._entry_params.items()
            if pid not in stepped and self._changed_since_entry(p, mark)
        ]
        out["buffers_changed"] = [
            n for n, (b, mark) in self._entry_buffers.items() if self._changed_since_entry(b, mark)
        ]
        optimizer_untouched = True
        if self.optimizer is not None and id(self.optimizer) not in self._completed:
            if id(self.optimizer) not in self._running:
                _, state, settings = self._entry_opt.diff(self.optimizer, self)
                optimizer_untouched = not (state or settings)
        partial = [f for f in out["failed_steps"] if f["updated"] or f["state_changed"] or f["settings_changed"]]
        known = bool(self._entry_params) or bool(self._running) or bool(self._completed)
        if partial:
            out["consistent"] = False
        elif out["failed_steps"] or not known or out["changed_outside_steps"] or not optimizer_untouched:
            # a step that failed with no write seen may still have written through a C extension (or,
            # with no LiveBytes to hear it, a fused kernel)
            out["consistent"] = None
        else:
            out["consistent"] = True
        out["text"] = _text(out, known, optimizer_untouched, self.optimizer is not None or bool(self._running))
        return out


def _text(out: dict, known: bool, optimizer_untouched: bool, optimizer_known: bool) -> str:
    parts = []
    for f in out["failed_steps"]:
        if f["updated"] or f["state_changed"] or f["settings_changed"]:
            what = f"{len(f['updated'])} of {f['parameters']} parameters updated"
            what += f" ({_listed(f['updated'])})" if f["updated"] else ""
            if f["state_changed"]:
                what += f", the optimizer state of {len(f['state_changed'])} changed"
                only = [n for n in f["state_changed"] if n not in f["updated"]]
                if only:
                    what += f" ({len(only)} without a write to their parameter seen: {_listed(only)})"
            if f["settings_changed"]:
                what += ", its param_groups settings changed"
            if f["fused"] and not f["writes_heard"]:
                what += " (a fused kernel writes parameters without their version counters: more may be updated)"
            parts.append(
                f"the failure came inside {f['optimizer']}.step(): {what}; optimizer state inconsistent: "
                "restore the step from a checkpoint; do not retry"
            )
        elif f["writes_heard"]:
            parts.append(
                f"the failure came inside {f['optimizer']}.step() before any write seen (version counters and "
                "every operator that writes in place were watched); a C extension writing through data_ptr() is "
                "seen by neither, so this does not prove the parameters unchanged: restore the step from a "
                f"checkpoint unless {f['optimizer']}.step() is all-or-nothing"
            )
        else:
            parts.append(
                f"the failure came inside {f['optimizer']}.step() before any write that version counters record; "
                "a fused kernel or a C extension writes without them, so this does not prove the parameters "
                f"unchanged: restore the step from a checkpoint unless {f['optimizer']}.step() is all-or-nothing"
            )
    if out["completed_steps"]:
        steps = ", ".join(f"{n} {k}.step()" for k, n in out["completed_steps"].items())
        parts.append(f"{steps} completed inside the block before the failure (their updates are kept)")
    if out["changed_outside_steps"]:
        names = out["changed_outside_steps"]
        parts.append(f"{len(names)} parameter(s) written in place outside any optimizer step ({_listed(names)})")
    if not optimizer_untouched:
        parts.append("the optimizer's state or settings changed outside a step")
    if out["buffers_changed"]:
        parts.append(
            f"{len(out['buffers_changed'])} buffer(s) written ({_listed(out['buffers_changed'])}): a training "
            "forward updates BatchNorm statistics, and a retry updates them again"
        )
    if not known:
        parts.append("whether parameters or optimizer state changed is unknown (no model or optimizer given or seen)")
    elif out["consistent"] is True and not out["completed_steps"]:
        what = "parameters and optimizer state" if optimizer_known else "parameters"
        parts.append(f"no optimizer step began and no parameter was written in place: {what} untouched")
    return "; ".join(parts)
