"""Checks of the paths a command will write, made before its work starts, so that a run of minutes
does not end in a traceback over a folder that does not exist. No torch, no C core."""

from __future__ import annotations

import os
import tempfile

__all__ = ["check_output_file", "check_output_folder"]


def _why(exc: OSError) -> str:
    return exc.strerror or type(exc).__name__


def _blocker(path: str) -> str | None:
    """The nearest existing ancestor of ``path`` when it is a file (so no folder can be made below it)."""
    parent = os.path.dirname(os.path.abspath(path))
    while parent and not os.path.exists(parent):
        up = os.path.dirname(parent)
        if up == parent:
            return None
        parent = up
    return parent if parent and not os.path.isdir(parent) else None


def check_output_file(path, flag: str) -> str:
    """``path`` as a string, after checking that a file can be written there: not a folder, in a
    folder that exists, creatable (a file made to check is removed again; an existing file is
    opened for appending, not changed).

    :param flag: the option or argument named in the error (``"--json"``).
    :raises ValueError: naming ``flag``, the path and what is wrong.
    """
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{flag}: expected a file path, got an empty string")
    if os.path.isdir(path):
        raise ValueError(f"{flag}: {path} is a folder; expected a file path")
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        blocker = folder if os.path.exists(folder) else _blocker(folder)
        if blocker is not None:
            raise ValueError(f"{flag}: cannot write {path}: {blocker} is a file, not a folder")
        raise ValueError(f"{flag}: cannot write {path}: the folder {folder} does not exist")
    existed = os.path.exists(path)
    try:
        with open(path, "a"):
            pass
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write {path}: {_why(exc)}") from None
    if not existed:
        try:
            os.remove(path)
        except OSError:
            pass
    return path


def check_output_folder(path, flag: str) -> str:
    """``path`` as a string, after making the folder (and its parents) if needed and checking that
    a file can be created in it (one is made and removed).

    :param flag: the option or argument named in the error (``"--out"``).
    :raises ValueError: naming ``flag``, the path and what is wrong.
    """
    path = os.fspath(path)
    if not path:
        raise ValueError(f"{flag}: expected a folder, got an empty string")
    if os.path.exists(path) and not os.path.isdir(path):
        raise ValueError(f"{flag}: {path} is a file; expected a folder")
    blocker = _blocker(path)
    if blocker is not None:
        raise ValueError(f"{flag}: cannot make the folder {path}: {blocker} is a file, not a folder")
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as exc:
        raise ValueError(f"{flag}: cannot make the folder {path}: {_why(exc)}") from None
    try:
        fd, probe = tempfile.mkstemp(dir=path, prefix=".llmmem-write-check-")
    except OSError as exc:
        raise ValueError(f"{flag}: cannot write in the folder {path}: {_why(exc)}") from None
    os.close(fd)
    os.remove(probe)
    return path
