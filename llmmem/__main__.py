"""Command line: ``python -m llmmem {info, estimate, compare} ...``.

Each subcommand lives with its feature; this file only dispatches, importing a feature's module
when its subcommand is chosen so that ``info`` works even where torch is broken.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing register_cli(subparsers), which adds a parser whose
# defaults carry `func(args) -> int`.
_SUBCOMMANDS = {
    "info": "llmmem.diagnostics.info",
    "estimate": "llmmem.estimation.cli",
    "profile": "llmmem.diagnostics.profile_cli",
    "compare": "llmmem.compare.cli",
}


def build_parser(argv: list[str]) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m llmmem", description="llmmem: train LLMs in less memory.")
    sub = parser.add_subparsers(dest="command", metavar="{" + ",".join(_SUBCOMMANDS) + "}")
    chosen = next((a for a in argv if not a.startswith("-")), None)
    for name, module in _SUBCOMMANDS.items():
        if chosen is None or chosen == name:
            importlib.import_module(module).register_cli(sub)
        else:  # listed in --help without importing the feature
            sub.add_parser(name)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser(argv)
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is None:
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except ValueError as exc:  # bad user input: one clear line, no traceback
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
