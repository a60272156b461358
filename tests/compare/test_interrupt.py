"""``python -m llmmem compare`` cut short by SIGTERM (``timeout``, CI, ``docker stop``) or SIGINT (Ctrl-C):
every worker process ends, the temporary folder goes, the rows measured so far stay in results.json
(valid, marked partial), and ``--resume`` measures the rest; bad ``--out`` folders and resumes with
other settings are one ``error:`` line before any work. Linux: processes are found through /proc."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
from support.procs import descendants, still_running

from llmmem.__main__ import main

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc: Linux only")


def _argv(out, flags):
    return [sys.executable, "-m", "llmmem", "compare", "--quick", "--no-charts", "--out", str(out), *flags]


def _env(tmp):
    tmp.mkdir(exist_ok=True)
    return dict(os.environ, TMPDIR=str(tmp))  # the run's temporary folders land here, to be counted


def _interrupt(tmp_path, flags, sig, *, processes):
    """Starts the comparison, waits until the orchestrator has at least ``processes`` descendants
    (servers, rows' children, ranks: counts reached only after the baseline row), sends ``sig``;
    returns the finished process, its output, those of its descendants still running, the output
    folder and the temporary one."""
    out, tmp = tmp_path / "out", tmp_path / "tmp"
    proc = subprocess.Popen(
        _argv(out, flags), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(tmp), cwd=tmp_path
    )
    seen = []
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            seen = descendants(proc.pid)
            if len(seen) >= processes:
                break
            time.sleep(0.02)
        if proc.poll() is not None:
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the comparison ended before it could be interrupted:\n{stdout}\n{stderr}")
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.communicate()
        left = still_running(seen)
        for pid in left:  # never leave them to the next test, whatever the outcome here
            os.kill(pid, signal.SIGKILL)
    return proc, stdout, stderr, left, out, tmp


def _check_interrupted(proc, stdout, stderr, left, out, tmp, sig):
    assert left == []  # servers, the rows' children and their ranks: all ended
    assert [p for p in os.listdir(tmp) if p.startswith("llmmem-")] == []  # the temporary folder is gone
    assert proc.returncode == 128 + sig, stderr
    assert "Traceback" not in stderr, stderr
    finished = re.findall(r"\[\s*\d+/\s*\d+\] (\S+)", stdout)  # the rows the run reported done
    data = json.loads((out / "results.json").read_text())  # valid JSON
    assert data["partial"] is True and [r["key"] for r in data["rows"]] == finished
    assert finished[0] == "baseline" and len(finished) < len(data["planned"])
    md = (out / "results.md").read_text()
    assert f"Partial: {len(finished)} of {len(data['planned'])} rows" in md
    name = signal.Signals(sig).name
    assert f"interrupted by {name} with {len(finished)} of {len(data['planned'])} rows measured" in stderr
    return data


def test_sigterm_during_a_parallel_row_ends_every_process_and_resume_finishes(tmp_path):
    # The report: SIGTERM killed the orchestrator alone; its worker server, the server's child and
    # the 4 ranks of a TP 2 x DP 2 row ran on, and the temporary folder stayed. Here the 2 ranks of
    # TP 2 + SP (a shorter row to resume): one server, its child, the ranks.
    flags = ["--only", "tp2+sp", "--jobs", "1"]
    proc, stdout, stderr, left, out, tmp = _interrupt(tmp_path, flags, signal.SIGTERM, processes=4)
    data = _check_interrupted(proc, stdout, stderr, left, out, tmp, signal.SIGTERM)
    assert "--resume" in stderr
    kept = {r["key"]: r for r in data["rows"]}

    # another setting is refused before any work, naming it; the partial results stay as they were
    assert main(["compare", "--quick", "--no-charts", "--out", str(out), *flags, "--steps", "5", "--resume"]) == 2
    assert json.loads((out / "results.json").read_text()) == data

    done = subprocess.run(
        _argv(out, flags) + ["--resume"], capture_output=True, text=True, timeout=600, env=_env(tmp), cwd=tmp
    )
    assert done.returncode == 0, done.stderr
    assert f"resuming: {len(kept)} row(s)" in done.stdout
    final = json.loads((out / "results.json").read_text())
    assert final["partial"] is False and [r["key"] for r in final["rows"]] == ["baseline", "tp2+sp"]
    for row in final["rows"]:
        if row["key"] in kept:  # kept as measured, not run again
            assert {k: v for k, v in row.items() if k != "derived"} == {
                k: v for k, v in kept[row["key"]].items() if k != "derived"
            }
    assert [r["rows"] for r in final["runs"]][-1] == [k for k in final["planned"] if k not in kept]
    assert final["targets"] and "Partial" not in (out / "results.md").read_text()


def test_sigint_during_two_rows_at_once_keeps_the_finished_rows(tmp_path):
    # The report: Ctrl-C after 9 of 13 rows cleaned up but wrote nothing. Here --quick runs two rows
    # at once (one server each): the signal lands while both children run.
    proc, stdout, stderr, left, out, tmp = _interrupt(
        tmp_path, ["--only", "every,selective"], signal.SIGINT, processes=4
    )
    _check_interrupted(proc, stdout, stderr, left, out, tmp, signal.SIGINT)


def test_bad_out_folders_are_one_line_before_any_work(tmp_path, capsys):
    a_file = tmp_path / "a-file"
    a_file.write_text("")
    cases = {
        str(a_file): "is a file; expected a folder",
        str(a_file / "sub"): "is a file, not a folder",
        "/proc/llmmem-compare-out": "cannot make the folder",  # not creatable, even by root
    }
    for out, message in cases.items():
        assert main(["compare", "--quick", "--out", out]) == 2
        captured = capsys.readouterr()
        assert captured.err.startswith("error: --out") and message in captured.err, captured.err
        assert "llmmem compare: GPT" not in captured.out  # no server started, no row run
    assert main(["compare", "--quick", "--out", str(tmp_path / "empty"), "--resume"]) == 2
    assert "--resume: no results.json" in capsys.readouterr().err
