"""``llmmem.oom_report()``: an out-of-memory error turned into what was live and what to change.

Inside the block (or a function decorated with it) a :class:`~llmmem.diagnostics.tracker.MemoryTracker`
runs without a timeline (it keeps only what is alive, so it can stay on for a whole training
loop). When an out-of-memory error leaves the block, the report is raised *with* it: an exception
of a subclass of the original's type (so ``except torch.OutOfMemoryError`` and the like still
catch it), chained to the original (``__cause__``), whose message is the report and whose
``.report`` is an :class:`OutOfMemoryReport`.

Before the report is made, the memory of the failed attempt is released: the frames of the
traceback that finished are cleared (their locals held the step's activations), gradients that
did not exist when the step began are dropped, and on CUDA the allocator's cache is emptied.

The report says what the failed attempt changed (its "training state" line, and ``.changes``;
see :mod:`llmmem.diagnostics.step_changes`). A failure in the forward or backward writes no
parameter: the caller can retry with a smaller batch or one of the suggested changes. A failure
inside ``optimizer.step()`` (any ``torch.optim.Optimizer``) after it has written some parameters
or their state leaves the model half-updated: the report names the parameters it updated, says
the state is inconsistent, and that the step must be restored from a checkpoint, not retried.
"Untouched" is said only when the version counters of every known parameter and state tensor
show no write, and (with ``track=True``) no operator that writes in place wrote their storage.
"""

from __future__ import annotations

import contextlib
import gc
import os
import threading
import traceback

import torch

from llmmem.diagnostics.advice import estimate_settings, find_blocks, suggest
from llmmem.diagnostics.step_changes import StepWatch
from llmmem.diagnostics.tracker import MemoryTracker, is_out_of_memory, step_text
from llmmem.errors import arguments_text
from llmmem.units import format_bytes, parse_bytes

__all__ = ["oom_report", "OutOfMemoryReport", "OutOfMemoryReportError", "cuda_capacity"]


# inputs of an encoder-decoder that run at its decoder's length, as Hugging Face names them
_DECODER_INPUTS = ("labels", "decoder_input_ids", "decoder_attention_mask")


def _target_seq(model, input_shapes, named_inputs=None) -> int | None:
    """An encoder-decoder's decoder length: that of its ``labels``, ``decoder_input_ids`` or
    ``decoder_attention_mask`` keyword (a dict of inputs puts them in any order: an
    ``attention_mask`` after ``labels`` has the encoder's length); else the last 2-D integer input
    of the step (passed by position); None for any other model, or only one such input (the
    estimator then takes the encoder's length)."""
    if not getattr(getattr(model, "config", None), "is_encoder_decoder", False):
        return None
    for key in _DECODER_INPUTS:
        shape, _ = (named_inputs or {}).get(key, ((), None))
        if len(shape) == 2:
            return shape[1]
    ids = [
        shape
        for shape, dtype in input_shapes
        if len(shape) == 2 and not dtype.is_floating_point and dtype != torch.bool
    ]
    return ids[-1][1] if len(ids) > 1 else None


class OutOfMemoryReportError(Exception):
    """Mixed into the report's exception type: ``except llmmem.diagnostics.oom.OutOfMemoryReportError``
    catches any report; ``.report`` is the :class:`OutOfMemoryReport`."""

    report: OutOfMemoryReport
    _original: type  # the type of the error it reports (its other base)

    __str__ = arguments_text

    def __reduce__(self):
        # The type is made at run time: pickle (workers, multiprocessing) makes it again from the
        # original's, which it can find.
        return _rebuild_report, (self._original, self.args, self.__dict__)


def _rebuild_report(original: type, args: tuple, state: dict):
    exc = _report_type(original)(*args)
    exc.__dict__.update(state)
    return exc


_report_types: dict[type, type] = {}


def _report_type(original: type) -> type:
    cls = _report_types.get(original)
    if cls is None:
        attrs = {"__module__": original.__module__, "_original": original}
        try:
            cls = type(original.__name__, (OutOfMemoryReportError, original), attrs)
        except TypeError:  # a final exception type: the report is a RuntimeError then
            cls = type("OutOfMemoryError", (OutOfMemoryReportError, RuntimeError), {"_original": original})
        _report_types[original] = cls
    return cls


class OutOfMemoryReport:
    """What an out-of-memory error found: ``failure`` (the tracker's snapshot at the failure:
    phase, module, live bytes by category and by module, largest tensors, tensors that outlived
    the previous step, CUDA and pool figures), ``capacity`` (bytes), ``suggestions`` (a list of
    :class:`llmmem.diagnostics.advice.Suggestion`, best first), ``basis`` (the prediction they rest
    on), ``state`` (what was done to the training state and what the failed attempt changed, in
    words), ``changes`` (the latter as a dict: ``consistent`` False when an optimizer step failed
    part-way, ``failed_steps`` with the names of the parameters it updated, ...; see
    :meth:`llmmem.diagnostics.step_changes.StepWatch.changes`); ``str(report)`` is the text."""

    def __init__(self, original, failure, capacity, capacity_source, suggestions, basis, state, changes=None) -> None:
        self.original = original
        self.failure = failure
        self.capacity = capacity
        self.capacity_source = capacity_source
        self.suggestions = suggestions
        self.basis = basis
        self.state = state
        self.changes = changes

    def to_dict(self) -> dict:
        return {
            "error": f"{type(self.original).__name__}: {str(self.original).splitlines()[0] if str(self.original) else ''}",
            "failure": self.failure,
            "capacity": self.capacity,
            "capacity_source": self.capacity_source,
            "suggestions": [s.to_dict() for s in self.suggestions],
            "basis": self.basis,
            "state": self.state,
            "changes": self.changes,
        }

    def __str__(self) -> str:
        f = self.failure or {}
        first = str(self.original).splitlines()[0] if str(self.original) else type(self.original).__name__
        where = f.get("phase", "?") + (f" of {f['module']}" if f.get("module") else "")
        op = f", in {f['op']}" if f.get("op") else ""
        step = step_text(f["step"]) if isinstance(f.get("step"), int) else "step ?"
        lines = [f"out of memory in {where} ({step}{op}): {first}"]
        inconsistent = (self.changes or {}).get("consistent") is False
        if inconsistent:
            lines.append(
                "training state INCONSISTENT: an optimizer step failed part-way (see 'training state' below); "
                "restore the step from a checkpoint, do not retry it"
            )
        device = f.get("device", "cpu")
        live = f.get("live", {}).get(device, {})
        total = sum(live.values())
        cap = "unknown" if self.capacity is None else f"{format_bytes(self.capacity)} ({self.capacity_source})"
        lines.append(f"capacity {cap}; live tensors on {device} at the failure {format_bytes(total)}")
        if f.get("requested"):
            lines[-1] += f", requested {format_bytes(f['requested'])}"
        if live:
            lines.append(
                "  by category: "
                + ", ".join(f"{c} {format_bytes(b)}" for c, b in sorted(live.items(), key=lambda kv: -kv[1]) if b)
            )
        by_module = list((f.get("by_module") or {}).items())[:6]
        if by_module:
            lines.append("  by module (where made or owned, submodules apart):")
            for name, cats in by_module:
                parts = ", ".join(f"{c} {format_bytes(b)}" for c, b in sorted(cats.items(), key=lambda kv: -kv[1]))
                lines.append(f"    {name:<40} {format_bytes(sum(cats.values())):>11}  ({parts})")
        largest = f.get("largest") or []
        if largest:
            lines.append("largest live tensors:")
            for t in largest[:6]:
                made = t["phase"] + (f" of {t['module']}" if t["module"] else "")
                lines.append(
                    f"  {format_bytes(t['bytes']):>11}  {t['category']:<15} {t['dtype']}{t['shape']}  made in {made}"
                    + (f"  at {', '.join(t['where'][:2])}" if t["where"] else "")
                )
        cuda = f.get("cuda") or {}
        if cuda:
            lines.append(
                f"reserved but free (fragmentation): {format_bytes(cuda['reserved'] - cuda['allocated'])} "
                f"(allocated {format_bytes(cuda['allocated'])}, reserved {format_bytes(cuda['reserved'])})"
            )
        elif device == "cpu":
            lines.append(
                f"reserved but free: none on the CPU (no allocator cache); process RSS {format_bytes(_rss())}"
            )
        pool = f.get("pool")
        if pool:
            lines.append(
                f"llmmem pool: free {format_bytes(pool.get('free_bytes', 0))}, largest free block "
                f"{format_bytes(pool.get('largest_free_block', 0))}, reserved {format_bytes(pool.get('reserved_bytes.current', 0))}"
            )
        outlived = f.get("outlived") or {}
        if outlived.get("count"):
            lines.append(
                f"tensors that outlived the previous step: {outlived['count']}, {format_bytes(outlived['bytes'])}"
            )
            for t in outlived["largest"][:3]:
                made = t["phase"] + (f" of {t['module']}" if t["module"] else "")
                lines.append(
                    f"  {format_bytes(t['bytes']):>11}  {t['dtype']}{t['shape']} made {_made_in(t['step'])}, {made}"
                    + (f" at {', '.join(t['where'][:2])}" if t["where"] else "")
                )
        elif f.get("step", 0) > 0:
            lines.append("tensors that outlived the previous step: none")
        if self.basis.get("predicted_peak") is not None:
            over = self.basis["predicted_peak"] - (self.capacity or 0)
            lines.append(
                f"predicted peak of this step: {format_bytes(self.basis['predicted_peak'])} "
                f"(measured model state + estimator)"
                + (f", {format_bytes(over)} over capacity" if self.capacity and over > 0 else "")
            )
        if self.suggestions:
            lines.append(
                "what would make it fit, best first" + (" (once the step is restored)" if inconsistent else "") + ":"
            )
            for i, s in enumerate(self.suggestions, 1):
                lines.append(f"  {i}. {s.describe()}")
        for note in self.basis.get("notes", []):
            lines.append(f"note: {note}")
        if self.state:
            lines.append(f"training state: {self.state}")
        return "\n".join(lines)


def _made_in(step: int) -> str:
    text = step_text(step)
    return f"in {text}" if step >= 0 else text  # "made in step 3", "made outside a tracked step"


def _rss() -> int:
    try:
        with open("/proc/self/statm") as fh:
            return int(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


def _capacity(tracker: MemoryTracker, given):
    """(bytes, where the figure comes from) of the memory the step must fit in."""
    if given is not None:
        return given, "given"
    if tracker.budget is not None:
        return tracker.budget, "tracker budget"
    dev = tracker.device
    if dev.startswith("cuda") and torch.cuda.is_initialized():
        return cuda_capacity(dev)
    pool_stats = (tracker.failure or {}).get("pool") or {}
    if pool_stats.get("max_size"):
        return pool_stats["max_size"], "llmmem pool max_size"
    try:
        with open("/proc/meminfo") as fh:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in fh if ":" in line}
        return info["MemAvailable"] + sum(tracker.current().values()), "host memory available + live tensors"
    except (OSError, KeyError, ValueError):
        return None, "unknown"


def cuda_capacity(dev: str) -> tuple[int, str]:
    """(bytes torch may use on ``dev``, how it was found): free + reserved by torch, or the cap of
    ``torch.cuda.set_per_process_memory_fraction`` when that is lower."""
    free, total = torch.cuda.mem_get_info(dev)
    usable, source = (
        free + torch.cuda.memory_reserved(dev),
        f"free + reserved by torch on {dev}, of {format_bytes(total)}",
    )
    getter = getattr(torch.cuda, "get_per_process_memory_fraction", None)
    if getter is not None:
        cap = int(getter(dev) * total)
        if cap < usable:
            usable, source = cap, f"set_per_process_memory_fraction cap on {dev}"
    return usable, source


class _PerThread:
    """An attribute of :class:`oom_report` with one value per thread (``first(report)`` on a
    thread's first read): a decorated step run by several threads at once nests, and is tracked,
    on each thread apart."""

    def __init__(self, first) -> None:
        self.first = first

    def __set_name__(self, owner, name: str) -> None:
        self.name = name

    def __get__(self, obj, owner=None):
        if obj is None:
            return self
        values = obj._per_thread
        if not hasattr(values, self.name):
            setattr(values, self.name, self.first(obj))
        return getattr(values, self.name)

    def __set__(self, obj, value) -> None:
        setattr(obj._per_thread, self.name, value)


class oom_report(contextlib.ContextDecorator):
    """Context manager and decorator: an out-of-memory error inside becomes a report of what was
    live and what change would make the step fit (see the module docstring).

    :param model: the model (optional; default: the outermost module seen running). Needed for
        per-module names from the start, the estimator and the planner.
    :param optimizer: its state is counted from the start (optional).
    :param budget: a simulated device capacity (bytes or ``"4GB"``): the tracker raises
        :class:`llmmem.OutOfMemoryError` when live tensor bytes exceed it (testing on the CPU).
    :param capacity: what the step must fit in, for the suggestions (default: ``budget``, else the
        device's free + reserved memory, else the host's available memory).
    :param batch, seq: the step's batch and sequence length (default: read off the model's token ids).
    :param plan: run the recompute planner on the model's blocks for the checkpointing suggestion
        (profiles one block at the failing shape; gradients and RNG state are restored).
    :param track: keep a tracker on inside (``False``: no per-module or per-category figures, no
        overhead; the report then rests on the estimator and allocator figures only).

    What the failed attempt changed: ``exc.report.state`` (also the report's last line) and
    ``exc.report.changes``. An error inside ``optimizer.step()`` after it wrote some parameters
    or their state is reported as "k of n parameters updated (names), optimizer state
    inconsistent: restore the step from a checkpoint; do not retry" (and a line under the
    header); "untouched" only when no optimizer step began and no parameter was written in place.

    Cost: with ``track=True``, the tracker's (a Python call per operator, a record per live
    storage); with either, a few attribute reads per parameter and state tensor when the block
    begins and when each optimizer step begins; nothing more until an out-of-memory error. Any
    other exception passes unchanged.

    Example::

        @llmmem.oom_report(model=model, optimizer=opt)
        def train_step(idx):
            logits, loss = model(idx, targets=idx)
            loss.backward(); opt.step(); opt.zero_grad(set_to_none=True)

        try:
            train_step(batch)
        except torch.OutOfMemoryError as exc:   # or llmmem.OutOfMemoryError on a budget
            print(exc)                          # the report; exc.report.suggestions[0].code

    Threads: each thread that enters it gets its own tracker (``tracker`` is the calling thread's)
    and its own nesting; ``report`` is the last report made, on any thread.
    """

    tracker = _PerThread(lambda self: MemoryTracker(self.model, self.optimizer, budget=self._budget, timeline=False))
    _grads_none = _PerThread(lambda self: None)
    _depth = _PerThread(lambda self: 0)
    _watch = _PerThread(lambda self: None)  # each thread's step watch (llmmem.diagnostics.step_changes)

    def __init__(
        self,
        model=None,
        optimizer=None,
        *,
        budget=None,
        capacity=None,
        batch: int | None = None,
        seq: int | None = None,
        plan: bool = True,
        track: bool = True,
    ) -> None:
        for name, value in (("plan", plan), ("track", track)):
            if not isinstance(value, bool):
                raise TypeError(f"oom_report: {name} must be True or False, got {value!r}")
        for name, value in (("batch", batch), ("seq", seq)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value <= 0):
                raise ValueError(f"oom_report: {name} must be a positive int or None, got {value!r}")
        self.capacity = None if capacity is None else parse_bytes(capacity, "oom_report: capacity")
        if self.capacity == 0:
            raise ValueError("oom_report: capacity must be more than 0 bytes")
        if budget is not None and not track:
            raise ValueError("oom_report: budget= needs track=True (the tracker enforces it)")
        self._per_thread = threading.local()
        # the tracker validates model, optimizer and budget
        self.tracker = MemoryTracker(model, optimizer, budget=budget, timeline=False)
        self._budget = budget
        self.model, self.optimizer = model, optimizer
        self.batch, self.seq, self.plan, self.track = batch, seq, plan, track
        self.report: OutOfMemoryReport | None = None
        self._grads_none: set | None = None
        self._watch: StepWatch | None = None
        self._depth = 0

    def __enter__(self):
        self._depth += 1
        if self._depth > 1:
            return self  # nested use of the same report (a decorated function calling itself)
        model = self.model or (self.tracker.roots()[0] if self.tracker.roots() else None)
        self._grads_none = None if model is None else {id(p) for p in model.parameters() if p.grad is None}
        # With the tracker on, the watch also hears the in-place writes its dispatch mode sees.
        self._watch = StepWatch(model, self.optimizer, live=self.tracker.live if self.track else None).__enter__()
        if self.track:
            self.tracker.failure = self.tracker._failure_exc = None
            self.tracker.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb):
        self._depth -= 1
        if self._depth > 0:
            return False
        if self._watch is not None:
            self._watch.__exit__(exc_type, exc, tb)
        if self.track:
            self.tracker.__exit__(exc_type, exc, tb)
        if exc is None or not is_out_of_memory(exc) or isinstance(exc, OutOfMemoryReportError):
            return False
        try:
            report = self._make_report(exc)
        except Exception as failure:  # the user's OOM must reach them whatever the report does
            if hasattr(exc, "add_note"):  # Python >= 3.11
                exc.add_note(f"llmmem.oom_report: no report ({type(failure).__name__}: {failure})")
            return False
        self.report = report
        try:
            new = _report_type(type(exc))(str(report))
        except Exception:  # an exception type whose constructor wants more than a message
            new = _report_type(RuntimeError)(str(report))
        new.report = report
        raise new from exc

    # ---------------------------------------------------------------------------------------------
    def _make_report(self, exc) -> OutOfMemoryReport:
        tracker = self.tracker
        failure = tracker.failure
        if failure is not None and tracker._failure_exc != id(exc):
            # the autograd engine may re-raise a copy: the same failure if the message and step match
            first = str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__
            if failure["message"] != first or failure["step"] != tracker._step:
                failure = None
        if failure is None:  # not seen by the tracker (outside any operator, or track=False)
            failure = {
                "message": str(exc).splitlines()[0][:500] if str(exc) else type(exc).__name__,
                "type": type(exc).__name__,
                "op": None,
                "device": tracker.device,
                "phase": "?",
                "module": "",
                "step": tracker._step,
                "live": {d: tracker.current(d) for d in tracker.devices()} if self.track else {},
                "by_module": tracker.live_by_module() if self.track else {},
                "largest": tracker.largest_tensors(10) if self.track else [],
                "outlived": tracker.outlived() if self.track else {},
                "requested": None,
            }
        model = self.model or (tracker.roots()[0] if tracker.roots() else None)
        state, changes = self._release(exc, model)
        capacity, source = _capacity(tracker, self.capacity)
        suggestions, basis = [], {"notes": []}
        settings = None
        if model is not None:
            shape = (self.batch, self.seq) if self.batch and self.seq else tracker.batch_and_seq()
            optimizer = self.optimizer or next(iter(tracker._seen_optimizers), None)
            if shape is None:
                basis["notes"].append("batch and sequence length unknown (pass batch= and seq=): no estimate")
            else:
                settings = estimate_settings(
                    model,
                    batch=self.batch or shape[0],
                    seq=self.seq or shape[1],
                    optimizer=optimizer,
                    autocast_dtype=tracker.autocast_dtype,
                    device=tracker.device,
                    target_seq=_target_seq(model, tracker.input_shapes, tracker.named_inputs),
                )
            blocks = find_blocks(model)
            block_input = tracker.module_inputs.get(tracker._name_of(blocks[1][0])) if blocks else None
            live = failure.get("live", {}).get(tracker.device, {})
            cuda = failure.get("cuda") or {}
            frag = None
            if cuda:
                frag = {"reserved_free": cuda["reserved"] - cuda["allocated"], "requested": failure.get("requested")}
            if capacity is not None:
                notes = basis["notes"]
                suggestions, basis = suggest(
                    model,
                    capacity=capacity,
                    settings=settings,
                    measured=live,
                    outlived=(failure.get("outlived") or {}).get("bytes", 0),
                    block_input=block_input,
                    fragmentation=frag,
                    plan=self.plan,
                    optimizer=optimizer,
                )
                basis["notes"] = notes + basis["notes"]
        else:
            basis["notes"].append("no model seen: pass model= for per-model suggestions")
        return OutOfMemoryReport(exc, failure, capacity, source, suggestions, basis, state, changes)

    def _release(self, exc, model) -> tuple[str, dict | None]:
        """Frees what the failed attempt left (finished frames' locals, gradients made in the step);
        returns what was done and what the attempt changed, in words, and the latter as a dict."""
        changes = self._watch.changes(model) if self._watch is not None else None
        tb = exc.__traceback__
        if tb is not None:
            traceback.clear_frames(tb)
        done = []
        if model is not None and self._grads_none is not None:
            dropped = 0
            partial = 0
            for p in model.parameters():
                if p.grad is None:
                    continue
                if id(p) in self._grads_none:
                    p.grad = None
                    dropped += 1
                else:
                    partial += 1
            if dropped:
                done.append(f"gradients of {dropped} parameter(s) made during the failed step were dropped")
            if partial and (self.tracker.failure or {}).get("phase") in ("backward", "recompute"):
                done.append(
                    f"{partial} parameter(s) already had gradients, which the failed backward may have partly "
                    "accumulated into: zero them before retrying"
                )
        gc.collect()
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            torch.cuda.empty_cache()
        if changes is not None:
            done.append(changes["text"])
        return "; ".join(done), changes
