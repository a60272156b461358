"""Activation memory and step time under ``torch.compile`` on the CPU: llmmem's planner against
compile alone, torch's checkpoint and torch's compile-time planner (``activation_memory_budget``).

llmmem's byte counter is a dispatch mode, which a compiled graph does not go through, so here
memory is the rise of the process's resident set during one training step (the kernel's
high-water mark, reset before the step through ``/proc/self/clear_refs``) in a fresh process per
mode, with ``MALLOC_MMAP_THRESHOLD_`` set so that every large tensor is mapped when made and
unmapped when freed (glibc would otherwise keep freed memory and hide the next step's). The eager
modes also report llmmem's exact count (``LiveBytes``): the two differ by what the step allocates
and never writes (pages not touched are not resident), about the same amount in every mode.

Model: Hugging Face Llama, hidden 256, 4 layers, 4 heads, SwiGLU 688, SDPA attention, vocabulary
256, batch 4 x 256 tokens, fp32, one thread (issue 25's measurement). Linux only.

    python benchmarks/bench_compile_memory.py [--json out.json] [--modes eager,compile,...]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

MODES = {
    "eager": "no checkpointing",
    "eager-torchckpt": "torch checkpoint on every layer (gradient_checkpointing_enable)",
    "eager-plan": "llmmem.auto_checkpoint(budget=0.5)",
    "compile": "torch.compile (inductor), no checkpointing",
    "compile-torchckpt": "torch.compile + torch checkpoint on every layer",
    "compile-amb": "torch.compile + activation_memory_budget=0.5",
    "compile-plan": "torch.compile + llmmem.auto_checkpoint(budget=0.5)",
    "compile-blocksplan": "torch.compile + llmmem.auto_checkpoint(budget=0.5, compile_blocks=True)",
}


def _status() -> dict:
    out = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, value = line.split(":", 1)
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(value.split()[0]) * 1024
    return out


def measure(mode: str) -> dict:
    """One mode, in this process: warm-up steps (compilation), then the measured and timed steps."""
    import torch

    torch.set_num_threads(1)
    from transformers import LlamaConfig, LlamaForCausalLM

    import llmmem

    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=688,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=256,
        attn_implementation="sdpa",
        use_cache=False,
    )
    model = LlamaForCausalLM(cfg)
    ids = torch.randint(0, 256, (4, 256), generator=torch.Generator().manual_seed(1))
    batch = dict(input_ids=ids, labels=ids, use_cache=False)
    if mode.endswith("torchckpt"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if mode.endswith("plan"):
        llmmem.auto_checkpoint(model, budget=0.5, sample=batch, repeats=0, compile_blocks=mode.endswith("blocksplan"))
    if mode.endswith("amb"):
        import torch._functorch.config as functorch_config

        functorch_config.activation_memory_budget = 0.5
    run = torch.compile(model, backend="inductor") if mode.startswith("compile") else model

    def step() -> float:
        for p in model.parameters():
            p.grad = None
        t0 = time.perf_counter()
        loss = run(**batch).loss
        loss.backward()
        return time.perf_counter() - t0

    for _ in range(2):
        step()
    times = [step() for _ in range(3)]
    for p in model.parameters():
        p.grad = None
    import gc

    gc.collect()
    before = _status()["VmRSS"]
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # the high-water mark starts again from the resident set now
    step()
    out = {"mode": mode, "rss_rise_bytes": _status()["VmHWM"] - before, "step_s": statistics.median(times)}
    if not mode.startswith("compile"):
        from llmmem.diagnostics.live import LiveBytes

        for p in model.parameters():
            p.grad = None
        with LiveBytes() as live:
            step()
        out["live_peak_bytes"] = live.max_allocated("cpu")
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default=",".join(MODES), help="comma-separated: " + ", ".join(MODES))
    p.add_argument("--json", default=None)
    p.add_argument("--one", default=None, help=argparse.SUPPRESS)  # a child's mode
    args = p.parse_args(argv)
    if args.one:
        print(json.dumps(measure(args.one)))
        return 0
    if not os.path.exists("/proc/self/clear_refs"):
        print("needs Linux (/proc/self/clear_refs)", file=sys.stderr)
        return 2
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", OMP_NUM_THREADS="1")
    rows = []
    for mode in args.modes.split(","):
        if mode not in MODES:
            p.error(f"--modes: unknown mode {mode!r}; known: {', '.join(MODES)}")
        proc = subprocess.run(
            [sys.executable, __file__, "--one", mode], capture_output=True, text=True, env=env, timeout=1800
        )
        if proc.returncode:
            print(f"{mode}: failed\n{proc.stderr[-2000:]}", file=sys.stderr)
            continue
        rows.append(json.loads(proc.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    base = {r["mode"]: r for r in rows}
    print(f"\n{'mode':<18} {'RSS rise MiB':>12} {'x own base':>10} {'LiveBytes MiB':>13} {'step ms':>8}  what")
    for r in rows:
        own = base.get("compile" if r["mode"].startswith("compile") else "eager")
        ratio = r["rss_rise_bytes"] / own["rss_rise_bytes"] if own else float("nan")
        live = f"{r['live_peak_bytes'] / 2**20:.1f}" if "live_peak_bytes" in r else "-"
        print(
            f"{r['mode']:<18} {r['rss_rise_bytes'] / 2**20:>12.1f} {ratio:>10.2f} {live:>13} "
            f"{1e3 * r['step_s']:>8.0f}  {MODES[r['mode']]}"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
