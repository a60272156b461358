"""Where did my memory go: :class:`MemoryTracker`, bytes per module x phase x category, over time.

How it works (all on top of :class:`llmmem.diagnostics.live.LiveBytes`, so it is exact on any
device: every tensor storage an operator returns is counted from the moment it appears until it is
freed):

* **category** of a storage, decided when it appears and refined by identity afterwards (the
  timeline is computed from the final categories, so a storage that later turns out to be a
  gradient counts as one from the start): ``parameters`` and ``buffers`` (the modules' own),
  ``gradients`` (``.grad`` of a parameter, seen by a post-accumulate-grad hook, or of an input),
  ``optimizer_state`` (in ``optimizer.state`` after a step), ``inputs`` (tensors given to the
  outermost module), ``activations`` (saved for backward: seen by a ``saved_tensors_hooks`` pack
  hook or reported by a checkpointing mode, and what a checkpointed region recomputes in
  backward), ``temporaries`` (made during a step and not kept for backward), ``other`` (made
  outside a step and never identified);
* **phase**: ``forward`` (from the outermost module's forward until backward starts, so a loss
  computed outside the model counts), ``backward``, ``recompute`` (a module's forward run again
  inside backward: activation checkpointing), ``optimizer`` (inside ``optimizer.step``) or
  ``other``;
* **module**: the innermost module running (global forward hooks; in backward, gradient hooks on
  each module's outputs (it enters) and inputs (it leaves), as ``torch.distributed._tools.mod_tracker``
  does, but also on tensors passed by keyword, and without its reference cycle). Names are
  hierarchical, ``GPT.blocks.0.attn``.

``llmmem.checkpoint`` regions show as what they are: inside a region nothing is saved (its own
hooks replace the tracker's), so the region's tensors are temporaries in the forward and only its
inputs stay; the recompute shows as phase ``recompute`` in backward, attributed to the modules it
re-runs (the "recomputed" column of :meth:`MemoryTracker.table`). Offloaded inputs are counted on
the memory they are kept in (host vs device: every figure is per device). Under
``torch.distributed`` the rank (and the tensor-parallel rank of ``llmmem.parallel.init``) is part of
every output. On CUDA, ``torch.cuda.memory_stats`` (allocated, reserved, reserved-but-free) and the
statistics of the llmmem pool in use are sampled at every phase change.

Cost: the tracker is a diagnostic. Per operator a Python call (the dispatch mode); per new storage
a small record, and a short stack summary (``stacks=True``); per module call two hooks and, in
training, a gradient hook per output and per input. No GPU synchronisation, except that CUDA statistics are read at
phase changes. Host memory (``benchmarks/bench_tracker_memory.py``): about 400 bytes per storage
alive (490 with ``timeline=True``), the storage's Python object, which counting makes, included; with
``timeline=True`` also about 370 bytes per storage made and freed while tracking.

Not seen: memory no tensor storage owns (allocator caches, kernels' scratch buffers: compare the
CUDA samples), tensors made on threads the mode is not active on, tensors saved by other
``saved_tensors_hooks`` of the user (they count as temporaries), double backward through saved
intermediates (the pack hook keeps them detached, as checkpointing does).

What it does not change: what autograd computes or refuses. torch skips its check that a saved
tensor was not modified in place when saved-tensor hooks are set, so the tracker's hooks keep the
tensor's version and make that check themselves; and the counting mode bumps the version counters
that torch's foreach kernels leave unbumped under a dispatch mode (:mod:`llmmem.diagnostics.live`).
"""

from __future__ import annotations

from llmmem.diagnostics.tracker.core import MemoryTracker
from llmmem.diagnostics.tracker.failures import is_out_of_memory, step_text
from llmmem.diagnostics.tracker.records import CATEGORIES, PHASES
from llmmem.diagnostics.tracker.records import ancestors as _ancestors  # noqa: F401  (tests import it from here)

__all__ = ["MemoryTracker", "CATEGORIES", "PHASES", "is_out_of_memory", "step_text"]
