"""The optimizer step of llmmem.optim.AdamW (fp32, bf16, int8, int4 state) against torch's fused
and foreach AdamW and, when installed, DeepSpeed's CPUAdam, bitsandbytes' AdamW8bit and
torchao's AdamW8bit/AdamW4bit, all in one run; and the bytes each moves against the memory
bandwidth measured in the same run.

Workloads (fp32 parameters with fp32 gradients):
  8m      14 tensors of 600,000 elements (8.4 M parameters): the issue's workload
  small   4000 tensors of 1..8K elements: the per-tensor cost of a step
For each candidate: the median step time (the candidates are interleaved, one step of each in
turn, so a load that comes and goes slows them alike), its ratio to torch's fused AdamW, the
state bytes a parameter, the bytes a step reads and writes (parameters read and written,
gradients read, moments read and written, their scales), and the GB/s that makes against the
copy bandwidth (``dst.copy_(src)`` of 256 MiB: one read and one write a byte).

Threads: the CPU timings use one torch thread; ``threads2`` repeats llmmem's with two.

CUDA (--device cuda): the same on the GPU for torch fused AdamW and llmmem's formats (the
peers that have CUDA kernels when installed), with CUDA events.

``--peers`` also builds DeepSpeed's CPUAdam (a C++ op compiled on first use: minutes).

``--convergence`` instead trains the fixed-seed tasks of :mod:`llmmem.optim.convergence` (a
teacher-student MLP, a small GPT on the corpus) with every format, bf16 weights with stochastic
rounding / to nearest / with a master, and the peers' 8- and 4-bit optimizers, and prints each
final loss and its ratio to torch's fp32 AdamW (minutes; ``--quick``: the MLP only).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import llmmem.optim as lo


def _shapes(workload: str, quick: bool) -> list[int]:
    if workload == "8m":
        return [600_000 if not quick else 150_000] * 14
    gen = torch.Generator().manual_seed(0)
    return [int(n) for n in torch.randint(1, 8193, (4000 if not quick else 1000,), generator=gen)]


def _params(sizes, device):
    gen = torch.Generator().manual_seed(0)
    ps = []
    for n in sizes:
        p = torch.nn.Parameter(torch.randn(n, generator=gen).to(device))
        p.grad = (torch.randn(n, generator=gen) * 1e-3).to(device)
        ps.append(p)
    return ps


def _candidates(device: str, peers: bool) -> dict:
    """name -> (make(params) -> optimizer, moment bytes a parameter or None to measure)."""
    c = {
        "torch fused": lambda ps: torch.optim.AdamW(ps, fused=True),
        "torch foreach": lambda ps: torch.optim.AdamW(ps, foreach=True),
        "llmmem fp32": lambda ps: lo.AdamW(ps),
        "llmmem bf16": lambda ps: lo.AdamW(ps, state_dtype="bf16"),
        "llmmem int8": lambda ps: lo.AdamW(ps, state_dtype="int8"),
        "llmmem int4": lambda ps: lo.AdamW(ps, state_dtype="int4"),
    }
    try:
        import bitsandbytes as bnb

        c["bnb AdamW8bit"] = lambda ps: bnb.optim.AdamW8bit(ps)
    except Exception:
        print("bitsandbytes not installed: skipped")
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        c["torchao AdamW8bit"] = lambda ps: AdamW8bit(ps)
        c["torchao AdamW4bit"] = lambda ps: AdamW4bit(ps)
    except Exception:
        print("torchao not installed: skipped")
    if peers and device == "cpu":
        try:
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            c["deepspeed CPUAdam"] = lambda ps: DeepSpeedCPUAdam(ps, adamw_mode=True)
        except Exception as e:
            print(f"deepspeed CPUAdam unavailable: skipped ({type(e).__name__})")
    return c


def _state_bytes(opt) -> int:
    total = 0
    for st in opt.state.values():
        for k, t in st.items():
            if k == "step" or not isinstance(t, torch.Tensor):
                continue
            if hasattr(t, "__tensor_flatten__") and type(t) is not torch.Tensor:  # torchao's quantized subclasses
                names, _ = t.__tensor_flatten__()
                total += sum(getattr(t, n).numel() * getattr(t, n).element_size() for n in names)
            elif t.numel() > 1:
                total += t.numel() * t.element_size()
    return total


def _moved_bytes(name: str, n_params: int, state_bytes: int) -> int:
    """Bytes a step reads and writes: weights read + written (4 + 4), gradients read (4), every
    byte of state read and written (2 x state)."""
    return n_params * 12 + 2 * state_bytes


def copy_bandwidth(device: str, repeats: int) -> float:
    """GB/s of dst.copy_(src) over 256 MiB, one read and one write a byte (the memory's limit)."""
    n = (256 << 20) // 4
    src, dst = torch.randn(n, device=device), torch.empty(n, device=device)
    t = _harness.time_fn(lambda: dst.copy_(src), repeats=repeats, device=device)
    return 2 * n * 4 / t["median_s"] / 1e9


def _interleaved(fns: dict, repeats: int, device: str) -> dict:
    for f in fns.values():  # warm up: state made, kernels built
        f()
        f()
    samples = {k: [] for k in fns}
    for _ in range(repeats):
        for k, f in fns.items():
            _harness._sync(device)
            t0 = time.perf_counter()
            f()
            _harness._sync(device)
            samples[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in samples.items()}


def run(workload: str, device: str, quick: bool, peers: bool, threads: int) -> dict:
    sizes = _shapes(workload, quick)
    n_params = sum(sizes)
    opts, state = {}, {}
    for name, make in _candidates(device, peers).items():
        try:
            ps = _params(sizes, device)
            opt = make(ps)
            opt.step()
            opts[name] = opt
            state[name] = _state_bytes(opt)
        except Exception as e:  # a peer without a kernel for this device or workload
            print(f"{name}: skipped on {device} ({type(e).__name__}: {str(e)[:120]})")
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        times = _interleaved({k: o.step for k, o in opts.items()}, 7 if quick else 15, device)
    finally:
        torch.set_num_threads(before)
    base = times.get("torch fused")
    rows = {}
    for k, t in times.items():
        moved = _moved_bytes(k, n_params, state[k])
        rows[k] = {
            "ms": t * 1e3,
            "vs_torch_fused": t / base if base else None,
            "state_bytes_per_param": state[k] / n_params,
            "moved_bytes": moved,
            "GBps": moved / t / 1e9,
        }
    return {"workload": workload, "params": n_params, "tensors": len(sizes), "threads": threads, "rows": rows}


def _convergence_candidates(lr: float) -> dict:
    """name -> (make(params), weights dtype)."""
    bf16 = torch.bfloat16
    c = {
        "torch AdamW fp32": (lambda ps: torch.optim.AdamW(ps, lr=lr), torch.float32),
        "llmmem fp32": (lambda ps: lo.AdamW(ps, lr=lr), torch.float32),
        "llmmem bf16 state": (lambda ps: lo.AdamW(ps, lr=lr, state_dtype="bf16"), torch.float32),
        "llmmem int8": (lambda ps: lo.AdamW(ps, lr=lr, state_dtype="int8"), torch.float32),
        "llmmem int4": (lambda ps: lo.AdamW(ps, lr=lr, state_dtype="int4"), torch.float32),
        "bf16 weights + fp32 master": (lambda ps: lo.AdamW(ps, lr=lr, master_weights=True), bf16),
        "bf16 weights, stochastic rounding": (lambda ps: lo.AdamW(ps, lr=lr), bf16),
        "bf16 weights, to nearest": (lambda ps: lo.AdamW(ps, lr=lr, stochastic_rounding=False), bf16),
        "torch AdamW on bf16 weights": (lambda ps: torch.optim.AdamW(ps, lr=lr), bf16),
        "bf16 weights + int8 state": (lambda ps: lo.AdamW(ps, lr=lr, state_dtype="int8"), bf16),
    }
    try:
        import bitsandbytes as bnb

        c["bnb AdamW8bit"] = (lambda ps: bnb.optim.AdamW8bit(ps, lr=lr), torch.float32)
    except Exception:
        print("bitsandbytes not installed: skipped")
    try:
        from torchao.optim import AdamW4bit, AdamW8bit

        c["torchao AdamW8bit"] = (lambda ps: AdamW8bit(ps, lr=lr), torch.float32)
        c["torchao AdamW4bit"] = (lambda ps: AdamW4bit(ps, lr=lr), torch.float32)
    except Exception:
        print("torchao not installed: skipped")
    return c


def convergence(quick: bool) -> dict:
    from llmmem.optim import convergence as cv

    torch.set_num_threads(1)
    tasks = [("teacher-student MLP, 400 steps, lr 1e-3", lambda m, d: cv.teacher_student(m, dtype=d), 1e-3)]
    if not quick:
        tasks.append(("GPT 2x64 on the corpus, 2000 steps, lr 3e-3", lambda m, d: cv.gpt(m, dtype=d), 3e-3))
    out = {}
    for title, task, lr in tasks:
        rows, base = [], None
        for name, (make, dtype) in _convergence_candidates(lr).items():
            t0 = time.perf_counter()
            loss = task(make, dtype)
            base = base or loss
            rows.append([name, loss, f"{loss / base:.4f}", time.perf_counter() - t0])
        _harness.print_table(title, ["optimizer", "final loss", "x fp32 AdamW", "s"], rows)
        out[title] = {r[0]: {"loss": r[1], "ratio": float(r[2])} for r in rows}
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--peers", action="store_true", help="also build and time DeepSpeed's CPUAdam (minutes)")
    parser.add_argument("--workloads", default="8m,small")
    parser.add_argument("--convergence", action="store_true", help="final losses of fixed-seed runs instead")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    if args.convergence:
        print("wrote", _harness.write_json("optim_convergence", convergence(args.quick), args.json))
        return 0
    if args.device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device: skipped")
        return 0
    bw = copy_bandwidth(args.device, 5 if args.quick else 9)
    print(f"copy bandwidth ({args.device}): {bw:.1f} GB/s")
    results = {"copy_GBps": bw, "runs": []}
    thread_counts = [1, 2] if args.device == "cpu" else [torch.get_num_threads()]
    for workload in args.workloads.split(","):
        for threads in thread_counts:
            r = run(workload, args.device, args.quick, args.peers, threads)
            results["runs"].append(r)
            _harness.print_table(
                f"{workload}: {r['params'] / 1e6:.2f} M parameters in {r['tensors']} tensors, {threads} thread(s)",
                ["optimizer", "step ms", "x torch fused", "state B/param", "GB/s", "x copy bw"],
                [
                    [
                        k,
                        v["ms"],
                        v["vs_torch_fused"] or float("nan"),
                        v["state_bytes_per_param"],
                        v["GBps"],
                        v["GBps"] / bw,
                    ]
                    for k, v in r["rows"].items()
                ],
            )
    if args.device == "cpu":
        for workload in args.workloads.split(","):
            one = next(r for r in results["runs"] if r["workload"] == workload and r["threads"] == 1)
            two = next((r for r in results["runs"] if r["workload"] == workload and r["threads"] == 2), None)
            if two:
                for k in ("llmmem fp32", "llmmem int8"):
                    if k in one["rows"] and k in two["rows"]:
                        print(f"{workload} {k}: 2 threads {one['rows'][k]['ms'] / two['rows'][k]['ms']:.2f}x one")
    print("wrote", _harness.write_json(f"optim_{args.device}", results, args.json))
    return 0


if __name__ == "__main__":
    sys.exit(main())
