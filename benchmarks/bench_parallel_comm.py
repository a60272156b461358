"""All-reduce latency and bandwidth: llmmem's shared-memory engine vs gloo (CPU), measured in the same run.

``python benchmarks/bench_parallel_comm.py [--device cpu|cuda] [--quick] [--ranks 2 4] [--launches N] [--json PATH]``

CPU: for 2 and 4 local ranks (spawned processes, one thread each) and messages of 4 KiB .. 64 MiB
of fp32, every rank times ``llmmem.parallel.collectives.all_reduce_`` (shared memory) and
``torch.distributed.all_reduce`` (gloo) on the same tensor, interleaved (llmmem, gloo, copy, llmmem,
...), median of repeats; the table gives the ratio gloo / llmmem of the medians and the median of
the per-repeat ratios, the bus bandwidth (2(n-1)/n * bytes / time) and, as the physical reference,
the copy bandwidth of this machine measured in the same run (bytes read + written per second).
With more ranks than free cores (4 ranks on a 2-vCPU machine, or 2 ranks while other jobs hold a
core) the ranks time-share cores: every wait for a peer is then a hand-over of the core, and the
table measures scheduling as much as memory traffic, for gloo (whose progress threads add more
contenders) as for llmmem. The title gives the CPU count. gloo's times can be bimodal across
launches: its fast mode is the two ranks sharing one CPU, which ``taskset -c 1`` reproduces (see
benchmarks/README.md). ``--launches N`` starts the ranks N times and adds a table of the spread
over the launches.

CUDA (``--device cuda``, for the lent GPU): two processes share GPU 0; the IPC one-shot all-reduce
is checked against the sum computed on the CPU, then timed (CUDA events) against gloo on the same
CUDA tensors (NCCL refuses two ranks on one GPU, so it cannot be the baseline there).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


def _inner_for(nbytes: int) -> int:
    # Calls per sample: at least 4 up to 4 MiB, so a sample measures the collective and not the
    # skew with which the ranks left the previous call (a gloo call, in the interleaved loop);
    # the same count for llmmem, gloo and the copy.
    if nbytes > (4 << 20):
        return 1
    return max(4, min(100, (256 * 1024) // max(nbytes, 1)))


def _cpu_rank(rank, world, sizes, repeats):
    import statistics
    import time

    import torch
    import torch.distributed as dist
    from _harness import print_rank_result

    from llmmem.parallel import collectives

    torch.set_num_threads(1)

    def sample(fn, inner):
        # One untimed call first: the ranks leave a collective at different times (gloo's skew is
        # tens of microseconds), and without it that skew, left by the previous engine in the
        # interleaved loop, would be charged to this one. Each engine is timed from the ranks as
        # its own collective leaves them, as in a run of back-to-back collectives.
        fn()
        t0 = time.perf_counter()
        for _ in range(inner):
            fn()
        return (time.perf_counter() - t0) / inner

    rows = []
    for nbytes in sizes:
        x = torch.zeros(nbytes // 4)  # zeros: the sums stay finite however often we repeat
        y = torch.empty_like(x)
        collectives.all_reduce_(x)  # engine set-up happens on the first call, not in the timing
        inner = _inner_for(nbytes)
        # small messages are cheap: more repeats there, where one descheduling skews a sample most
        reps = repeats * 3 if nbytes <= (1 << 20) else repeats if nbytes < (16 << 20) else max(3, repeats // 2)
        ours = lambda: collectives.all_reduce_(x)  # noqa: E731
        gloo = lambda: dist.all_reduce(x)  # noqa: E731
        # the floor for this size on this machine: one local copy of the message (an all-reduce
        # through shared memory moves it about four times per rank: copy in, reduce from the
        # peers' slots, publish, copy the peers' parts out)
        copy = lambda: y.copy_(x)  # noqa: E731
        for fn in (ours, gloo, copy, ours, gloo, copy):  # warm-up
            fn()
        # Paired samples, interleaved: the machine is shared, and its load changes within seconds,
        # so each repeat times llmmem, gloo and the copy back to back and the ratio compares like
        # with like. Every rank runs the same sequence (the collectives must match).
        s_ours, s_gloo, s_copy = [], [], []
        for _ in range(reps):
            dist.barrier()
            s_ours.append(sample(ours, inner))
            s_gloo.append(sample(gloo, inner))
            s_copy.append(sample(copy, inner))
        rows.append(
            {
                "bytes": nbytes,
                "llmmem_s": statistics.median(s_ours),
                "gloo_s": statistics.median(s_gloo),
                "copy_s": statistics.median(s_copy),
                "repeats": reps,
                "paired_speedup_median": statistics.median(g / o for g, o in zip(s_gloo, s_ours)),
            }
        )
    if rank == 0:
        print_rank_result(rows)


def _cuda_rank(rank, world, sizes, repeats):
    import torch
    import torch.distributed as dist
    from _harness import print_rank_result, time_fn

    from llmmem.parallel.cuda_ipc import CudaIpcCommunicator

    torch.cuda.set_device(0)
    comm = CudaIpcCommunicator.setup(dist.group.WORLD, torch.device("cuda", 0), timeout=30.0, max_bytes=max(sizes))
    rows = []
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        for nbytes in sizes:
            n = nbytes // torch.tensor([], dtype=dtype).element_size()
            g = torch.Generator().manual_seed(rank * 7919 + n)
            host = torch.randn(n, generator=g).to(dtype)
            everyone = [torch.empty_like(host) for _ in range(world)]
            dist.all_gather(everyone, host)
            want = sum(e.float() for e in everyone).to(dtype)  # fp32 sum in rank order, rounded once
            x = host.cuda()
            comm.all_reduce_(x)
            comm.check()
            ok = torch.equal(x.cpu(), want)
            row = {"dtype": str(dtype).replace("torch.", ""), "bytes": nbytes, "correct": ok}
            if dtype == torch.float32:
                z = torch.zeros(n, device="cuda")
                dist.barrier()
                row["llmmem_s"] = time_fn(lambda: comm.all_reduce_(z), repeats=repeats, device="cuda", inner=20)[
                    "median_s"
                ]
                comm.check()
                dist.barrier()
                row["gloo_s"] = time_fn(
                    lambda: dist.all_reduce(z), repeats=max(3, repeats // 2), device="cuda", inner=2
                )["median_s"]
            rows.append(row)
    comm.close()
    if rank == 0:
        print_rank_result(rows)


def _copy_bandwidth(nbytes: int = 64 << 20) -> float:
    import torch
    from _harness import time_fn

    src, dst = torch.ones(nbytes // 4), torch.empty(nbytes // 4)
    t = time_fn(lambda: dst.copy_(src), repeats=5, warmup=1)["median_s"]
    return 2 * nbytes / t  # read + write


def _human(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def _print_spread(world: int, launches: list) -> None:
    """Per size: the lowest, median and highest of the launches' medians, and of their speed-ups."""
    import statistics

    from _harness import print_table

    def spread(values):
        return " / ".join(
            f"{v:.3g}" if v < 1000 else f"{v:.0f}" for v in (min(values), statistics.median(values), max(values))
        )

    table = []
    for i, first in enumerate(launches[0]):
        rows = [rows[i] for rows in launches]
        table.append(
            [
                _human(first["bytes"]),
                spread([r["llmmem_s"] * 1e6 for r in rows]),
                spread([r["gloo_s"] * 1e6 for r in rows]),
                spread([r["gloo_s"] / r["llmmem_s"] for r in rows]),
            ]
        )
    print_table(
        f"fp32 all-reduce, {world} ranks: min / median / max over {len(launches)} launches",
        ["size", "llmmem us", "gloo us", "speed-up"],
        table,
    )


def main(argv=None) -> int:
    from _harness import print_table, rank_result, write_json

    from llmmem.parallel.ranks import run_ranks

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    p.add_argument("--quick", action="store_true")
    p.add_argument("--ranks", type=int, nargs="*", default=None)
    p.add_argument(
        "--launches",
        type=int,
        default=1,
        help="CPU: start the ranks this many times and also print the spread over the launches",
    )
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.launches < 1:
        p.error("--launches must be >= 1")
    payload = {}
    if a.device == "cpu":
        sizes = (
            [4 << 10, 64 << 10, 1 << 20, 16 << 20]
            if a.quick
            else [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20, 64 << 20]
        )
        repeats = 5 if a.quick else 9
        copy_bw = _copy_bandwidth()
        payload["copy_bandwidth_Bps"] = copy_bw
        for world in a.ranks or ([2] if a.quick else [2, 4]):
            launches = []
            for launch in range(a.launches):
                t0 = time.time()
                res = run_ranks(
                    __file__, "_cpu_rank", world, args=(sizes, repeats), timeout=600, env={"LLMMEM_TP_TIMEOUT": "120"}
                )
                rows = rank_result(res[0].output)
                launches.append(rows)
                table = []
                for r in rows:
                    bus = 2 * (world - 1) / world * r["bytes"]
                    table.append(
                        [
                            _human(r["bytes"]),
                            r["llmmem_s"] * 1e6,
                            r["gloo_s"] * 1e6,
                            r["gloo_s"] / r["llmmem_s"],
                            r["paired_speedup_median"],
                            bus / r["llmmem_s"] / 1e9,
                            bus / r["gloo_s"] / 1e9,
                            r["copy_s"] * 1e6,
                            r["llmmem_s"] / r["copy_s"],
                        ]
                    )
                which = f", launch {launch + 1} of {a.launches}" if a.launches > 1 else ""
                print_table(
                    f"fp32 all-reduce, {world} ranks on one host with {os.cpu_count()} CPUs (copy bandwidth "
                    f"{copy_bw / 1e9:.1f} GB/s at 64 MiB; {time.time() - t0:.0f} s{which})",
                    [
                        "size",
                        "llmmem us",
                        "gloo us",
                        "speed-up",
                        "paired speed-up",
                        "llmmem busbw GB/s",
                        "gloo busbw GB/s",
                        "1 copy us",
                        "llmmem / copy",
                    ],
                    table,
                )
            if a.launches > 1:
                _print_spread(world, launches)
            payload[f"ranks_{world}"] = launches[0]
            if a.launches > 1:
                payload[f"ranks_{world}_launches"] = launches
    else:
        sizes = [4 << 10, 64 << 10, 256 << 10, 512 << 10]
        res = run_ranks(__file__, "_cuda_rank", 2, args=(sizes, 5 if a.quick else 9), timeout=300)
        rows = rank_result(res[0].output)
        print_table(
            "CUDA IPC one-shot all-reduce, 2 processes sharing GPU 0",
            ["dtype", "size", "bitwise = fp32 CPU sum", "llmmem us", "gloo us"],
            [
                [
                    r["dtype"],
                    _human(r["bytes"]),
                    r["correct"],
                    r.get("llmmem_s", float("nan")) * 1e6,
                    r.get("gloo_s", float("nan")) * 1e6,
                ]
                for r in rows
            ],
        )
        payload["cuda_2_procs_1_gpu"] = rows
        if not all(r["correct"] for r in rows):
            print("FAILED: the IPC all-reduce differs from the reference")
            return 1
    path = write_json("comm", payload, a.json)
    print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
