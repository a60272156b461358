"""Measuring one block of a real model for the estimator (``llmmem.estimate(model, measure=True)``):
what a layer keeps for backward, counted on the module itself instead of derived from its
architecture. Imports torch and the planner's profiling only when called."""

from __future__ import annotations

__all__ = ["measure_layer_bytes", "model_settings"]


class _Captured(Exception):
    """Stops the model's forward once the first block's call is recorded."""


def _run(model, sample) -> None:
    import torch

    if isinstance(sample, torch.Tensor):
        model(sample)
    elif isinstance(sample, (tuple, list)):
        model(*sample)
    elif isinstance(sample, dict):
        model(**sample)
    else:
        raise TypeError(
            f"measure: expected True or a batch (a tensor, a tuple or a dict of the model's inputs), "
            f"got {type(sample).__name__}"
        )


def measure_layer_bytes(model, sample) -> int:
    """Bytes the first block of ``model``'s repeated blocks keeps for backward, its input included,
    on the model's device and in its dtype: the block is called with the arguments the model gives
    it on ``sample`` (its forward stops there), and run once under an exact meter of live tensor
    bytes (:class:`llmmem.checkpointing.meters.ActivationMeter`). Memory: one block's activations."""
    import torch

    from llmmem.checkpointing.auto import find_blocks
    from llmmem.checkpointing.calls import BlockCall, find_hidden, without_cache
    from llmmem.checkpointing.profile import profile_calls

    _, blocks = find_blocks(model)
    captured = {}

    def hook(module, args, kwargs):
        where, _ = find_hidden(args, kwargs)
        if where is None:
            raise TypeError(f"measure: the first block ({type(module).__name__}) was called with no tensor")
        copy = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.detach().clone(), (args, kwargs))
        captured["call"] = BlockCall(*copy, where)
        raise _Captured

    handle = blocks[0].register_forward_pre_hook(hook, with_kwargs=True)
    try:
        with torch.no_grad():
            _run(model, sample)
    except _Captured:
        pass
    finally:
        handle.remove()
    if "call" not in captured:
        raise ValueError("measure: the model's forward on the sample did not call its first block")
    call = captured["call"]
    args, kwargs, _ = without_cache(call.args, call.kwargs)
    grads = [p.grad for p in blocks[0].parameters()]
    try:
        prof = profile_calls([blocks[0]], [BlockCall(args, kwargs, call.hidden)], modes=("store-all",), repeats=0)
    finally:
        for p, g in zip(blocks[0].parameters(), grads):
            p.grad = g
    return prof.input_bytes[0] + prof.saved_bytes[0][0]


def model_settings(model) -> tuple[str, str]:
    """``(precision, device_type)`` of the estimator that match the module's parameters."""
    p = next(model.parameters())
    precision = {"float32": "fp32", "bfloat16": "bf16", "float16": "bf16"}.get(
        str(p.dtype).replace("torch.", ""), "fp32"
    )
    return precision, "cuda" if p.device.type == "cuda" else "cpu"
