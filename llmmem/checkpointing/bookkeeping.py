"""What checkpointing a block costs beyond its recompute: the region's bookkeeping, in seconds.

A checkpointed block pays, besides running its forward again, Python work that no operator
count sees: its call is recorded (arguments flattened, random and autocast state kept), and each
tensor its forward saves for backward passes through a pack hook, a placeholder, the recompute's
store hook and an unpack. On a 2-core CPU that is about 0.2 ms per call plus 5-15 us per saved
tensor (a Hugging Face Llama layer saves 39): a third of a small layer's forward, nothing beside
a large one (benchmarks/README.md).

It is measured on a *null block*: a function called with the block's own arguments (so flattening
them costs what it costs for the block) that saves as many tensors as the block does, through
operators on a one-element tensor whose own time is taken out. Sizes do not enter, so the figure is
the same for a block of any width, and cheap to time steadily.
"""

from __future__ import annotations

import statistics
import time

import torch

from llmmem.checkpointing.core import checkpoint

__all__ = ["checkpoint_bookkeeping_seconds", "BOOKKEEPING_ROUNDS", "MAX_NULL_SAVES"]

# rounds of (plain step, plain forward, checkpointed step) on the null block; one round of a
# 40-tensor block takes about 3 ms on a 2-core CPU
BOOKKEEPING_ROUNDS = 15
# the null block saves at most this many tensors (a block saving thousands would take seconds)
MAX_NULL_SAVES = 128


def _null_block(saved: int, hidden):
    def null(*args, **kwargs):
        y = args[hidden] if isinstance(hidden, int) else kwargs[hidden]
        for _ in range(saved):
            y = torch.sin(y)  # saves its input: one tensor per operator
        return y

    return null


def checkpoint_bookkeeping_seconds(call, saved: int, rounds: int = BOOKKEEPING_ROUNDS) -> float:
    """Seconds that checkpointing a block called as ``call`` (a ``BlockCall``) and saving ``saved``
    tensors adds to a step beyond the recompute of its operators: the median over ``rounds`` rounds
    of the null block's checkpointed step less its plain step and its plain forward. Past
    :data:`MAX_NULL_SAVES` saved tensors, the cost is drawn as a line through the null block with one
    and with that many (each saved tensor costs the same), never falling.

    CPU only: on an accelerator this host-side work overlaps the device's and is not measured (0.0).
    """
    device = call.hidden_tensor.device
    if device.type != "cpu" or rounds <= 0:
        return 0.0
    saved = max(0, int(saved))
    if saved <= MAX_NULL_SAVES:
        return _null_extra(call, saved, rounds)
    # through one saved tensor, not none: a null block saving nothing recomputes nothing
    one = _null_extra(call, 1, rounds)
    slope = max(0.0, _null_extra(call, MAX_NULL_SAVES, rounds) - one) / (MAX_NULL_SAVES - 1)
    return one + slope * (saved - 1)


def _null_extra(call, saved: int, rounds: int) -> float:
    leaf = torch.zeros((), dtype=torch.float32, requires_grad=True)
    args, kwargs = call.with_hidden(leaf)
    null = _null_block(saved, call.hidden)
    checkpointed = checkpoint(use_reentrant=False)(null)  # the block's own kwargs may share an option's name
    steps = (
        lambda: null(*args, **kwargs).backward(),
        lambda: null(*args, **kwargs),
        lambda: checkpointed(*args, **kwargs).backward(),
    )
    extra = []
    with torch.enable_grad():
        for r in range(rounds + 2):  # two rounds of warm-up
            times = []
            for step in steps:
                t0 = time.perf_counter()
                step()
                times.append(time.perf_counter() - t0)
            if r >= 2:
                extra.append(times[2] - times[0] - times[1])
    return max(0.0, statistics.median(extra))
