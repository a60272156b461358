"""One runner for the benchmarks: ``python benchmarks/run.py [--only NAME ...] [--device cpu|cuda] [--quick]``.

Each ``benchmarks/bench_<name>.py`` defines ``main(argv) -> int`` that accepts ``--device``,
``--quick`` and ``--json PATH``, prints its table and writes JSON under benchmarks/results/.
"""

from __future__ import annotations

import argparse
import glob
import importlib.util
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def available() -> dict[str, str]:
    return {os.path.basename(p)[len("bench_") : -3]: p for p in sorted(glob.glob(os.path.join(HERE, "bench_*.py")))}


def main(argv: list[str] | None = None) -> int:
    benches = available()
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--only", nargs="*", choices=sorted(benches), help="run only these benchmarks")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--quick", action="store_true", help="smaller sizes and fewer repeats")
    parser.add_argument("--list", action="store_true", help="list the benchmarks and exit")
    args = parser.parse_args(argv)
    if args.list:
        print("\n".join(benches))
        return 0
    sys.path.insert(0, HERE)  # so bench files can `import _harness`
    failed = []
    for name in args.only or benches:
        spec = importlib.util.spec_from_file_location(f"bench_{name}", benches[name])
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)
        sub = ["--device", args.device] + (["--quick"] if args.quick else [])
        print(f"\n=== {name} ({args.device}) ===", flush=True)
        if mod.main(sub) != 0:
            failed.append(name)
    if failed:
        print(f"\nfailed: {', '.join(failed)}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
