"""The files of ``python -m llmmem compare``: ``results.json`` and ``results.md``, rewritten after every
row (each replace is atomic, so both are always whole and valid), marked ``"partial"`` until the last
row is in; and what ``--resume`` needs from a previous run's ``results.json``.

Rows are opaque here: any dict with a ``"key"`` (the strategy's) is written and kept, whatever a row
measures. A row is kept on resume when it is a result (no ``error``, or ``infeasible``: the planner's
answer); failed rows run again. No torch here.
"""

from __future__ import annotations

import json
import os

__all__ = [
    "RESULTS",
    "TABLE",
    "OUTPUTS",
    "write_atomic",
    "load_for_resume",
    "partial_rows",
    "kept_rows",
    "settings_diff",
]

RESULTS, TABLE = "results.json", "results.md"
OUTPUTS = (RESULTS, TABLE, "memory_timeline.png", "saved_vs_overhead.png")


def write_atomic(path: str, text: str) -> None:
    """Writes ``text`` to ``path`` through a temporary file renamed over it: a reader, or a run cut
    off at any point, sees the old file or the new one, never half of one."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def settings_diff(saved: dict, now: dict) -> list[str]:
    """``"name: A there, B now"`` for every setting that differs."""
    out = []
    for key in sorted(set(saved) | set(now)):
        if saved.get(key) != now.get(key):
            if isinstance(saved.get(key), dict) and isinstance(now.get(key), dict):
                out += [f"{key}.{d}" for d in settings_diff(saved[key], now[key])]
            else:
                out.append(f"{key}: {saved.get(key)!r} there, {now.get(key)!r} now")
    return out


def load_for_resume(folder: str, settings: dict) -> dict:
    """The results of an earlier run in ``folder`` to continue, after checking they were measured
    with ``settings``.

    :raises ValueError: (naming ``--resume``) when there is no results file, it cannot be read, it
        is not a resumable run's, or its settings differ (each difference named).
    """
    path = os.path.join(folder, RESULTS)
    try:
        with open(path) as f:
            previous = json.load(f)
    except FileNotFoundError:
        raise ValueError(f"--resume: no {RESULTS} in {folder} to continue (run without --resume)") from None
    except (OSError, ValueError) as exc:
        raise ValueError(f"--resume: cannot read {path}: {exc}") from None
    if not isinstance(previous, dict) or not isinstance(previous.get("settings"), dict):
        raise ValueError(f"--resume: {path} was not written by a resumable run (no settings recorded)")
    if not isinstance(previous.get("rows"), list):
        raise ValueError(f"--resume: {path} has no list of rows")
    diff = settings_diff(previous["settings"], settings)
    if diff:
        raise ValueError(
            f"--resume: {path} was measured with other settings ({'; '.join(diff)}); rows measured apart "
            f"must share them: rerun with the flags of `{previous.get('command', '?')}`, or without --resume "
            "(in another --out to keep these)"
        )
    return previous


def partial_rows(folder: str) -> int:
    """Rows of an interrupted run's results in ``folder`` (0: none, complete, or unreadable)."""
    try:
        with open(os.path.join(folder, RESULTS)) as f:
            data = json.load(f)
    except (OSError, ValueError):
        return 0
    if not isinstance(data, dict) or not data.get("partial") or not isinstance(data.get("rows"), list):
        return 0
    return len(data["rows"])


def kept_rows(previous: dict, keys) -> dict:
    """key -> row of ``previous`` to keep: results (not failures) of the strategies in ``keys``, and
    none at all without a baseline row (the others were measured against its peak)."""
    rows = {
        r["key"]: r
        for r in previous.get("rows", [])
        if isinstance(r, dict) and r.get("key") in keys and (not r.get("error") or r.get("infeasible"))
    }
    return rows if "baseline" in rows else {}
