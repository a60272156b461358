"""What each memory technique saves, by the estimator: one row per technique added on top of the last.

    python examples/estimate_sweep.py llama-7b --batch 1 --seq 4096 --devices 8

Pure arithmetic (llmmem.estimate); needs neither torch nor a GPU for named models.
"""

from __future__ import annotations

import argparse

import llmmem
from llmmem.units import format_bytes


def sweep(model: str, batch: int, seq: int, devices: int) -> list[tuple[str, dict]]:
    steps = [
        ("fp32, Adam, nothing else", dict(precision="fp32")),
        ("+ bf16 mixed precision", dict(precision="bf16-mixed")),
        ("+ fused attention (sdpa)", dict(attention="sdpa")),
        ("+ selective recompute", dict(checkpointing="selective")),
        ("+ full recompute", dict(checkpointing="full")),
        (f"+ ZeRO-1 over {devices} ranks", dict(zero_stage=1, data_parallel=devices)),
        (f"+ ZeRO-3 over {devices} ranks", dict(zero_stage=3)),
    ]
    settings: dict = {}
    rows = []
    for label, change in steps:
        settings.update(change)
        rows.append((label, llmmem.estimate(model, batch=batch, seq=seq, **settings).to_dict()["bytes"]))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model", nargs="?", default="llama-7b")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--seq", type=int, default=4096)
    parser.add_argument("--devices", type=int, default=8)
    args = parser.parse_args()
    rows = sweep(args.model, args.batch, args.seq, args.devices)
    print(f"{args.model}, batch {args.batch} x seq {args.seq}: per-device memory")
    print(f"  {'set-up':<32}{'model state':>14}{'activations':>14}{'total':>14}{'saved':>12}")
    previous = None
    for label, b in rows:
        state = b["parameters"] + b["gradients"] + b["master_weights"] + b["optimizer_state"]
        saved = "" if previous is None else format_bytes(previous - b["total"])
        print(
            f"  {label:<32}{format_bytes(state):>14}{format_bytes(b['activations']):>14}"
            f"{format_bytes(b['total']):>14}{saved:>12}"
        )
        previous = b["total"]


if __name__ == "__main__":
    main()
