"""What one block costs in each mode: bytes kept for backward, transient peaks, work and seconds.

Per mode (and ``"nostore"``, the block checkpointed alone): one forward and backward under the
meters (:class:`~llmmem.checkpointing.meters.ActivationMeter` and
:class:`~llmmem.checkpointing.meters.measure_saved_bytes`, counting work into a
:class:`~llmmem.checkpointing.work.WorkCounter`), on CUDA the allocator's statistics too (whichever
is larger), and when asked, timed steps. On the CPU the Python a mode adds beyond its work is timed
apart: a checkpoint's bookkeeping on a null block (:mod:`llmmem.checkpointing.bookkeeping`), the
recompute-cheap hooks while the block is timed. :func:`profile_one` gives one block's
:class:`BlockCosts`; :func:`block_signature` is what they depend on, so that blocks with one
signature are measured once.

Not here: the chain's profile made from them (:mod:`llmmem.checkpointing.profile`), the meters
themselves (:mod:`llmmem.checkpointing.meters`).
"""

from __future__ import annotations

import contextlib
import statistics
import time
from dataclasses import dataclass

import torch
import torch.nn as nn

from llmmem.checkpointing import remat
from llmmem.checkpointing.bookkeeping import checkpoint_bookkeeping_seconds
from llmmem.checkpointing.calls import BlockCall, hidden_of
from llmmem.checkpointing.meters import ActivationMeter, measure_saved_bytes, storage_address, tensor_bytes
from llmmem.checkpointing.modes import run_call
from llmmem.checkpointing.timing import sync
from llmmem.checkpointing.work import WorkCounter
from llmmem.diagnostics.live import device_key

__all__ = ["BlockCosts", "profile_one", "block_signature", "PYTHON_OP_WORK"]


# Modes that run a Python dispatch mode pay this per operator too (~20 us): dear on small models,
# nothing next to a large model's matmuls.
_PYTHON_PER_OP = {"selective"}
PYTHON_OP_WORK = {"cpu": 1e6, "cuda": 2e9}


def _module_tensors(block) -> list:
    if isinstance(block, nn.Module):
        return list(block.parameters()) + list(block.buffers())
    return []


def _grad_tensor(out) -> torch.Tensor:
    t = hidden_of(out)
    if not t.requires_grad:
        raise ValueError(
            "profile: a block returned no tensor that requires grad: nothing in it is differentiated (its "
            "parameters are frozen and its input needs no gradient, or it detaches its output), so checkpointing "
            "it saves nothing"
        )
    return t


@dataclass
class BlockCosts:
    work: dict  # the planner's costs in work units (_planner_costs)
    seconds: dict | None  # the same from timed steps (None: not timed)
    saved: list  # [K] bytes
    ftmp: list  # [K] the forward keeping a tape in each mode
    nostore_ftmp: int  # the forward inside a checkpointed region
    btmp: list  # [K]
    kept_out: list  # [K] bytes of the output kept by the tape
    input_only_btmp: int
    # seconds a mode adds beyond its work: {"checkpoint": s, "recompute-cheap": (pack, unpack, operators
    # inside the unpacks)}; {}: not timed, or not on the CPU
    bookkeeping: dict


def _planner_costs(fwd: dict, bwd: dict, modes) -> dict:
    """The planner's time costs of a block from each mode's forward and backward (and "nostore",
    the block checkpointed alone), in any unit."""
    store = modes[0]
    # The planner charges fwd_nostore_time twice per region (its forward and its recompute, which
    # costs more: a graph again, the slots filled); their mean makes a one-level region exact.
    recompute = max(bwd["nostore"] - bwd[store], fwd["nostore"])
    return {
        "fwd": [fwd[m] for m in modes],
        # other modes run store-all's operators plus extra work: never cheaper (a lower figure is noise)
        "bwd": [max(bwd[m], fwd[store] + bwd[store] - fwd[m]) for m in modes],
        "nostore": 0.5 * (fwd["nostore"] + recompute),
        "input_only": (fwd["nostore"], fwd[store] + bwd[store] - fwd["nostore"] + recompute),
    }


def _memory_and_work(run, block, call: BlockCall, mode: str, device: torch.device, exclude: list) -> dict:
    """One forward + backward of the block in ``mode`` under the meters: bytes kept, transients,
    work units. The block input is a fresh leaf made outside the meters (the planner counts it)."""
    params = _module_tensors(block)
    x = call.fresh_input()
    args, kwargs = call.with_hidden(x)
    key = device_key(device)
    work = WorkCounter(device.type)
    with ActivationMeter(params, device=key, work=work) as meter:
        with measure_saved_bytes(exclude=params + exclude) as saved:
            out = run_call(run, args, kwargs, mode, block)
        y = _grad_tensor(out)
        fwd_end, fwd_peak = meter.current, meter.window_peak
        out_bytes = meter.counted_bytes(y)
        saved.storages.pop(storage_address(x), None)
        kept_out = saved.storages.pop(storage_address(y), 0)
        grad = torch.ones_like(y)
        meter.exclude(grad)  # the incoming gradient: the planner counts it
        meter.reset_window()
        bwd_start = meter.current
        torch.autograd.backward(y, grad)
        grad_in = tensor_bytes(x.grad) if x.grad is not None else 0
        bwd_peak = meter.window_peak
    del out, y, grad
    if isinstance(block, nn.Module):
        block.zero_grad(set_to_none=True)
    python_op = PYTHON_OP_WORK.get(device.type, PYTHON_OP_WORK["cuda"]) if mode in _PYTHON_PER_OP else 0.0
    backward_work = work.backward + work.backward_ops * python_op
    forward_work = work.forward + work.forward_ops * python_op
    return {
        # held after the forward beyond the output: everything the forward made that is still alive
        "saved": max(0, fwd_end - out_bytes),
        "kept_out": kept_out,
        "ftmp": max(0, fwd_peak - fwd_end),
        "btmp": max(0, bwd_peak - bwd_start - grad_in),
        "fwd": forward_work,
        "bwd": backward_work,
        "packed": saved.packed,
    }


def _allocator_transients(run, block, call: BlockCall, mode: str, device: torch.device) -> tuple[int, int]:
    """CUDA: (forward, backward) transient peaks from the allocator's statistics, which also see
    memory no tensor owns (library workspaces) and the allocator's rounding. Parameter gradients
    exist before, so the backward's peak holds only what it adds."""
    params = [p for p in _module_tensors(block) if p.requires_grad]
    for p in params:
        p.grad = torch.zeros_like(p)
    x = call.fresh_input()
    args, kwargs = call.with_hidden(x)
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    out = run_call(run, args, kwargs, mode, block)
    y = _grad_tensor(out)
    grad = torch.ones_like(y)
    torch.cuda.synchronize(device)
    end = torch.cuda.memory_allocated(device)
    ftmp = torch.cuda.max_memory_allocated(device) - end
    torch.cuda.reset_peak_memory_stats(device)
    torch.autograd.backward(y, grad)
    torch.cuda.synchronize(device)
    btmp = torch.cuda.max_memory_allocated(device) - end - tensor_bytes(x)
    del out, y, grad, base
    for p in params:
        p.grad = None
    return max(0, ftmp), max(0, btmp)


def _timed_steps(run, block, call: BlockCall, modes, repeats: int, warmup: int, device: torch.device) -> dict:
    """Seconds of a step of the block in each mode (and "nostore"): ``{mode: (forward, backward)}``,
    and ``"hooks"``: the recompute-cheap mode's (pack, unpack, rebuilding operators) seconds
    (:func:`remat.hook_clock`).
    Round-robin over the modes; each mode's time is the store-all time (median) times the median of
    its ratio to store-all within a round: a shared machine's load drifts between rounds and slows a
    whole round alike, so ratios taken within a round are steady where times taken apart are not."""
    x = call.fresh_input()
    args, kwargs = call.with_hidden(x)

    def step(mode):
        with remat.hook_clock() if mode == "recompute-cheap" else contextlib.nullcontext((0.0, 0.0, 0.0)) as hooks:
            sync(device)
            t0 = time.perf_counter()
            y = _grad_tensor(run_call(run, args, kwargs, mode, block))
            sync(device)
            t1 = time.perf_counter()
            torch.autograd.backward(y, torch.ones_like(y))
            sync(device)
            t2 = time.perf_counter()
        return t1 - t0, t2 - t1, tuple(hooks)

    store, timed = modes[0], (*modes, "nostore")
    rounds: list = []
    for r in range(warmup + repeats):
        sample = {mode: step(mode) for mode in timed}
        if r >= warmup:
            rounds.append(sample)
    if isinstance(block, nn.Module):
        block.zero_grad(set_to_none=True)
    out = {}
    for m in timed:
        times = []
        for part in (0, 1):
            base = statistics.median(s[store][part] for s in rounds)
            ratio = statistics.median(s[m][part] / s[store][part] if s[store][part] > 0 else 1.0 for s in rounds)
            times.append(base * ratio)
        out[m] = tuple(times)
    if "recompute-cheap" in modes:
        out["hooks"] = tuple(statistics.median(s["recompute-cheap"][2][part] for s in rounds) for part in (0, 1, 2))
    return out


def profile_one(run, block, call: BlockCall, modes, repeats: int, warmup: int, device: torch.device) -> BlockCosts:
    exclude = call.other_tensors()
    per_mode = {m: _memory_and_work(run, block, call, m, device, exclude) for m in (*modes, "nostore")}
    if device.type == "cuda":
        for m, costs in per_mode.items():
            ftmp, btmp = _allocator_transients(run, block, call, m, device)
            costs["ftmp"], costs["btmp"] = max(costs["ftmp"], ftmp), max(costs["btmp"], btmp)
    work = _planner_costs(
        {m: c["fwd"] for m, c in per_mode.items()}, {m: c["bwd"] for m, c in per_mode.items()}, modes
    )
    seconds, bookkeeping = None, {}
    if repeats > 0:
        timed = _timed_steps(run, block, call, modes, repeats, warmup, device)
        hooks = timed.pop("hooks", None)
        seconds = _planner_costs({m: t[0] for m, t in timed.items()}, {m: t[1] for m, t in timed.items()}, modes)
        if device.type == "cpu":
            # host-side Python: on an accelerator it overlaps the device's work
            # rounds as the block's (a short null-block round each; at least 5 for a median)
            rounds = max(5, 3 * repeats)
            bookkeeping["checkpoint"] = checkpoint_bookkeeping_seconds(call, per_mode[modes[0]]["packed"], rounds)
            if hooks is not None:
                bookkeeping["recompute-cheap"] = hooks
    return BlockCosts(
        work=work,
        seconds=seconds,
        saved=[per_mode[m]["saved"] for m in modes],
        # per mode and apart: a no-store forward keeps nothing, so its intermediates peak higher above
        # its end than a tape's forward does above its tape; the planner counts each where it runs
        ftmp=[per_mode[m]["ftmp"] for m in modes],
        nostore_ftmp=per_mode["nostore"]["ftmp"],
        # other modes run store-all's backward plus their recompute: a lower figure is not to be
        # trusted (recompute-cheap measured 128 B below store-all alone, 124 B above it in a model)
        btmp=[max(per_mode[m]["btmp"], per_mode[modes[0]]["btmp"]) for m in modes],
        kept_out=[per_mode[m]["kept_out"] for m in modes],
        input_only_btmp=per_mode["nostore"]["btmp"],
        bookkeeping=bookkeeping,
    )


def block_signature(block, call: BlockCall) -> tuple:
    params = tuple((tuple(p.shape), p.dtype, p.device, p.requires_grad) for p in _module_tensors(block))
    training = block.training if isinstance(block, nn.Module) else None
    return (type(block), repr(block), params, training, call.signature())
