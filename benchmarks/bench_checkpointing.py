"""Activation checkpointing: llmmem.auto_checkpoint against torch's strategies, and planner solve times.

Part 1, the small GPT's blocks (forward + backward of the chain, dropout on): for budgets of 100%,
75%, 50%, 33% of the activation bytes held without checkpointing, and the planner's least
feasible budget, the activation bytes really held for backward (measured with saved_tensors_hooks,
each storage once, parameters excluded; on CUDA also torch.cuda.max_memory_allocated) and the step
time (median of repeats) of:
  none             no checkpointing
  torch/every      torch.utils.checkpoint (non-reentrant) around every block
  torch/uniform    torch checkpoint_sequential with the fewest segments whose held bytes fit
  llmmem/auto      llmmem.auto_checkpoint(blocks, x, budget) (the C planner's plan: per block store-all,
                   recompute-cheap (llmmem/remat.py) or selective, and nested regions; the note
                   counts the top-level blocks in each cheaper mode)
  llmmem/auto+off  llmmem.auto_checkpoint(..., offload=True) at its own least budget ("min+offload"
                   row), below torch's every-layer minimum: some region inputs kept in host memory
  llmmem/offload   (CUDA only) llmmem.checkpoint(offload=True) around every block
Overheads are ratios to "none" measured in the same run. For the offload plan the predicted
overhead (recompute + modelled transfers) is printed too: on the CPU the "device" is host memory,
so nothing is copied and the transfer cost (bytes / llmmem.checkpointing.plan.DEFAULT_HOST_BANDWIDTH) is
modelled, not measured; on CUDA the bandwidth is measured and the step time includes the copies.

Part 2, planner solve time for L = 32, 96, 256 blocks at 500 and 2000 slots (heterogeneous random
chains and identical blocks; heterogeneous L = 256 runs at 500 slots only, and not with --quick).

Part 3 (--hf llama,gpt2; also qwen2, mistral, phi, with dropout off): llmmem.auto_checkpoint(model,
budget, sample=batch) on Hugging Face Llama and GPT-2 built from small configs (random weights,
dropout on), sdpa and eager attention, budgets
50% and 25%: predicted and measured peak and held bytes (ActivationMeter: exact tensor bytes of the
step beyond parameters and their gradients; on CUDA also the allocator's peak), predicted recompute
overhead against the measured one (median over rounds of the planned model's step over an identical
unplanned copy's in the same round, garbage collector off), and the planning time in training steps.

python benchmarks/run.py --only checkpoint [--quick] [--device cuda]
python benchmarks/bench_checkpointing.py --hf llama,gpt2 --skip-chain --skip-solver [--device cuda]
python benchmarks/bench_checkpointing.py --hf qwen2,mistral,phi --batch 2 --skip-chain --skip-solver
python benchmarks/bench_checkpointing.py --device cuda --preset 1b --skip-solver   (the large-GPU check)
On CUDA the "alloc MiB" column is torch.cuda.max_memory_allocated during the step beyond the
parameters and their gradients, to compare with the plan's predicted peak.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import _harness
import torch
import torch.utils.checkpoint as tuc

import llmmem
from llmmem import _C
from llmmem.checkpointing import AutoCheckpointed, measure_saved_bytes
from llmmem.models.gpt import GPT, GPTConfig

MiB = 2**20


def _run_chain(kind, blocks, x, arg=None):
    if kind == "none":
        for b in blocks:
            x = b(x)
        return x
    if kind == "torch/every":
        for b in blocks:
            x = tuc.checkpoint(b, x, use_reentrant=False)
        return x
    if kind == "torch/uniform":
        return tuc.checkpoint_sequential(blocks, arg, x, use_reentrant=False)
    if kind == "llmmem/auto":
        return arg(x)
    if kind == "llmmem/offload":
        for b in blocks:
            x = llmmem.checkpoint(b, x, use_reentrant=False, offload=True)
        return x
    raise ValueError(kind)


def _measure(kind, blocks, x0, exclude, device, arg=None):
    """(held bytes after forward, peak allocated bytes or None)."""
    x = x0.clone().requires_grad_()
    if device.type == "cuda":
        # Parameter gradients exist before the step, so the peak below is activations + transients.
        for p in blocks.parameters():
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with measure_saved_bytes(exclude=exclude) as m:
        y = _run_chain(kind, blocks, x, arg)
    held = sum(v for (dev, _), v in m.storages.items() if dev.type == device.type)
    y.square().mean().backward()
    peak = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated() - base
    blocks.zero_grad(set_to_none=device.type != "cuda")
    return held, peak


def _interleaved_times(configs, blocks, x0, device, rounds):
    """Median step time of each config, measured in rounds (shuffled order within each): on a
    shared machine the load drifts over minutes, and interleaving makes every strategy see it."""
    import statistics
    import time

    def step(kind, arg):
        x = x0.clone().requires_grad_()
        _run_chain(kind, blocks, x, arg).square().mean().backward()
        blocks.zero_grad(set_to_none=True)

    samples = {key: [] for key in configs}
    for kind, arg in configs.values():  # warm-up
        step(kind, arg)
    order = list(configs.items())
    shuffler = random.Random(0)
    for _ in range(rounds):
        shuffler.shuffle(order)  # no strategy always runs right after the same other one
        for key, (kind, arg) in order:
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(kind, arg)
            if device.type == "cuda":
                torch.cuda.synchronize()
            samples[key].append(time.perf_counter() - t0)
    return {key: statistics.median(v) for key, v in samples.items()}


def _torch_uniform_regions(L, segments):
    """torch's checkpoint_sequential split: L // segments per segment, the last one unchecked."""
    size = L // segments
    return [(k * size, (k + 1) * size) for k in range(segments - 1)]


def bench_chain(args, device) -> dict:
    layers = args.layers or (12 if args.quick else 16)
    heads = 16 if args.hidden >= 1024 else 4
    cfg = GPTConfig(layers=layers, hidden=args.hidden, heads=heads, seq_len=args.seq, vocab_size=256, dropout=0.1)
    torch.manual_seed(0)
    model = GPT(cfg).to(device)
    blocks = model.blocks
    idx = torch.randint(0, cfg.vocab_size, (args.batch, cfg.seq_len), device=device)
    x0 = model.embed(idx).detach()
    exclude = list(model.parameters()) + list(model.buffers())
    # Step times on a shared 2-core machine vary by tens of percent between rounds; 5 rounds could
    # not order plans 8% apart (measured), 30 could. --quick trims the chains, not the rounds.
    rounds = 30

    prof = llmmem.profile_blocks(blocks, x0, repeats=rounds)
    print(
        "profile of block 0 (ms): "
        + ", ".join(
            f"{m} fwd {1e3 * prof.time_unit * prof.fwd_time[0][k]:.2f} bwd "
            f"{1e3 * prof.time_unit * prof.bwd_time[0][k]:.2f} kept {prof.saved_bytes[0][k] / MiB:.2f} MiB"
            for k, m in enumerate(prof.modes)
        )
        + f"; in a region: forward/recompute {1e3 * prof.time_unit * prof.fwd_nostore_time[0]:.2f}"
    )
    chain = prof.to_chain()
    no_ckpt = llmmem.plan_checkpoints(None, budget=1.0, profile=prof)
    reference = no_ckpt.no_checkpoint_peak_bytes

    def simulated_peak(regions):
        return _C.plan_simulate(chain, [0] * layers, regions)["peak_bytes"]

    offload_least = llmmem.plan_checkpoints(None, budget=1.0, profile=prof, offload=True).min_budget_bytes
    offload_plan = llmmem.plan_checkpoints(None, budget=offload_least, profile=prof, offload=True)
    budgets = [
        ("100%", reference),
        ("75%", int(0.75 * reference)),
        ("50%", reference // 2),
        ("33%", reference // 3),
        ("minimum", no_ckpt.min_budget_bytes),
        ("min+offload", offload_least),
    ]
    every_regions = [(i, i + 1) for i in range(layers)]
    uniform_peaks = {seg: simulated_peak(_torch_uniform_regions(layers, seg)) for seg in range(2, layers + 1)}
    uniform_peaks[1] = simulated_peak([])
    configs = {"none": ("none", None), "torch/every": ("torch/every", None)}
    chosen = {}
    for name, budget in budgets:
        fitting = [seg for seg in sorted(uniform_peaks) if uniform_peaks[seg] <= budget and seg > 1]
        if fitting:
            configs[f"torch/uniform/{fitting[0]}"] = ("torch/uniform", fitting[0])
        try:
            plan = llmmem.plan_checkpoints(None, budget=budget, profile=prof)
        except llmmem.InfeasibleError as exc:
            chosen[name] = (fitting[0] if fitting else None, None, str(exc))
            continue
        configs[f"llmmem/{name}"] = ("llmmem/auto", AutoCheckpointed(list(blocks), plan))
        chosen[name] = (fitting[0] if fitting else None, plan, "")
    configs["llmmem/auto+off"] = ("llmmem/auto", AutoCheckpointed(list(blocks), offload_plan))
    if device.type == "cuda":
        configs["llmmem/offload"] = ("llmmem/offload", None)
    measured = {key: _measure(kind, blocks, x0, exclude, device, arg) for key, (kind, arg) in configs.items()}
    times = _interleaved_times(configs, blocks, x0, device, rounds)
    base_time = times["none"]

    rows, records, targets = [], [], []

    def add(budget_name, budget, label, key, peak_pred, note=""):
        held, peak = measured[key]
        seconds = times[key]
        fits = peak_pred <= budget
        overhead = seconds / base_time - 1.0
        rows.append(
            [
                budget_name,
                f"{budget / MiB:.2f}",
                label,
                "yes" if fits else "no",
                f"{peak_pred / MiB:.2f}",
                f"{held / MiB:.2f}",
                f"{peak / MiB:.2f}" if peak is not None else "-",
                f"{1e3 * seconds:.1f}",
                f"{100 * overhead:+.1f}%",
                note,
            ]
        )
        records.append(
            {
                "budget": budget_name,
                "budget_bytes": budget,
                "strategy": label,
                "fits": fits,
                "predicted_peak_bytes": peak_pred,
                "held_bytes": held,
                "peak_allocated_bytes": peak,
                "step_s": seconds,
                "overhead": overhead,
                "note": note,
            }
        )
        return fits, overhead, seconds

    every_peak = simulated_peak(every_regions)
    for name, budget in budgets:
        best_torch = None
        seg, plan, err = chosen[name]
        if uniform_peaks[1] <= budget:
            add(name, budget, "none", "none", uniform_peaks[1])
            best_torch = base_time
        if seg is not None:
            _, _, t = add(name, budget, "torch/uniform", f"torch/uniform/{seg}", uniform_peaks[seg], f"{seg} segments")
            best_torch = t if best_torch is None else min(best_torch, t)
        every_fits, every_over, t = add(name, budget, "torch/every", "torch/every", every_peak)
        if every_fits:
            best_torch = t if best_torch is None else min(best_torch, t)
        if plan is None:
            rows.append([name, f"{budget / MiB:.2f}", "llmmem/auto", "no", "-", "-", "-", "-", "-", err[:70]])
            continue
        n_sel = sum(1 for m in plan.modes if m == "selective")
        n_cheap = sum(1 for i, m in enumerate(plan.modes) if m == "recompute-cheap" and plan.depth(i) == 0)
        base = plan.predicted_time - plan.predicted_overhead_time
        note = (
            f"held predicted {plan.predicted_held_bytes / MiB:.2f}, overhead predicted "
            f"{100 * plan.predicted_overhead_time / base:+.1f}%; {len(plan.regions)} regions, "
            f"{n_sel} selective, {n_cheap} recompute-cheap"
        )
        _, over, t = add(name, budget, "llmmem/auto", f"llmmem/{name}", plan.predicted_peak_bytes, note)
        held, alloc = measured[f"llmmem/{name}"]
        if alloc is not None:
            print(
                f"  {name}: peak allocated {alloc / MiB:.1f} MiB vs predicted peak {plan.predicted_peak_bytes / MiB:.1f} MiB "
                f"({100 * (alloc / plan.predicted_peak_bytes - 1):+.1f}%)"
            )
        targets.append(
            {
                "budget": name,
                "llmmem_overhead": over,
                "torch_every_overhead": every_over,
                "best_torch_fitting_s": best_torch,
                "llmmem_s": t,
                "llmmem_not_slower": None if best_torch is None else t <= 1.03 * best_torch,
                "held_within_10pct": abs(held - plan.predicted_held_bytes) <= 0.1 * plan.predicted_held_bytes,
            }
        )
    plan = offload_plan
    base_pred = plan.predicted_time - plan.predicted_overhead_time
    pred_over = plan.predicted_overhead_time / base_pred
    source = "measured" if plan.host_bandwidth_measured else "modelled, not measured on the CPU"
    note = (
        f"{len(plan.offloaded)} inputs on host ({plan.predicted_host_bytes / MiB:.2f} MiB); predicted overhead "
        f"{100 * pred_over:+.1f}% incl. transfers {1e3 * plan.predicted_transfer_time:.2f} ms at "
        f"{plan.host_bandwidth / 1e9:.0f} GB/s ({source})"
    )
    fits, over, _ = add(
        "min+offload", offload_least, "llmmem/auto+off", "llmmem/auto+off", plan.predicted_peak_bytes, note
    )
    held, alloc = measured["llmmem/auto+off"]
    offload_summary = {
        "budget_bytes": offload_least,
        "every_layer_peak_bytes": every_peak,
        "planner_min_without_offload_bytes": no_ckpt.min_budget_bytes,
        "predicted_peak_bytes": plan.predicted_peak_bytes,
        "predicted_held_bytes": plan.predicted_held_bytes,
        "predicted_host_bytes": plan.predicted_host_bytes,
        "predicted_overhead": pred_over,
        "predicted_transfer_s": plan.predicted_transfer_time,
        "host_bandwidth": plan.host_bandwidth,
        "host_bandwidth_measured": plan.host_bandwidth_measured,
        "measured_overhead": over,
        "offloaded": plan.offloaded,
        "fits": fits,
    }
    if alloc is not None:
        print(
            f"  min+offload: peak allocated {alloc / MiB:.1f} MiB vs predicted peak "
            f"{plan.predicted_peak_bytes / MiB:.1f} MiB ({100 * (alloc / plan.predicted_peak_bytes - 1):+.1f}%)"
        )
    if device.type == "cuda":
        add("any", 0, "llmmem/offload", "llmmem/offload", every_peak, "every block, inputs in pinned host memory")

    title = (
        f"checkpointing strategies: GPT {layers} layers, hidden {cfg.hidden}, seq {cfg.seq_len}, batch {args.batch}, "
        f"{device.type}, {torch.get_num_threads()} torch threads, median of {rounds} interleaved rounds\n"
        "  budget: fraction of the no-checkpoint peak; fits: the strategy's simulated peak (same C model and "
        "profile for every strategy) <= budget;\n  held: bytes kept for backward after the forward, measured"
    )
    _harness.print_table(
        title,
        ["budget", "MiB", "strategy", "fits", "peak MiB", "held MiB", "alloc MiB", "step ms", "overhead", "note"],
        rows,
    )
    print("\nclosing note:")
    for t in targets:
        half = t["llmmem_overhead"] <= 0.5 * max(t["torch_every_overhead"], 0.0)
        print(
            f"  {t['budget']:>8}: llmmem overhead {100 * t['llmmem_overhead']:+.1f}% vs torch every-layer "
            f"{100 * t['torch_every_overhead']:+.1f}% (at most half: {'yes' if half else 'no'}); "
            f"not slower than the best fitting torch strategy (+3%): {t['llmmem_not_slower']}; "
            f"held within 10% of prediction: {t['held_within_10pct']}"
        )
    o = offload_summary
    print(
        f"  below torch's every-layer minimum ({every_peak / MiB:.2f} MiB; planner without offload "
        f"{no_ckpt.min_budget_bytes / MiB:.2f} MiB): the offload plan fits {o['budget_bytes'] / MiB:.2f} MiB "
        f"(predicted peak {o['predicted_peak_bytes'] / MiB:.2f} MiB, fits: {o['fits']}), predicted overhead "
        f"{100 * o['predicted_overhead']:+.1f}% of which transfers {1e3 * o['predicted_transfer_s']:.2f} ms "
        f"({'bandwidth measured' if o['host_bandwidth_measured'] else 'modelled, not measured'}); "
        f"measured step overhead {100 * o['measured_overhead']:+.1f}%"
    )
    if device.type != "cuda":
        print(
            "  offload on the CPU: the inputs already live in host memory, so offload=True copies nothing and frees "
            "nothing; its held MiB (all host) and step time show the recompute only; the transfer cost is the "
            "model's (run with --device cuda to measure it)"
        )
    return {
        "config": vars(cfg),
        "batch": args.batch,
        "records": records,
        "targets": targets,
        "no_checkpoint_peak_bytes": reference,
        "min_budget_bytes": no_ckpt.min_budget_bytes,
        "offload": offload_summary,
    }


def _random_chain(L, identical, rnd):
    def block():
        fn = rnd.uniform(1e-3, 3e-3)
        full = rnd.randint(800, 1200) * 2**10
        return [fn, fn * 1.05], [2 * fn, 2.3 * fn], [full, full // 3]

    blocks = [block()] * L if identical else [block() for _ in range(L)]
    return {
        "fwd_time": [b[0] for b in blocks],
        "bwd_time": [b[1] for b in blocks],
        "input_bytes": [96 * 2**10] * (L + 1),
        "saved_bytes": [b[2] for b in blocks],
        "mode_nestable": [1, 0],
    }


def bench_solver(args) -> list:
    rnd = random.Random(0)
    rows, out = [], []
    for L in (32, 96, 256):
        for identical in (True, False):
            chain = _random_chain(L, identical, rnd)
            least = _C.plan_min_budget(chain)
            full = _C.plan_simulate(chain, [0] * L, [])["peak_bytes"]
            budget = (least + full) // 3
            for slots in (500, 1000, 2000):
                if not identical and L == 256 and (slots > 500 or args.quick):
                    rows.append([L, "heterogeneous", slots, "skipped", "-", "O(L^3 M) too slow for this table"])
                    continue
                if slots == 1000 and not (L == 96 and not identical):
                    continue
                reps = 1 if (not identical and L >= 96) else 5
                t = _harness.time_fn(
                    lambda: _C.plan_solve(chain, budget, slots), repeats=reps, warmup=0 if reps == 1 else 1
                )
                res = _C.plan_solve(chain, budget, slots)
                target = ""
                if L == 96 and not identical and slots == 1000:
                    target = f"target < 1 s: {'met' if t['median_s'] < 1 else 'MISSED'}"
                if L == 256 and identical:
                    target = f"target < 10 ms: {'met' if t['median_s'] < 0.01 else 'MISSED'}"
                rows.append(
                    [
                        L,
                        "identical" if identical else "heterogeneous",
                        slots,
                        f"{1e3 * t['median_s']:.2f}",
                        len(res["regions"]),
                        target,
                    ]
                )
                out.append(
                    {
                        "blocks": L,
                        "identical": identical,
                        "slots": slots,
                        "solve_s": t["median_s"],
                        "regions": len(res["regions"]),
                    }
                )
    _harness.print_table(
        "planner solve time (C, one thread, GIL released)",
        ["blocks", "chain", "slots", "solve ms", "regions", "note"],
        rows,
    )
    return out


def hf_model(kind: str, attn: str, args):
    """A Hugging Face causal LM from a small config (random weights), as the --hf part builds it
    (``args``: hf_vocab, hidden, layers, seq); recompute_in_context.py builds the same."""
    import transformers

    torch.manual_seed(0)
    if kind == "llama":
        cfg = transformers.LlamaConfig(
            vocab_size=args.hf_vocab,
            hidden_size=args.hidden,
            intermediate_size=(8 * args.hidden) // 3,
            num_hidden_layers=args.layers or 8,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=args.seq,
            attention_dropout=0.1,
            attn_implementation=attn,
            use_cache=False,  # as training runs it: the unplanned copy then builds no key/value cache either
        )
        return transformers.LlamaForCausalLM(cfg).train()
    if kind == "gpt2":
        cfg = transformers.GPT2Config(
            vocab_size=args.hf_vocab,
            n_embd=args.hidden,
            n_layer=args.layers or 8,
            n_head=4,
            n_positions=args.seq,
            attn_implementation=attn,
            use_cache=False,
        )
        return transformers.GPT2LMHeadModel(cfg).train()
    if kind in ("qwen2", "mistral", "phi"):
        # a new user's trial: dropout off, sliding window (Mistral) shorter than the sequence
        common = dict(
            vocab_size=args.hf_vocab,
            hidden_size=args.hidden,
            num_hidden_layers=args.layers or 8,
            num_attention_heads=4,
            max_position_embeddings=args.seq,
            attention_dropout=0.0,
            attn_implementation=attn,
            use_cache=False,
        )
        if kind == "qwen2":
            cfg = transformers.Qwen2Config(intermediate_size=(8 * args.hidden) // 3, num_key_value_heads=2, **common)
            return transformers.Qwen2ForCausalLM(cfg).train()
        if kind == "mistral":
            cfg = transformers.MistralConfig(
                intermediate_size=(8 * args.hidden) // 3, num_key_value_heads=2, sliding_window=args.seq // 2, **common
            )
            return transformers.MistralForCausalLM(cfg).train()
        cfg = transformers.PhiConfig(intermediate_size=4 * args.hidden, resid_pdrop=0.0, embd_pdrop=0.0, **common)
        return transformers.PhiForCausalLM(cfg).train()
    raise ValueError(f"--hf: unknown model {kind!r} (llama, gpt2, qwen2, mistral, phi)")


def _hf_step(model, batch, seed=3):
    def step():
        torch.manual_seed(seed)
        model(**batch).loss.backward()

    return step


def _hf_memory(model, step, device):
    """(peak, held when the backward starts, allocator peak or None): activation bytes of a step."""
    from llmmem.checkpointing import ActivationMeter

    for p in model.parameters():
        p.grad = None
    alloc = None
    if device.type == "cuda":
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
    with ActivationMeter(list(model.parameters()), device=device) as meter:
        step()
    if device.type == "cuda":
        torch.cuda.synchronize()
        grads = sum(p.grad.untyped_storage().nbytes() for p in model.parameters() if p.grad is not None)
        alloc = torch.cuda.max_memory_allocated() - base - grads  # gradients: not activations (upper bound)
    return meter.peak, meter.marks["backward"][0], alloc


def _paired_times(steps: dict, device, rounds: int) -> dict:
    """Each step's seconds over ``rounds`` rounds, every step once per round in shuffled order, with
    the garbage collector off (as timeit has it: a collection would land in one step at random).
    Returns ``{key: [seconds per round]}``; ratios taken within a round see the same load."""
    import gc
    import time

    for step in steps.values():
        step()
    samples = {k: [] for k in steps}
    order = list(steps.items())
    shuffler = random.Random(0)
    gc.collect()
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(rounds):
            shuffler.shuffle(order)
            for key, step in order:
                if device.type == "cuda":
                    torch.cuda.synchronize()
                t0 = time.perf_counter()
                step()
                if device.type == "cuda":
                    torch.cuda.synchronize()
                samples[key].append(time.perf_counter() - t0)
    finally:
        if was_enabled:
            gc.enable()
    return samples


def bench_hf(args, device) -> list:
    import copy
    import warnings

    try:
        import transformers  # noqa: F401
    except ImportError:
        print("bench_checkpointing --hf: transformers is not installed; skipped")
        return []
    warnings.filterwarnings("ignore", message=".*caching is incompatible.*")
    rounds = 8 if args.quick else 30
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.hf_vocab, (args.batch, args.seq), generator=g).to(device)
    batch = {"input_ids": ids, "labels": ids}
    rows, out = [], []
    for kind in args.hf.split(","):
        for attn in ("sdpa", "eager"):
            model = hf_model(kind, attn, args).to(device)
            ref = copy.deepcopy(model)
            ref_peak, _, ref_alloc = _hf_memory(ref, _hf_step(ref, batch), device)
            for budget in (0.5, 0.25):
                try:
                    plan = llmmem.auto_checkpoint(model, budget=budget, sample=batch, repeats=args.hf_repeats)
                except llmmem.InfeasibleError as exc:
                    print(
                        f"  {kind} {attn} {100 * budget:.0f}%: no plan fits (least {exc.min_budget_bytes / MiB:.3f} MiB)"
                    )
                    continue
                peak, held, alloc = _hf_memory(model, _hf_step(model, batch), device)
                for m in (model, ref):
                    for p in m.parameters():
                        p.grad = None
                times = _paired_times({"plan": _hf_step(model, batch), "none": _hf_step(ref, batch)}, device, rounds)
                none_median, none_least = statistics.median(times["none"]), min(times["none"])
                plan_least = min(times["plan"])
                # the median of the plan's step over the unplanned one's in the same round; the
                # ratio of the least steps beside it
                measured = statistics.median(p / n for p, n in zip(times["plan"], times["none"])) - 1.0
                measured_least = plan_least / none_least - 1.0
                predicted = plan.predicted_overhead
                record = {
                    "model": kind,
                    "attention": attn,
                    "budget": budget,
                    "budget_bytes": plan.budget_bytes,
                    "predicted_peak_bytes": plan.predicted_peak_bytes,
                    "measured_peak_bytes": peak,
                    "allocator_peak_bytes": alloc,
                    "predicted_held_bytes": plan.predicted_held_bytes,
                    "measured_held_bytes": held,
                    "no_checkpoint_peak_predicted": plan.no_checkpoint_peak_bytes,
                    "no_checkpoint_peak_measured": ref_peak,
                    "no_checkpoint_allocator_peak": ref_alloc,
                    "predicted_overhead_s": plan.predicted_overhead_time,
                    "measured_overhead_s": measured * none_median,
                    "step_s": none_least,
                    "step_median_s": none_median,
                    "predicted_overhead": predicted,
                    "measured_overhead": measured,
                    "measured_overhead_least": measured_least,
                    "planning_s": plan.planning_time,
                    "planning_steps": plan.planning_time / none_median,
                    "regions": plan.regions,
                    "modes": plan.modes,
                }
                out.append(record)
                error = predicted / measured - 1.0 if measured > 0 else float("nan")
                rows.append(
                    [
                        kind,
                        attn,
                        f"{100 * budget:.0f}%",
                        f"{plan.budget_bytes / MiB:.3f}",
                        f"{plan.predicted_peak_bytes / MiB:.3f}",
                        f"{peak / MiB:.3f}" + (f" / {alloc / MiB:.3f}" if alloc is not None else ""),
                        "yes" if peak <= plan.budget_bytes else "NO",
                        f"{100 * (held / plan.predicted_held_bytes - 1):+.1f}%",
                        f"{100 * predicted:+.1f}%",
                        f"{100 * measured:+.1f}% ({100 * measured_least:+.0f}%)",
                        f"{100 * error:+.0f}%",
                        f"{plan.planning_time / none_median:.1f}",
                    ]
                )
                plan.remove()
    _harness.print_table(
        f"auto_checkpoint on Hugging Face models ({device.type}, {torch.get_num_threads()} torch threads; hidden "
        f"{args.hidden}, {args.layers or 8} layers, seq {args.seq}, batch {args.batch}, vocab {args.hf_vocab}; "
        f"overhead: median of {rounds} paired steps (ratio of the least))\n"
        "  peaks: activation bytes of a step beyond parameters and their gradients (measured: exact tensor bytes"
        + (" / allocator" if device.type == "cuda" else "")
        + "); held: at the start of the backward; overhead: step time over the unplanned model's",
        [
            "model",
            "attention",
            "budget",
            "budget MiB",
            "pred. peak",
            "meas. peak",
            "fits",
            "held vs pred.",
            "pred. overhead",
            "meas. overhead (least)",
            "pred. error",
            "planning (steps)",
        ],
        rows,
    )
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None)
    parser.add_argument("--layers", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch CPU threads (default 1: steadier timings on a shared machine; 0 = torch's choice)",
    )
    parser.add_argument("--skip-chain", action="store_true")
    parser.add_argument(
        "--hf", default=None, help="comma-separated Hugging Face models for part 3: llama, gpt2 (needs transformers)"
    )
    parser.add_argument("--hf-vocab", type=int, default=1024, help="vocabulary of the --hf models (default 1024)")
    parser.add_argument(
        "--hf-repeats", type=int, default=3, help="auto_checkpoint(repeats=): timed rounds per mode (default 3)"
    )
    parser.add_argument("--skip-solver", action="store_true")
    parser.add_argument(
        "--preset",
        choices=["small", "1b"],
        default="small",
        help="1b: a ~1B-parameter GPT (20 layers, hidden 2048, seq 2048, batch 1) for a large GPU",
    )
    args = parser.parse_args(argv)
    if args.preset == "1b":
        args.layers, args.hidden, args.seq, args.batch = args.layers or 20, 2048, 2048, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("bench_checkpointing: --device cuda but no CUDA device is usable")
        return 1
    payload = {}
    if not args.skip_chain:
        payload["chain"] = bench_chain(args, device)
    if not args.skip_solver:
        payload["solver"] = bench_solver(args)
    if args.hf:
        payload["hf"] = bench_hf(args, device)
    path = _harness.write_json("checkpoint", payload, args.json)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
