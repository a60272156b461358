"""GradScaler.unscale_ (unscale + inf/NaN check) of llmmem against torch.amp.GradScaler, and
against the memory-bandwidth limit measured in the same run.

Gradient lists (fp32):
  gpt2-small   the 148 parameter shapes of GPT-2 small (124M parameters)
  1b           a 1B-parameter stack (24 layers of d=1792-ish shapes); --quick: 256M
  small-4000   4000 tensors of 1..8K elements (biases, norms, MoE experts): per-tensor overhead

For each list it reports the median time of
  torch        torch.amp.GradScaler.unscale_(optimizer)          (the user-facing call)
  llmmem       llmmem.GradScaler.unscale_(optimizer)
  torch-op     torch._amp_foreach_non_finite_check_and_unscale_ alone (no Python scaler around it)
  llmmem-op    the llmmem C kernel alone
  copy         dst.copy_(src) of the same bytes, one read and one write per element: the limit
and GB/s = 2 x bytes / time (one read + one write of every gradient byte).

Every timed call, of every candidate, starts from the state backward leaves: just before it,
every gradient is rewritten in place (last parameter first, the order backward produces them),
untimed. Without that, each candidate would find the caches as the one timed before it left
them: a candidate timed right after another unscale of the same gradients finds them, and
torch's per-tensor objects, already in cache (on the 4000-small-tensor list, on the 2-vCPU CI
machine, the same code measured 2.2x to 3x torch depending on what ran just before it).

CUDA (--device cuda, for a lent GPU): the same for fp32 and bf16 gradients of the 1B list with
CUDA-event timing, torch's op vs llmmem's kernel (bf16 is compared with torch on fp16, as torch's
CUDA op rejects bf16), plus a fused-AdamW training step under set_sync_debug_mode("error").
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import _harness

import llmmem
from llmmem._native import native
from llmmem.amp import kernels as K

# Slightly above 1 so repeated unscales neither change magnitudes much nor skip the write
# (both implementations write when inv_scale != 1).
SCALE = 1.0 + 2.0**-10


def _block_shapes(d):
    """The 12 parameters of one GPT-2 block of width d (norms, attention, MLP)."""
    return [(d,), (d,), (3 * d, d), (3 * d,), (d, d), (d,), (d,), (d,), (4 * d, d), (4 * d,), (d, 4 * d), (d,)]


def gpt2_small_shapes():
    d, v, ctx, layers = 768, 50257, 1024, 12
    return [(v, d), (ctx, d)] + _block_shapes(d) * layers + [(d,), (d,)]


def one_b_shapes(quick):
    d, layers = 2048, 20 if not quick else 5  # 20 x 50.3M + embeddings ~ 1.07B; quick ~ 0.32B
    return [(50304, d)] + _block_shapes(d) * layers


def small_shapes(count=4000):
    gen = torch.Generator().manual_seed(0)
    return [(int(n),) for n in torch.randint(1, 8193, (count,), generator=gen)]


def make_params(shapes, device, dtype):
    params = []
    for s in shapes:
        p = torch.nn.Parameter(torch.empty(s, device=device, dtype=dtype))
        p.grad = torch.randn(s, device=device, dtype=dtype)
        params.append(p)
    return params


def scaler_fn(cls, device, params):
    opt = torch.optim.SGD(params, lr=0.1)
    s = cls(device, init_scale=SCALE)
    s.scale(torch.ones((), device=device))

    def fn():
        s.unscale_(opt)
        s._per_optimizer_states.clear()  # ready for the next unscale_, as after update()

    return fn


def op_fns(grads, device):
    found = torch.zeros((), device=device)
    inv = torch.full((), 1.0 / SCALE, device=device)
    scale = torch.full((), SCALE, device=device)
    by_dtype = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)

    def torch_op():
        for gs in by_dtype.values():
            torch._amp_foreach_non_finite_check_and_unscale_(gs, found, inv)

    ptrs, numels = [g.data_ptr() for g in grads], [g.numel() for g in grads]
    codes = [K.DTYPE_CODES[g.dtype] for g in grads]
    threads = torch.get_num_threads()
    if device == "cpu":

        def ours_op():
            native.scaler_unscale_check(ptrs, numels, codes, scale.data_ptr(), False, found.data_ptr(), 0, 0, threads)
    else:
        stream = torch.cuda.current_stream().cuda_stream
        index = torch.cuda.current_device()

        def ours_op():
            native.scaler_unscale_check_cuda(
                ptrs, numels, codes, scale.data_ptr(), False, found.data_ptr(), 0, 0, index, stream
            )

    return torch_op, ours_op


def interleaved(fns: dict, repeats: int, device: str, before=None) -> dict:
    """Median seconds per call of each fn, timed in alternating rounds (A, B, C, A, B, C, ...) so
    that load from other jobs on a shared machine falls on all candidates alike. ``before(name)``
    (untimed) runs before every timed call of candidate ``name``, so that each starts from the
    same state."""
    samples = {k: [] for k in fns}
    for fn in fns.values():  # warm-up: page faults, lazy initialisation
        fn()
    for _ in range(repeats):
        for k, fn in fns.items():
            if before is not None:
                before(k)
            samples[k].append(_harness.time_fn(fn, repeats=1, warmup=0, device=device)["median_s"])
    return {k: statistics.median(v) for k, v in samples.items()}


def bench_list(name, shapes, device, dtype, repeats, torch_dtype_for_op=None):
    params = make_params(shapes, device, dtype)
    grads = [p.grad for p in params]
    nbytes = sum(g.numel() * g.element_size() for g in grads)
    # The copy limit is measured on up to 1 GiB (plenty to leave the caches), so the 1B list does
    # not need 8 GB more memory; its GB/s is computed on its own size below.
    copy_bytes = min(nbytes, 2**30)
    src = torch.empty(copy_bytes // 4, dtype=torch.float32, device=device).normal_()
    dst = torch.empty_like(src)
    fns = {"copy": lambda: dst.copy_(src)}  # noqa: F821 - both are deleted only after the timing
    if torch_dtype_for_op is None:
        fns["torch"] = scaler_fn(torch.amp.GradScaler, device, params)
    fns["llmmem"] = scaler_fn(llmmem.GradScaler, device, params)
    torch_op, ours_op = op_fns(grads, device)
    if torch_dtype_for_op is not None:  # torch's CUDA op rejects bf16: time it on fp16 lists of the same bytes
        proxy = [torch.randn(s, device=device, dtype=torch_dtype_for_op) for s in shapes]
        torch_op, _ = op_fns(proxy, device)
    fns["torch-op"] = torch_op
    fns["llmmem-op"] = ours_op
    # what backward leaves: every gradient just written, the first parameter's last; the fp16
    # proxies for torch's op are rewritten alone before it, the real gradients before the others
    backward_order = grads[::-1]
    proxy_order = proxy[::-1] if torch_dtype_for_op is not None else backward_order

    def rewrite(name):
        torch._foreach_mul_(proxy_order if name == "torch-op" else backward_order, 1.0)

    times = interleaved(fns, repeats, device, before=rewrite)
    gbs = {k: 2 * (copy_bytes if k == "copy" else nbytes) / v / 1e9 for k, v in times.items()}
    del src, dst
    row = {
        "list": name,
        "dtype": str(dtype).replace("torch.", ""),
        "tensors": len(shapes),
        "params_M": sum(torch.Size(s).numel() for s in shapes) / 1e6,
        "bytes": nbytes,
        "times_s": times,
        "GB_s": gbs,
        "llmmem_vs_torch": (times["torch"] / times["llmmem"]) if "torch" in times else None,
        "op_vs_torch_op": times["torch-op"] / times["llmmem-op"],
        "llmmem_vs_copy_bw": gbs["llmmem"] / gbs["copy"],
        "op_vs_copy_bw": gbs["llmmem-op"] / gbs["copy"],
    }
    return row


def sync_free_step() -> str:
    model = torch.nn.Sequential(torch.nn.Linear(256, 1024), torch.nn.GELU(), torch.nn.Linear(1024, 256)).cuda()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    s = llmmem.GradScaler("cuda")
    x = torch.randn(64, 256, device="cuda")
    for _ in range(2):
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            opt.zero_grad()
            with torch.autocast("cuda", dtype=torch.float16):
                loss = model(x).float().pow(2).mean()
            s.scale(loss).backward()
            s.step(opt)
            s.update()
        except RuntimeError as exc:
            return f"FAILED: {exc}"
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return "ok: no host synchronisation"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU threads for both torch and llmmem (torch.set_num_threads); default: torch's",
    )
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = 5 if args.quick else 9
    rows = []
    if args.device == "cpu":
        lists = [
            ("gpt2-small", gpt2_small_shapes()),
            ("1b" if not args.quick else "1b-quick(0.32B)", one_b_shapes(args.quick)),
            ("small-4000", small_shapes()),
        ]
        for name, shapes in lists:
            rows.append(bench_list(name, shapes, "cpu", torch.float32, repeats))
    else:
        if not torch.cuda.is_available() or not K.cuda_kernels_built():
            print("no usable GPU or llmmem built without CUDA: nothing to measure")
            return 1
        for dtype, proxy in [(torch.float32, None), (torch.bfloat16, torch.float16)]:
            rows.append(bench_list("1b", one_b_shapes(False), "cuda", dtype, repeats, torch_dtype_for_op=proxy))
        rows.append(bench_list("small-4000", small_shapes(), "cuda", torch.float32, repeats))
    header = [
        "list",
        "dtype",
        "tensors",
        "MB",
        "torch ms",
        "llmmem ms",
        "x torch",
        "torch-op ms",
        "llmmem-op ms",
        "op x torch-op",
        "copy GB/s",
        "llmmem GB/s",
        "% copy bw",
        "op % copy bw",
    ]
    table = []
    for r in rows:
        t = r["times_s"]
        table.append(
            [
                r["list"],
                r["dtype"],
                r["tensors"],
                r["bytes"] / 1e6,
                t.get("torch", float("nan")) * 1e3,
                t["llmmem"] * 1e3,
                r["llmmem_vs_torch"] or float("nan"),
                t["torch-op"] * 1e3,
                t["llmmem-op"] * 1e3,
                r["op_vs_torch_op"],
                r["GB_s"]["copy"],
                r["GB_s"]["llmmem"],
                100 * r["llmmem_vs_copy_bw"],
                100 * r["op_vs_copy_bw"],
            ]
        )
    _harness.print_table(
        f"GradScaler.unscale_ ({args.device}, {torch.get_num_threads()} threads; "
        "bf16 torch-op column measured on fp16)",
        header,
        table,
    )
    payload = {"device": args.device, "threads": torch.get_num_threads(), "rows": rows}
    if args.device == "cuda":
        payload["sync_free_fused_adamw_step"] = sync_free_step()
        print(f"\nfused AdamW step under set_sync_debug_mode('error'): {payload['sync_free_fused_adamw_step']}")
    path = _harness.write_json("scaler" if args.device == "cpu" else "scaler_cuda", payload, args.json)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
