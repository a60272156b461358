"""FSDP2's gathered parameters, seen by the live-bytes counters.

FSDP2 frees a layer's gathered (unsharded) parameters after its forward or backward by resizing
their storages to zero bytes, and allocates them again by resizing them back, outside any operator
(``storage.resize_``), so a dispatch mode never sees either: a counter would hold every layer's
gathered parameters from their first gathering on (on a tiny ZeRO-3 Llama, 642 KiB counted as
live after a step against none). While FSDP2 is loaded, its two storage functions (private to
torch, ``torch.distributed.fsdp._fully_shard._fsdp_param.alloc_storage`` / ``free_storage``) are
wrapped to hand the tensor to a callback after they ran; where torch has no such functions the
wrapping is skipped and the counters are as before.
"""

from __future__ import annotations

import sys
from typing import Callable

__all__ = ["install"]

_MODULES = (
    "torch.distributed.fsdp._fully_shard._fsdp_param",
    "torch.distributed.fsdp._fully_shard._fsdp_param_group",  # imported the names from the one above
)
_NAMES = ("alloc_storage", "free_storage")


def install(on_resize: Callable[[object], None]) -> None:
    """Wrap FSDP2's storage functions, once, if FSDP2 is loaded: ``on_resize(tensor)`` runs after
    each resize."""
    for module_name in _MODULES:
        module = sys.modules.get(module_name)
        if module is None:
            continue
        for name in _NAMES:
            fn = getattr(module, name, None)
            if fn is None or getattr(fn, "_llmmem_resize_hook", False):
                continue
            setattr(module, name, _wrapped(fn, on_resize))


def _wrapped(fn, on_resize):
    def resize_and_tell(tensor, *args, **kwargs):
        out = fn(tensor, *args, **kwargs)
        on_resize(tensor)
        return out

    resize_and_tell._llmmem_resize_hook = True
    resize_and_tell.__wrapped__ = fn
    return resize_and_tell
