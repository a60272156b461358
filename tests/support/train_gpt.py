"""Running examples/train_gpt.py as its users do: as a command, or its ``main(argv)`` several times
in one fresh process (a torch import per run would cost seconds)."""

from __future__ import annotations

import importlib.util
import json
import pathlib
import subprocess
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[2]
TRAIN = ROOT / "examples" / "train_gpt.py"
CHECKPOINTS = ROOT / "examples" / "train_gpt_checkpoints.py"
SMALL = ["--layers", "2", "--hidden", "32", "--heads", "2", "--seq-len", "32", "--batch", "4", "--threads", "1"]


def load_example(path: pathlib.Path = TRAIN, name: str = "train_gpt_example"):
    """The example file at ``path`` as a module (examples/ is no package)."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def run_code(code: str, timeout: float) -> subprocess.CompletedProcess:
    """``python -c code`` away from the checkout: ``-c`` puts the working directory first on
    sys.path, and a source tree need not hold a built core (CI installs llmmem with pip and runs
    tests from a clean clone)."""
    return subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout, cwd=tempfile.gettempdir()
    )


def main_runs(runs: list[list[str]], timeout=300) -> subprocess.CompletedProcess:
    """``main(argv)`` of the script for each argv, in one fresh process; a SystemExit is printed as
    ``exit CODE: message`` and the next run goes on."""
    code = (
        "import importlib.util, sys\n"
        f"spec = importlib.util.spec_from_file_location('train_gpt_example', {str(TRAIN)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        f"for argv in {runs!r}:\n"
        "    try:\n"
        "        print('exit', m.main(argv), flush=True)\n"
        "    except SystemExit as e:\n"
        "        print('exit', e.code if isinstance(e.code, int) else 1, e.code, flush=True)\n"
    )
    return run_code(code, timeout)


def captured_runs(runs: list[list[str]], timeout=300) -> list[dict]:
    """Like :func:`main_runs`, each run's own output apart: a list of ``{"code", "stdout",
    "stderr"}``, ``code`` being main's return value or the SystemExit's code, and a SystemExit's
    message the last line of ``stderr`` (as Python prints it). Another exception fails the call."""
    code = (
        "import contextlib, importlib.util, io, json, sys\n"
        f"spec = importlib.util.spec_from_file_location('train_gpt_example', {str(TRAIN)!r})\n"
        "m = importlib.util.module_from_spec(spec); spec.loader.exec_module(m)\n"
        "results = []\n"
        f"for argv in {runs!r}:\n"
        "    out, err = io.StringIO(), io.StringIO()\n"
        "    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):\n"
        "        try:\n"
        "            rc = m.main(argv)\n"
        "        except SystemExit as e:\n"
        "            rc = e.code if isinstance(e.code, int) or e.code is None else 1\n"
        "            if not isinstance(e.code, int) and e.code is not None:\n"
        "                print(e.code, file=sys.stderr)\n"
        "    results.append({'code': rc or 0, 'stdout': out.getvalue(), 'stderr': err.getvalue()})\n"
        "print(json.dumps(results))\n"
    )
    proc = run_code(code, timeout)
    if proc.returncode != 0:
        raise AssertionError(f"train_gpt runs failed (exit {proc.returncode}):\n{proc.stderr[-4000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def run_ranks_here(test_file: str, fn: str, world_size: int, args: tuple = (), **kwargs):
    """:func:`llmmem.parallel.ranks.run_ranks` for a test file that imports tests/support/ (as this
    conftest lets the tests do): the ranks get the tests' folder on their path too."""
    import os

    from llmmem.parallel.ranks import run_ranks

    here = str(pathlib.Path(__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    return run_ranks(test_file, fn, world_size, args=args, env={"PYTHONPATH": path}, **kwargs)
