"""Activation checkpointing and the recompute planner.

Layers, bottom up: ``errors`` and ``observers`` (what every mode shares); ``replay`` (RNG and
autocast state a recompute replays) and ``offload`` (region inputs in host memory); ``core``
(:func:`checkpoint`, torch's non-reentrant semantics); the per-block modes ``selective`` and
``remat``, and ``modes`` (a call run in one mode); measuring blocks: ``calls`` (how a block is
called), ``work`` (work units), ``meters`` (bytes), ``timing``, ``costs`` (one block in each mode),
``blocks`` (checks on a block list), ``samples`` (a sample and its step), ``recording`` (a model's
step with its blocks recorded) and ``profile`` (the entry points and :class:`ChainProfile`);
``plan`` (the C planner), ``inplace`` (a plan run on blocks the model calls itself), ``auto``
(:func:`auto_checkpoint`); ``sequential`` (:func:`checkpoint_sequential`, which can hand its
segments to the planner).
"""

from llmmem.checkpointing.auto import AutoCheckpointed, AutoCheckpointPlan, auto_checkpoint, find_blocks
from llmmem.checkpointing.calls import BlockCall
from llmmem.checkpointing.core import checkpoint, feature_status, noop_context_fn
from llmmem.checkpointing.errors import CheckpointError
from llmmem.checkpointing.meters import ActivationMeter, measure_saved_bytes
from llmmem.checkpointing.plan import CheckpointPlan, parse_budget, plan_checkpoints
from llmmem.checkpointing.profile import ChainProfile, profile_blocks
from llmmem.checkpointing.remat import recompute_cheap
from llmmem.checkpointing.replay import register_rng_tracker
from llmmem.checkpointing.selective import selective_context_fn
from llmmem.checkpointing.sequential import checkpoint_sequential
from llmmem.checkpointing.work import WorkCounter

__all__ = [
    "checkpoint",
    "checkpoint_sequential",
    "CheckpointError",
    "noop_context_fn",
    "feature_status",
    "selective_context_fn",
    "recompute_cheap",
    "profile_blocks",
    "measure_saved_bytes",
    "ChainProfile",
    "plan_checkpoints",
    "parse_budget",
    "CheckpointPlan",
    "auto_checkpoint",
    "AutoCheckpointed",
    "AutoCheckpointPlan",
    "find_blocks",
    "ActivationMeter",
    "WorkCounter",
    "BlockCall",
    "register_rng_tracker",
]
