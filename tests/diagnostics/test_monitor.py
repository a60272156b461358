"""monitor: a background sampler that feeds a callback or the log, starts and stops promptly, and
survives a failing callback."""

from __future__ import annotations

import logging
import subprocess
import sys
import tempfile
import threading
import time

import pytest
import torch

import llmmem
from llmmem.diagnostics.tracker import MemoryTracker


def test_samples_feed_the_callback_until_stopped():
    seen = []
    with llmmem.monitor(0.01, callback=seen.append) as mon:
        assert mon.running
        x = torch.ones(4 * 2**20)  # 16 MiB: the resident memory grows
        deadline = time.monotonic() + 10
        while len(seen) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        del x
    assert not mon.running
    assert len(seen) >= 5
    s = seen[-1]
    assert s.rss > 0 and s.rss_peak >= s.rss
    assert s.time >= seen[0].time
    assert mon.latest is s  # stop takes a last sample
    assert mon.peak["rss_peak"] >= 16 * 2**20
    assert "rss" in str(s)
    assert set(s.to_dict()) >= {"time", "rss", "rss_peak", "cuda_allocated", "tensors", "pool"}


def test_stop_does_not_wait_for_the_interval():
    mon = llmmem.monitor(3600.0, callback=lambda s: None).start()
    t = time.monotonic()
    mon.stop()
    assert time.monotonic() - t < 60  # an Event wakes the thread: waiting out the hour would hang here
    assert not any(th.name == "llmmem-monitor" and th.is_alive() for th in threading.enumerate())
    with pytest.raises(RuntimeError, match="already started"):
        mon.start()
        mon.start()
    mon.stop()


def test_tracker_figure_and_default_logging(caplog):
    with MemoryTracker() as tracker:
        kept = torch.zeros(1000)
        mon = llmmem.monitor(3600.0, live=tracker)
        with caplog.at_level(logging.INFO, logger="llmmem.monitor"):
            sample = mon.sample()
    assert sample.tensors == 4000
    assert "tensors 3.91 KiB" in caplog.text
    del kept


def test_a_failing_callback_is_logged_and_sampling_goes_on(caplog):
    calls = []

    def bad(sample):
        calls.append(sample)
        raise ValueError("progress bar closed")

    with caplog.at_level(logging.ERROR, logger="llmmem.monitor"):
        with llmmem.monitor(0.01, callback=bad) as mon:
            deadline = time.monotonic() + 10
            while len(calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.01)
    assert len(calls) >= 3
    assert isinstance(mon.error, ValueError)
    assert caplog.text.count("the callback raised") == 1


@pytest.mark.parametrize("quit_type", [SystemExit, KeyboardInterrupt])
def test_a_callback_raising_systemexit_or_keyboardinterrupt_is_recorded_and_sampling_goes_on(quit_type, caplog):
    """The sampler's thread used to die of it silently (running False, error None), and stop() then
    raised it on the caller's thread. Now it is recorded and logged, sampling goes on, and stop()
    neither raises it nor calls the callback again."""
    calls = []

    def quits(sample):
        calls.append(sample)
        if len(calls) == 2:
            raise quit_type(3)

    with caplog.at_level(logging.ERROR, logger="llmmem.monitor"):
        mon = llmmem.monitor(0.01, callback=quits).start()
        deadline = time.monotonic() + 10
        while len(calls) < 5 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert mon.running
        assert isinstance(mon.error, quit_type)
        before = len(calls)
        mon.stop()  # raises nothing
    assert before >= 5 and len(calls) == before
    assert mon.latest is not calls[-1]  # the last sample was taken, not passed to the callback
    assert caplog.text.count("the callback raised") == 1


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(interval=0), ValueError, "interval"),
        (dict(interval="1s"), ValueError, "interval"),
        (dict(interval=float("nan")), ValueError, "interval"),
        (dict(callback=3), TypeError, "callback"),
        (dict(keep=0), ValueError, "keep"),
        (dict(live=[1]), TypeError, "live"),
        (dict(pools=[object()]), TypeError, "pools"),
        (dict(device="tpu"), ValueError, "device"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        llmmem.monitor(**kwargs)


@pytest.mark.cuda
def test_cuda_figures():
    x = torch.ones(2**20, device="cuda")
    s = llmmem.monitor(1.0, callback=lambda s: None).sample()
    assert s.cuda_allocated >= x.numel() * 4 and s.cuda_reserved >= s.cuda_allocated


def test_monitor_works_without_importing_torch():
    code = (
        "import sys, llmmem\n"
        "s = llmmem.monitor(1.0, callback=lambda s: None).sample()\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "assert s.rss > 0 and s.cuda_allocated is None\n"
        "print('ok')\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=tempfile.gettempdir()
    )
    assert proc.returncode == 0 and proc.stdout.strip() == "ok", proc.stderr
