"""Random streams for dropout in a tensor-parallel model (Megatron's model-parallel RNG tracker).

Two kinds of activation get dropout in a tensor-parallel transformer, and they need different
random streams:

* **replicated** activations (the output of a row-parallel layer after its all-reduce, the
  embedding output, anything outside the split region): every TP rank holds the same tensor, so
  every TP rank must draw the *same* mask, or the replicas drift apart. These use the default
  generators, seeded with the same seed on every rank.
* **split** activations (attention probabilities with the heads divided among ranks, the hidden
  layer of a column-parallel MLP): each TP rank holds a different slice, and a slice must get a
  mask independent of the other slices, so each TP rank draws from *its own* stream. That stream
  is the same on the data-parallel replicas of that TP rank (they hold the same slice of other
  data), so it is seeded from ``seed`` and the TP rank only.

:func:`model_parallel_manual_seed` seeds both on every rank (default generators: ``seed``; the
tracker's ``"model-parallel-rng"`` stream: ``seed + 2718 + tp_rank``, Megatron's offset), and
``with get_rng_tracker().fork(): ...`` runs a block with the default CPU generator, and the
current CUDA device's generator when CUDA is initialised, swapped for the tracker's stream; on
exit the stream's advanced state is kept in the tracker and the default generators are put back
exactly as they were, so code outside the block sees no difference.

Activation checkpointing: :func:`llmmem.checkpoint` stashes the tracker's states with the default
generators when a region runs forward and replays them when it recomputes (the tracker registers
itself with the checkpointing module), so a recomputed split-region dropout draws the forward's
mask. ``torch.utils.checkpoint`` does not know about the tracker: a region that forks it must be
checkpointed with ``llmmem.checkpoint``, as Megatron has its own checkpoint for the same reason.

Not supported: forking inside CUDA-graph capture (reading a CUDA generator's state is not allowed
there).
"""

from __future__ import annotations

import contextlib
import threading

import torch

__all__ = [
    "MODEL_PARALLEL_RNG",
    "RNGStatesTracker",
    "get_rng_tracker",
    "model_parallel_manual_seed",
    "get_cuda_rng_tracker",
    "model_parallel_cuda_manual_seed",
]

MODEL_PARALLEL_RNG = "model-parallel-rng"
# Megatron's offset between the data-parallel seed and the model-parallel one, kept so that a
# model seeded the same way draws the same streams under both.
_MODEL_PARALLEL_SEED_OFFSET = 2718


def _fresh_cpu_state(seed: int) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed)
    return g.get_state()


def _fresh_cuda_state(seed: int, device: int) -> torch.Tensor:
    g = torch.Generator(device=f"cuda:{device}")
    g.manual_seed(seed)
    return g.get_state()


class RNGStatesTracker:
    """Named random streams that a block of code can borrow the default generators from.

    Each stream has a seed and, once used, a saved CPU generator state plus one CUDA generator
    state per CUDA device it was forked on (created from the seed on first use there). States are
    CPU byte tensors, as ``torch.get_rng_state`` returns them.
    """

    def __init__(self) -> None:
        self._seeds: dict[str, int] = {}
        self._states: dict[str, dict] = {}  # name -> {"cpu": state, <cuda index>: state}
        self._active: set[str] = set()
        self._lock = threading.Lock()
        from llmmem.checkpointing.replay import register_rng_tracker

        register_rng_tracker(self)

    def reset(self) -> None:
        """Forget every stream."""
        with self._lock:
            if self._active:
                raise RuntimeError(f"RNGStatesTracker.reset: streams {sorted(self._active)} are forked right now")
            self._seeds.clear()
            self._states.clear()

    def is_initialized(self, name: str = MODEL_PARALLEL_RNG) -> bool:
        return name in self._seeds

    def add(self, name: str, seed: int) -> None:
        """Add stream ``name`` seeded with ``seed``; a name or a seed already in use is an error
        (two streams with one seed would draw the same masks, which is what the tracker avoids)."""
        if not isinstance(name, str) or not name:
            raise TypeError(f"RNGStatesTracker.add: name must be a non-empty str, got {name!r}")
        if not isinstance(seed, int) or isinstance(seed, bool):
            raise TypeError(f"RNGStatesTracker.add: seed must be an int, got {type(seed).__name__}")
        with self._lock:
            if name in self._seeds:
                raise ValueError(f"RNGStatesTracker.add: stream {name!r} already exists")
            for other, s in self._seeds.items():
                if s == seed:
                    raise ValueError(f"RNGStatesTracker.add: seed {seed} is already used by stream {other!r}")
            self._seeds[name] = seed
            self._states[name] = {"cpu": _fresh_cpu_state(seed)}

    def get_states(self) -> dict:
        """A copy of every stream's state: ``{name: (seed, {"cpu" | cuda index: state})}``."""
        with self._lock:
            return {n: (self._seeds[n], {k: v.clone() for k, v in self._states[n].items()}) for n in self._seeds}

    def set_states(self, states: dict) -> None:
        """Replace every stream by ``states`` (what :meth:`get_states` returned)."""
        if not isinstance(states, dict):
            raise TypeError(
                f"RNGStatesTracker.set_states: expected a dict from get_states(), got {type(states).__name__}"
            )
        with self._lock:
            if self._active:
                raise RuntimeError(f"RNGStatesTracker.set_states: streams {sorted(self._active)} are forked right now")
            self._seeds = {n: seed for n, (seed, _) in states.items()}
            self._states = {n: {k: v.clone() for k, v in st.items()} for n, (_, st) in states.items()}

    @contextlib.contextmanager
    def fork(self, name: str = MODEL_PARALLEL_RNG):
        """Run the block with the default generators drawing from stream ``name``.

        The CPU generator is always swapped; the current CUDA device's generator is swapped when
        CUDA is already initialised (this never initialises CUDA). Cost: a copy of each generator
        state in and out (about 5 KB for the CPU one, 16 bytes for a CUDA one); no GPU sync.
        """
        with self._lock:
            if name not in self._seeds:
                raise RuntimeError(
                    f"RNGStatesTracker.fork: no stream {name!r}; call "
                    "llmmem.parallel.model_parallel_manual_seed(seed) on every rank first "
                    "(or tracker.add(name, seed))"
                )
            if name in self._active:
                # the inner block's exit would save a state the outer one then overwrites
                raise RuntimeError(f"RNGStatesTracker.fork: stream {name!r} is already forked (nested fork)")
            self._active.add(name)
            states = self._states[name]
        cuda_dev = torch.cuda.current_device() if torch.cuda.is_initialized() else None
        saved_cpu = torch.get_rng_state()
        saved_cuda = None
        try:
            torch.set_rng_state(states["cpu"])
            if cuda_dev is not None:
                saved_cuda = torch.cuda.get_rng_state(cuda_dev)
                if cuda_dev not in states:
                    states[cuda_dev] = _fresh_cuda_state(self._seeds[name], cuda_dev)
                torch.cuda.set_rng_state(states[cuda_dev], cuda_dev)
            yield
        finally:
            states["cpu"] = torch.get_rng_state()
            torch.set_rng_state(saved_cpu)
            if saved_cuda is not None:
                states[cuda_dev] = torch.cuda.get_rng_state(cuda_dev)
                torch.cuda.set_rng_state(saved_cuda, cuda_dev)
            with self._lock:
                self._active.discard(name)


_TRACKER = RNGStatesTracker()


def get_rng_tracker() -> RNGStatesTracker:
    """The process-wide tracker that llmmem's tensor-parallel models fork for split-region dropout."""
    return _TRACKER


def model_parallel_manual_seed(seed: int, process_group=None) -> None:
    """Seed the random streams of a tensor-parallel model, on every rank, with the same ``seed``.

    The default generators (CPU and every CUDA device, as ``torch.manual_seed``) get ``seed`` on
    every rank: replicated-region dropout and anything else drawn outside a fork is the same on
    all ranks. The tracker's ``"model-parallel-rng"`` stream gets ``seed + 2718 + tp_rank``, where
    ``tp_rank`` is this rank's index in the tensor-parallel group (``process_group``, else the one
    of :func:`llmmem.parallel.init`, else the world): different on the ranks of one TP group, the
    same on its data-parallel replicas. Previous streams of the tracker are dropped.
    """
    if not isinstance(seed, int) or isinstance(seed, bool):
        raise TypeError(f"model_parallel_manual_seed: seed must be an int, got {type(seed).__name__}")
    import torch.distributed as dist

    from llmmem.parallel.groups import get_tensor_parallel_group

    group = get_tensor_parallel_group(process_group)
    tp_rank = dist.get_rank(group)
    torch.manual_seed(seed)
    _TRACKER.reset()
    _TRACKER.add(MODEL_PARALLEL_RNG, seed + _MODEL_PARALLEL_SEED_OFFSET + tp_rank)


# Megatron's names, for code ported from it (the tracker here covers the CPU generator as well).
get_cuda_rng_tracker = get_rng_tracker
model_parallel_cuda_manual_seed = model_parallel_manual_seed
