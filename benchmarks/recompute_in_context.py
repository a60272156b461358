"""What a recompute costs inside a model, against the planner's prediction (the measurement behind
pricing a plan's extra work at the blocks' forward rate; see benchmarks/README.md).

A Hugging Face Llama, GPT-2, Qwen2, Mistral or Phi from a small config (random weights, as
bench_checkpointing.py --hf builds them) runs unplanned, with every layer checkpointed
(llmmem.checkpoint), with every layer in the recompute-cheap mode, and with
llmmem.auto_checkpoint at 50%, in shuffled rounds with the garbage collector off. Hooks time each
layer's forward and its backward window (from the gradient of its output to that of its input): the
every-layer backward window less the unplanned one is what one recompute costs there, to set beside
the layer's forward and the checkpoint bookkeeping the planner timed on a null block. The
recompute-cheap model's step less the unplanned one, per layer, is what that mode adds there, beside
its hooks' seconds in the same steps and the mode's cost timed alone (the profile).

    python benchmarks/recompute_in_context.py [llama|gpt2|qwen2|mistral|phi] [sdpa|eager]
        [--rounds 25] [--batch 4] [--hidden 128] [--seq 128]
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import os
import random
import statistics
import sys
import time
import warnings

import torch

import llmmem
from llmmem._native import native
from llmmem.checkpointing import find_blocks, remat

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bench_checkpointing import hf_model


def build(kind: str, attn: str, hidden=128, layers=8, seq=128, vocab=1024):
    """The model bench_checkpointing.py --hf builds, and a function giving its blocks."""
    model = hf_model(kind, attn, argparse.Namespace(hf_vocab=vocab, hidden=hidden, layers=layers, seq=seq))
    return model, lambda m: find_blocks(m)[1]


def step_of(model, batch, clock=None):
    def step():
        torch.manual_seed(3)
        with remat.hook_clock() if clock is not None else contextlib.nullcontext() as hooks:
            model(**batch).loss.backward()
        if clock is not None:
            clock.append(hooks[0] + hooks[1])
        for p in model.parameters():
            p.grad = None

    return step


def instrument(layers) -> dict:
    """Per step: each layer's forward seconds, and the time its output's gradient arrived."""
    rec = {"fwd": {}, "grad": {}, "start": {}}

    def pre(i):
        def hook(module, args, kwargs):
            if torch._C._current_graph_task_id() < 0:  # not a recompute inside the backward
                rec["start"][i] = time.perf_counter()

        return hook

    def post(i):
        def hook(module, args, kwargs, out):
            if torch._C._current_graph_task_id() >= 0:
                return
            rec["fwd"][i] = time.perf_counter() - rec["start"][i]
            y = out[0] if isinstance(out, tuple) else out
            if y.requires_grad:
                y.register_hook(lambda g: rec["grad"].__setitem__(i, time.perf_counter()))

        return hook

    for i, layer in enumerate(layers):
        layer.register_forward_pre_hook(pre(i), with_kwargs=True)
        layer.register_forward_hook(post(i), with_kwargs=True)
    return rec


def work_overhead(plan) -> float:
    """The plan's extra work, counted, in the profile's work units."""
    p = plan.profile
    modes = [p.modes.index(m) for m in plan.modes] + ([0] if p.head is not None else [])
    return native.plan_simulate(p.to_chain(), modes, [tuple(r) for r in plan.regions])["overhead_time"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("kind", nargs="?", default="llama", choices=("llama", "gpt2", "qwen2", "mistral", "phi"))
    ap.add_argument("attn", nargs="?", default="sdpa", choices=("sdpa", "eager"))
    ap.add_argument("--rounds", type=int, default=25)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--seq", type=int, default=128)
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message=".*caching is incompatible.*")
    model, layers_of = build(args.kind, args.attn, hidden=args.hidden, seq=args.seq)
    L = len(layers_of(model))
    ids = torch.randint(0, 1024, (args.batch, args.seq), generator=torch.Generator().manual_seed(0))
    batch = {"input_ids": ids, "labels": ids}
    none, every, cheap = copy.deepcopy(model), copy.deepcopy(model), copy.deepcopy(model)
    plan = llmmem.auto_checkpoint(model, budget=0.5, sample=batch)
    for layer in layers_of(every):
        forward = layer.forward
        layer.forward = lambda *a, _f=forward, **k: llmmem.checkpoint(_f, *a, use_reentrant=False, **k)
    for layer in layers_of(cheap):
        forward = layer.forward

        def in_cheap_mode(*a, _f=forward, _layer=layer, **k):
            with remat.recompute_cheap(_layer):
                return _f(*a, **k)

        layer.forward = in_cheap_mode
    models = {"none": none, "every": every, "cheap": cheap, "plan": model}
    recs = {k: instrument(layers_of(m)) for k, m in models.items()}
    hook_seconds: list = []
    steps = {k: step_of(m, batch, hook_seconds if k == "cheap" else None) for k, m in models.items()}
    for s in steps.values():
        s()
    hook_seconds.clear()  # the warm-up step's
    total = {k: [] for k in steps}
    fwd = {k: [] for k in steps}
    window = {k: [] for k in steps}
    order, rnd = list(steps), random.Random(0)
    gc.collect()
    gc.disable()
    for _ in range(args.rounds):
        rnd.shuffle(order)
        for k in order:
            t0 = time.perf_counter()
            steps[k]()
            total[k].append(time.perf_counter() - t0)
            g = recs[k]["grad"]
            fwd[k].append(statistics.median(recs[k]["fwd"].values()))
            window[k].append(statistics.median(g[i - 1] - g[i] for i in range(1, L)))
    gc.enable()
    ms = lambda v: 1e3 * statistics.median(v)  # noqa: E731
    p = plan.profile
    s = p.seconds
    print(
        f"{args.kind} {args.attn}, {L} layers, batch {args.batch}, 1 torch thread, medians of {args.rounds} "
        "shuffled rounds (ms)"
    )
    print(
        f"  a layer timed alone (the profile): forward {1e3 * s['fwd_time'][0][0]:.2f}, backward "
        f"{1e3 * s['bwd_time'][0][0]:.2f}, checkpointed forward {1e3 * s['fwd_nostore_time'][0]:.2f}"
    )
    for k in steps:
        print(
            f"  {k:5s} step {ms(total[k]):7.1f}  layer forward {ms(fwd[k]):5.2f}  backward window {ms(window[k]):5.2f}"
        )
    print(
        f"  one recompute inside the model (every-layer window less the unplanned one): "
        f"{ms(window['every']) - ms(window['none']):.2f}, the layer's forward there {ms(fwd['none']):.2f}, "
        f"checkpointed forward less it {ms(fwd['every']) - ms(fwd['none']):.2f}; the planner's null-block "
        f"bookkeeping {1e3 * s['bookkeeping'][0].get('checkpoint', 0.0):.2f}"
    )
    k = p.modes.index("recompute-cheap")
    alone = sum(s[key][0][k] - s[key][0][0] for key in ("fwd_time", "bwd_time"))
    pack, unpack, operators = s["bookkeeping"][0].get("recompute-cheap", (0.0, 0.0, 0.0))
    work = sum(max(0.0, getattr(p, key)[0][k] - getattr(p, key)[0][0]) for key in ("fwd_time", "bwd_time"))
    priced = work * p.time_unit + pack + max(0.0, unpack - operators)
    print(
        f"  recompute-cheap, per layer: adds {(ms(total['cheap']) - ms(total['none'])) / L:.2f} inside the model, "
        f"its hooks (rebuilds included) {ms(hook_seconds) / L:.2f} there; the planner prices it at {1e3 * priced:.2f} "
        f"(extra work {1e3 * work * p.time_unit:.2f} + hooks' Python {1e3 * (pack + max(0.0, unpack - operators)):.2f}); "
        f"timed alone it adds {1e3 * alone:.2f}"
    )
    measured = statistics.median(a / b for a, b in zip(total["plan"], total["none"])) - 1
    print(
        f"  plan at 50% {plan.regions}: measured overhead {100 * measured:+.1f}%; predicted "
        f"{100 * plan.predicted_overhead:+.1f}% (extra work {work_overhead(plan):.3g} units at "
        f"{1e9 * p.time_unit:.3f} ns per unit, over a {1e3 * plan.predicted_step_time:.1f} ms step)"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
