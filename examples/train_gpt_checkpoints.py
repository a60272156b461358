"""Checkpoint sets of ``train_gpt.py``: every rank's file of one step, or nothing.

A set is a folder ``step-NNNNNNNN`` in the ``--save`` folder, holding ``rank{r}.pt`` for every rank
and ``MANIFEST.json``: the step, the layout, each file's size and sha256, and the manifest's own
sha256. A save (every rank calls :func:`save_set`; it is a collective) goes like this:

1. rank 0 makes ``step-NNNNNNNN.partial`` (removing one that a killed run left);
2. every rank writes its file there under a temporary name, fsyncs it, renames it, fsyncs the
   folder, and reports the file's size and digest to every rank;
3. rank 0 writes the manifest the same way, then renames the folder to ``step-NNNNNNNN``: the set
   becomes current in one rename; then it removes the sets and unfinished folders no longer needed.

A kill at any point leaves the earlier sets as they were and the new one complete or absent.
Resuming (:func:`choose_set`, also a collective) takes the newest set that every rank finds whole:
each rank checks the manifest and the digests of the files it will load, the ranks exchange their
verdicts, and all take that set, or all fall back to the previous one, or all stop. A rank waits
for the others no longer than the process group's timeout.

``TRAIN_GPT_FAULT=RANK:STEP:POINT`` makes rank RANK SIGKILL itself at POINT of its save of step
STEP: ``start`` (the folder is made), ``write`` (4 KiB of its file written), ``rename`` (its file
written and fsynced, not renamed), ``commit`` (rank 0: the manifest written, the folder not yet
renamed) or ``prune`` (rank 0: the set current, the old ones not yet removed). It is how the
tests kill a save exactly where they mean to.

What a rank's file must hold to be resumed from is checked here too (:func:`load_rank_state`):
``train_gpt.py``'s training state, every model entry of the model's shape, dtype and finite.

Not llmmem's API: a helper of the example, kept beside it.
"""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import re
import shutil
import signal
from dataclasses import dataclass, field
from typing import Any, Callable

FORMAT = "train_gpt checkpoint set 1"
MANIFEST = "MANIFEST.json"
PARTIAL = ".partial"  # a save in progress, or one a killed run left
STALE = ".stale"  # a set being replaced by a new save of the same step
_SET = re.compile(r"^step-(\d{8,})$")
_UNFINISHED = re.compile(r"^step-(\d{8,})(\.partial|\.stale)$")
STATE_KEYS = ("step", "model", "optimizer", "scaler", "sampler", "rng")  # of a rank's file
FAULT_ENV = "TRAIN_GPT_FAULT"
FAULT_POINTS = ("start", "write", "rename", "commit", "prune")
_CHUNK = 1 << 20  # bytes read at a time when hashing

# every rank's object in rank order, on every rank: torch.distributed.all_gather_object's contract
Gather = Callable[[Any], list]


class CheckpointError(Exception):
    """A save or a resume that cannot go on; the message is one line."""


class Damaged(CheckpointError):
    """A set that is not whole (a file missing, changed, unloadable): resume falls back past it."""


class Refused(CheckpointError):
    """A set that is whole but must not be resumed from here (another layout or model): every rank stops."""


def set_name(step: int) -> str:
    return f"step-{step:08d}"


# ------------------------------------------------------------------------------------------------
# Saving


def save_set(
    root: pathlib.Path, step: int, state: dict, *, rank: int, gather: Gather, meta: dict, keep: int
) -> list[str]:
    """Write this rank's ``state`` (``torch.save``) into the set of ``step`` under ``root`` and,
    once every rank has, make the set current. Every rank calls it. ``meta`` (JSON) goes into the
    manifest; ``keep`` complete sets stay (this one and ``keep - 1`` before it). Returns, on rank 0,
    the sets removed because they were ahead of ``step`` (an earlier run's, now superseded).

    :raises CheckpointError: on every rank when any rank could not write (the message names it).
    """
    root = pathlib.Path(root)
    final = root / set_name(step)
    partial = final.with_name(final.name + PARTIAL)
    error = None
    if rank == 0:
        try:
            root.mkdir(parents=True, exist_ok=True)
            _remove(partial)
            partial.mkdir()
            _fsync_dir(root)
        except OSError as exc:
            error = _os_error(exc)
    _raise_first(gather(error))  # no rank writes before the folder exists
    _fault(rank, step, "start")
    entry = error = None
    name = f"rank{rank}.pt"
    try:
        entry = _write_file(partial, name, state, rank, step)
    except OSError as exc:
        error = _os_error(exc)
    reports = gather((name, entry, error))
    _raise_first([e for _, _, e in reports])
    removed: list[str] = []
    if rank == 0:
        try:
            manifest = dict(meta, format=FORMAT, step=step, files={n: e for n, e, _ in reports})
            _write_atomically(partial / MANIFEST, json.dumps(_sealed(manifest), indent=1).encode())
            _fault(rank, step, "commit")
            if final.exists():  # a set of this step from an earlier run: replaced, never mixed
                stale = final.with_name(final.name + STALE)
                _remove(stale)
                os.replace(final, stale)
            os.replace(partial, final)
            _fsync_dir(root)
            _fault(rank, step, "prune")
            removed = _prune(root, step, keep)
        except OSError as exc:
            error = _os_error(exc)
    _raise_first(gather(error))  # no rank goes on before the set is current
    return removed


class _Digesting:
    """A file object for ``torch.save`` that counts and hashes the bytes on their way to ``f``."""

    def __init__(self, f, rank: int, step: int) -> None:
        self.f, self.rank, self.step = f, rank, step
        self.size, self.sha = 0, hashlib.sha256()

    def write(self, data) -> int:
        self.sha.update(data)
        self.size += len(data)
        n = self.f.write(data)
        if self.size >= 4096:
            self.f.flush()  # so that the killed rank leaves a part-written file, as a real kill would
            _fault(self.rank, self.step, "write")
        return n

    def flush(self) -> None:
        self.f.flush()


def _write_file(folder: pathlib.Path, name: str, state: dict, rank: int, step: int) -> dict:
    import torch

    tmp = folder / (name + ".tmp")
    with open(tmp, "wb") as f:
        out = _Digesting(f, rank, step)
        torch.save(state, out)
        f.flush()
        os.fsync(f.fileno())
    _fault(rank, step, "rename")
    os.replace(tmp, folder / name)
    _fsync_dir(folder)
    return {"bytes": out.size, "sha256": out.sha.hexdigest()}


def _write_atomically(path: pathlib.Path, data: bytes) -> None:
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _fsync_dir(folder: pathlib.Path) -> None:
    """A rename is durable only once its folder is synced."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _prune(root: pathlib.Path, step: int, keep: int) -> list[str]:
    """Remove unfinished folders, the complete sets before the newest ``keep`` (this one among
    them), and the sets ahead of ``step``: a run resumed from an earlier set has superseded them."""
    sets = sorted((int(m.group(1)), p) for p in root.iterdir() if (m := _SET.match(p.name)) and p.is_dir())
    older = [p for s, p in sets if s < step]
    ahead = [p for s, p in sets if s > step]
    doomed = older[: max(0, len(older) - (keep - 1))] + ahead
    doomed += [p for p in root.iterdir() if _UNFINISHED.match(p.name) and p.is_dir()]
    for p in doomed:
        _remove(p)
    if doomed:
        _fsync_dir(root)
    return [str(p) for p in ahead]


def _remove(path: pathlib.Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    elif path.exists() or path.is_symlink():
        path.unlink()


def _fault(rank: int, step: int, point: str) -> None:
    spec = os.environ.get(FAULT_ENV)
    if not spec:
        return
    parts = spec.split(":")
    if len(parts) != 3 or not parts[0].isdigit() or not parts[1].isdigit() or parts[2] not in FAULT_POINTS:
        raise CheckpointError(
            f"{FAULT_ENV}={spec!r}: expected RANK:STEP:POINT, POINT one of {', '.join(FAULT_POINTS)}"
        )
    if (int(parts[0]), int(parts[1]), parts[2]) == (rank, step, point):
        os.kill(os.getpid(), signal.SIGKILL)


def _os_error(exc: OSError) -> str:
    return f"{exc.filename}: {exc.strerror}" if exc.filename and exc.strerror else str(exc)


def _raise_first(errors: list) -> None:
    for rank, error in enumerate(errors):
        if error:
            raise CheckpointError(f"rank {rank}: {error}")


# ------------------------------------------------------------------------------------------------
# Reading


def _sealed(manifest: dict) -> dict:
    body = {k: v for k, v in manifest.items() if k != "sha256"}
    return dict(body, sha256=hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest())


def seal_manifest(path: pathlib.Path, manifest: dict) -> None:
    """Write ``manifest`` to ``path`` with its own digest, atomically (as a save does)."""
    _write_atomically(pathlib.Path(path), json.dumps(_sealed(manifest), indent=1).encode())


def read_manifest(folder: pathlib.Path) -> dict:
    """The manifest of the set in ``folder``, checked against its own digest and the folder's name.

    :raises Damaged: naming the manifest and what is wrong with it.
    """
    path = pathlib.Path(folder) / MANIFEST
    try:
        data = json.loads(path.read_bytes())
    except FileNotFoundError:
        raise Damaged(f"{path}: missing (not a finished save)") from None
    except OSError as exc:
        raise Damaged(f"{path}: unreadable ({exc.strerror or exc})") from None
    except ValueError as exc:
        raise Damaged(f"{path}: not valid JSON ({exc})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        found = data.get("format") if isinstance(data, dict) else type(data).__name__
        raise Damaged(f"{path}: not a train_gpt.py checkpoint manifest (format {found!r}, expected {FORMAT!r})")
    if _sealed(data).get("sha256") != data.get("sha256"):
        raise Damaged(f"{path}: its sha256 does not match its content (the file changed after the save)")
    m = _SET.match(pathlib.Path(folder).name)
    if not isinstance(data.get("step"), int) or isinstance(data.get("step"), bool):
        raise Damaged(f"{path}: its step is {data.get('step')!r}, not a number of steps")
    if m and data.get("step") != int(m.group(1)):
        raise Damaged(f"{path}: holds step {data.get('step')!r}, in a folder named for step {int(m.group(1))}")
    files = data.get("files")
    if not isinstance(files, dict) or not all(
        isinstance(e, dict) and isinstance(e.get("bytes"), int) and isinstance(e.get("sha256"), str)
        for e in files.values()
    ):
        raise Damaged(f"{path}: its 'files' entry is not a table of sizes and sha256 digests")
    return data


def verified_file(folder: pathlib.Path, manifest: dict, name: str) -> pathlib.Path:
    """``folder/name``, after checking its size and sha256 against ``manifest``.

    Reads the whole file once (1 MiB at a time).

    :raises Damaged: naming the file and what is wrong with it.
    """
    path = pathlib.Path(folder) / name
    entry = manifest["files"].get(name)
    if entry is None:
        raise Damaged(f"{path}: not in the manifest (saved by {len(manifest['files'])} ranks)")
    try:
        size = path.stat().st_size
        if size != entry["bytes"]:
            raise Damaged(f"{path}: {size:,} bytes, the manifest says {entry['bytes']:,} (truncated or replaced)")
        sha = hashlib.sha256()
        with open(path, "rb") as f:
            while chunk := f.read(_CHUNK):
                sha.update(chunk)
    except FileNotFoundError:
        raise Damaged(f"{path}: missing") from None
    except OSError as exc:
        raise Damaged(f"{path}: unreadable ({exc.strerror or exc})") from None
    if sha.hexdigest() != entry["sha256"]:
        raise Damaged(f"{path}: its sha256 is not the manifest's (the file changed after the save)")
    return path


@dataclass
class Chosen:
    """The set every rank resumes from."""

    path: pathlib.Path
    manifest: dict
    value: Any  # what ``check`` returned on this rank
    skipped: list[str] = field(default_factory=list)  # newer sets that were not whole, and why
    unfinished: list[str] = field(default_factory=list)  # newer saves that never finished


def choose_set(source: pathlib.Path, *, gather: Gather, check: Callable[[pathlib.Path, dict], Any]) -> Chosen:
    """The newest set in ``source`` (a ``--save`` folder, or one set's folder) that every rank
    finds whole. Every rank calls it; for each candidate, newest first, each rank runs
    ``check(folder, manifest)`` (which loads what this rank needs, raising :class:`Damaged` or
    :class:`Refused`), then the ranks exchange verdicts: all take the set, or all try the one
    before, or all stop.

    :raises Refused: on every rank, when some rank refused the set, or no set is whole.
    """
    source = pathlib.Path(source)
    listing = gather(_listing(source))[0]  # rank 0's view, so that every rank tries the same sets
    skipped: list[str] = []
    for name in listing["sets"]:
        folder = source / name if name else source
        verdict: tuple[str, Any] = ("ok", None)
        value = manifest = None
        try:
            manifest = read_manifest(folder)
            value = check(folder, manifest)
        except Refused as exc:
            verdict = ("refused", str(exc))
        except Damaged as exc:
            verdict = ("damaged", str(exc))
        except Exception as exc:  # stop together rather than leave the other ranks waiting
            verdict = ("refused", f"{folder}: {type(exc).__name__}: {exc}")
        verdicts = gather(verdict)
        refused = [msg for kind, msg in verdicts if kind == "refused"]
        if refused:
            raise Refused(refused[0])
        damaged = list(dict.fromkeys(msg for kind, msg in verdicts if kind == "damaged"))
        if not damaged:
            newer = [u for u in listing["unfinished"] if _step_of(u) > _step_of(folder.name)]
            return Chosen(folder, manifest, value, skipped, newer)
        skipped.append("; ".join(damaged))
    if skipped:
        raise Refused("no whole checkpoint set: " + "; ".join(skipped))
    found = f"no checkpoint set (a step-NNNNNNNN folder with a {MANIFEST}) in {source}"
    if listing["unfinished"]:
        found += f"; unfinished saves, ignored: {', '.join(listing['unfinished'])}"
    if listing["legacy"]:
        found += "; its rank*.pt files are an earlier train_gpt.py's format, which has no digests to check"
    raise Refused(found)


def _listing(source: pathlib.Path) -> dict:
    if (source / MANIFEST).exists() or _SET.match(source.name):
        return {"sets": [""], "unfinished": [], "legacy": False}
    try:
        entries = [p for p in source.iterdir() if p.is_dir()]
        legacy = any(p.name.startswith("rank") and p.suffix == ".pt" for p in source.iterdir())
    except OSError:
        entries, legacy = [], False
    sets = sorted((p.name for p in entries if _SET.match(p.name)), key=_step_of, reverse=True)
    unfinished = sorted(p.name for p in entries if _UNFINISHED.match(p.name))
    return {"sets": sets, "unfinished": unfinished, "legacy": legacy}


def _step_of(name: str) -> int:
    m = re.match(r"^step-(\d+)", name)
    return int(m.group(1)) if m else -1


# ------------------------------------------------------------------------------------------------
# What a rank's file holds


def load_rank_state(path: pathlib.Path, manifest: dict, expected: dict, device) -> dict:
    """The training state in ``path`` (a file :func:`verified_file` passed), checked against the
    model's ``expected`` state dict: every entry there, of its shape and dtype, and finite.

    :raises Damaged: naming the file and what is wrong with its content.
    """
    import zipfile

    import torch

    if not zipfile.is_zipfile(path):  # torch.save writes a zip archive; torch.load would try a pickle
        raise Damaged(f"{path}: not a loadable torch file (not the zip archive torch.save writes)")
    try:
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as exc:  # torch raises many kinds for a file that is not its format
        raise Damaged(f"{path}: not a loadable torch file ({first_line(exc)[:160]})") from None
    if not isinstance(state, dict):
        raise Damaged(f"{path}: holds a {type(state).__name__}, not a train_gpt.py training state")
    missing = [k for k in STATE_KEYS if k not in state]
    if missing:
        raise Damaged(f"{path}: not a train_gpt.py training state: no {', '.join(map(repr, missing))}")
    if state["step"] != manifest["step"]:
        raise Damaged(f"{path}: holds step {state['step']!r}, the manifest says {manifest['step']}")
    weights = state["model"]
    if not isinstance(weights, dict):
        raise Damaged(f"{path}: its model state is a {type(weights).__name__}, not a state dict")
    missing, unexpected = [k for k in expected if k not in weights], [k for k in weights if k not in expected]
    if missing or unexpected:
        more = " (and more)" if len(missing) > 3 or len(unexpected) > 3 else ""
        raise Damaged(
            f"{path}: its model state does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}{more}"
        )
    for key, want in expected.items():
        got = weights[key]
        if not isinstance(got, torch.Tensor) or got.shape != want.shape or got.dtype != want.dtype:
            shown = f"{tuple(got.shape)} {got.dtype}" if isinstance(got, torch.Tensor) else type(got).__name__
            raise Damaged(f"{path}: model entry {key!r} is {shown}, the model's is {tuple(want.shape)} {want.dtype}")
        if got.is_floating_point() and not bool(torch.isfinite(got).all()):
            raise Damaged(f"{path}: model entry {key!r} holds NaN or infinite values")
    if not isinstance(state["sampler"], dict) or not isinstance(state["sampler"].get("generator"), torch.Tensor):
        raise Damaged(f"{path}: its data sampler state holds no generator state")
    if not isinstance(state["rng"], dict) or not isinstance(state["rng"].get("cpu"), torch.Tensor):
        raise Damaged(f"{path}: its RNG state holds no CPU generator state")
    return state


def check_optimizer_state(path: pathlib.Path, state, optimizer) -> None:
    """``state`` (from ``path``) is an optimizer state dict with the groups of ``optimizer``.

    :raises Damaged: naming the file and what does not fit.
    """
    groups = state.get("param_groups") if isinstance(state, dict) else None
    if not isinstance(groups, list) or not isinstance(state.get("state"), dict):
        raise Damaged(f"{path}: holds no optimizer state")
    want = [len(g["params"]) for g in optimizer.param_groups]
    got = [len(g.get("params", ())) if isinstance(g, dict) else None for g in groups]
    if got != want:
        raise Damaged(f"{path}: its optimizer state has groups of {got} parameters, the run's {want}")


def first_line(exc: BaseException) -> str:
    """``Type: first line of the message``: torch's messages run to many lines."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
