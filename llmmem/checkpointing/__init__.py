"""Activation checkpointing and the recompute planner.

Layers, bottom up: ``errors`` and ``observers`` (what every mode shares); ``replay`` (RNG and
autocast state a recompute replays) and ``offload`` (region inputs in host memory); ``core``
(:func:`checkpoint`, torch's non-reentrant semantics); the per-block modes ``selective`` and
``remat``; ``profile`` (measuring blocks and a model's step), ``plan`` (the C planner), ``inplace``
(a plan run on blocks the model calls itself), ``auto`` (:func:`auto_checkpoint`);
``sequential`` (:func:`checkpoint_sequential`, which can hand its segments to the planner).
"""

from llmmem.checkpointing.auto import AutoCheckpointed, AutoCheckpointPlan, auto_checkpoint, find_blocks
from llmmem.checkpointing.core import checkpoint, feature_status, noop_context_fn
from llmmem.checkpointing.errors import CheckpointError
from llmmem.checkpointing.plan import CheckpointPlan, parse_budget, plan_checkpoints
from llmmem.checkpointing.profile import (
    ActivationMeter,
    BlockCall,
    ChainProfile,
    WorkCounter,
    measure_saved_bytes,
    profile_blocks,
)
from llmmem.checkpointing.remat import recompute_cheap
from llmmem.checkpointing.replay import register_rng_tracker
from llmmem.checkpointing.selective import selective_context_fn
from llmmem.checkpointing.sequential import checkpoint_sequential

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
