"""``llmmem.monitor``: a background sampler of device and host memory, the ``nvidia-smi -l 1`` of a
training loop, that logs or feeds a callback (a progress bar's postfix, a metrics logger).

Each sample reads the process's resident memory (``/proc/self/statm``) and its peak
(``getrusage``); on CUDA, when torch has initialised it, ``torch.cuda.memory_allocated`` /
``memory_reserved`` / ``max_memory_allocated`` of the device; the statistics of the llmmem pools
given to it (or installed as the CUDA allocator); and, given a :class:`~llmmem.diagnostics.live.LiveBytes`
or a :class:`~llmmem.diagnostics.tracker.MemoryTracker`, the live tensor bytes it counts (the honest
figure for tensors on the CPU, where RSS also holds the allocator's cache). Host memory and tensor
bytes are reported side by side, never subtracted.

The thread sleeps between samples (``threading.Event.wait``): a sample costs tens of
microseconds, so at one per second the overhead is far below 1%. It never initialises CUDA and
never synchronises the GPU. Importing this module does not import torch.
"""

from __future__ import annotations

import logging
import math
import os
import sys
import threading
import time
from collections import deque
from dataclasses import asdict, dataclass

from llmmem.units import format_bytes

__all__ = ["monitor", "Monitor", "MemorySample"]

_log = logging.getLogger("llmmem.monitor")

try:
    import resource
except ImportError:  # not on every platform
    resource = None


@dataclass
class MemorySample:
    """One reading (bytes; ``None`` where not available). ``time`` is seconds since the monitor started."""

    time: float
    rss: int | None
    rss_peak: int | None
    device: str | None = None
    cuda_allocated: int | None = None
    cuda_reserved: int | None = None
    cuda_max_allocated: int | None = None
    tensors: int | None = None
    pool: dict | None = None

    def to_dict(self) -> dict:
        return asdict(self)

    def __str__(self) -> str:
        parts = []
        if self.cuda_allocated is not None:
            parts.append(
                f"{self.device} {format_bytes(self.cuda_allocated)} alloc / {format_bytes(self.cuda_reserved)} "
                f"reserved (max {format_bytes(self.cuda_max_allocated)})"
            )
        if self.tensors is not None:
            parts.append(f"tensors {format_bytes(self.tensors)}")
        if self.rss is not None:
            parts.append(
                f"rss {format_bytes(self.rss)}" + (f" (max {format_bytes(self.rss_peak)})" if self.rss_peak else "")
            )
        if self.pool:
            parts.append(
                f"pool {format_bytes(self.pool.get('allocated_bytes.current', 0))} / "
                f"{format_bytes(self.pool.get('reserved_bytes.current', 0))}"
            )
        return " | ".join(parts) or "no memory figures available"


def _rss() -> int | None:
    try:
        with open("/proc/self/statm", "rb") as fh:
            return int(fh.read().split()[1]) * _PAGE
    except (OSError, ValueError, IndexError):
        return None


try:
    _PAGE = os.sysconf("SC_PAGE_SIZE")
except (ValueError, OSError, AttributeError):
    _PAGE = 4096


def _rss_peak() -> int | None:
    if resource is None:
        return None
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024  # bytes on macOS, KiB on Linux


class Monitor:
    """A background memory sampler; see :func:`monitor`. ``start()``/``stop()`` or a ``with`` block;
    ``samples`` (the last ``keep``), ``latest``, ``peak`` (the largest value of each field so
    far), ``sample()`` (one reading now, on the calling thread), ``error`` (the first exception
    the callback or a reading raised, if any: it is logged and sampling goes on).

    On the sampler's thread every exception of the callback is caught, ``SystemExit`` and
    ``KeyboardInterrupt`` too (no signal is delivered to that thread: they come from the callback);
    on the caller's thread (``sample()``, the last sample of ``stop()``) only an ``Exception`` is,
    so a Ctrl-C there still reaches the program."""

    def __init__(self, interval: float = 1.0, callback=None, *, device=None, pools=(), live=None, keep: int = 3600):
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not math.isfinite(interval):
            raise ValueError(f"monitor: interval must be a number of seconds, got {interval!r}")
        if interval < 0.001:
            raise ValueError(f"monitor: interval must be at least 0.001 seconds, got {interval!r}")
        if callback is not None and not callable(callback):
            raise TypeError(f"monitor: callback must be callable with one MemorySample, got {type(callback).__name__}")
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"monitor: keep must be a positive int, got {keep!r}")
        if live is not None and not (hasattr(live, "allocated") or hasattr(live, "current")):
            raise TypeError(f"monitor: live must be a LiveBytes or a MemoryTracker, got {type(live).__name__}")
        pools = tuple(pools) if isinstance(pools, (list, tuple)) else (pools,)
        for p in pools:
            if not hasattr(p, "stats"):
                raise TypeError(f"monitor: pools must be llmmem.MemoryPool objects, got {type(p).__name__}")
        self.interval = float(interval)
        self.callback = callback
        self.pools = pools
        self.live = live
        self.device = self._device(device)
        self.samples: deque[MemorySample] = deque(maxlen=keep)
        self.peak: dict = {}
        self.error: BaseException | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._t0 = time.monotonic()
        self.sample_seconds = 0.0  # time spent sampling, for the overhead

    @staticmethod
    def _device(device):
        if device is None:
            return None
        text = str(device)
        if text == "cpu":
            return None
        if not text.startswith("cuda"):
            raise ValueError(f"monitor: device must be None, 'cpu' or 'cuda[:N]', got {device!r}")
        return text

    # ---------------------------------------------------------------------------------------------
    def sample(self) -> MemorySample:
        """One reading now (on the calling thread); also recorded and passed to the callback."""
        return self._sample(Exception)

    def _sample(self, caught: type, callback: bool = True) -> MemorySample:
        t = time.perf_counter()
        s = MemorySample(time=time.monotonic() - self._t0, rss=_rss(), rss_peak=_rss_peak())
        torch = sys.modules.get("torch")
        if torch is not None and torch.cuda.is_initialized():
            dev = self.device or f"cuda:{torch.cuda.current_device()}"
            s.device = dev
            s.cuda_allocated = torch.cuda.memory_allocated(dev)
            s.cuda_reserved = torch.cuda.memory_reserved(dev)
            s.cuda_max_allocated = torch.cuda.max_memory_allocated(dev)
        if self.live is not None:
            s.tensors = (
                sum(self.live.current().values())
                if hasattr(self.live, "current")
                else sum(self.live.allocated(d) for d in self.live.devices())
            )
        pool = self._pool_stats()
        if pool is not None:
            s.pool = pool
        self.samples.append(s)
        for key, value in asdict(s).items():
            if isinstance(value, int) and key != "time" and value > self.peak.get(key, -1):
                self.peak[key] = value
        self.sample_seconds += time.perf_counter() - t
        if self.callback is None:
            _log.info("memory: %s", s)
        elif callback:
            try:
                self.callback(s)
            except caught as exc:  # a progress bar's failure must not stop the sampling
                if self.error is None:
                    self.error = exc
                    _log.error("llmmem.monitor: the callback raised; sampling goes on", exc_info=exc)
        return s

    def _pool_stats(self):
        pools = list(self.pools)
        if not pools and "llmmem.pool" in sys.modules:
            from llmmem.pool.memory_pool import installed_pool

            installed = installed_pool()
            if installed is not None:
                pools = [installed]
        if not pools:
            return None
        merged: dict = {}
        for p in pools:
            try:
                stats = p.stats()
            except Exception:  # a closed pool
                continue
            for key, value in stats.items():
                if isinstance(value, int) and not isinstance(value, bool):
                    merged[key] = merged.get(key, 0) + value
        return merged or None

    @property
    def latest(self) -> MemorySample | None:
        return self.samples[-1] if self.samples else None

    # ---------------------------------------------------------------------------------------------
    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self._sample(BaseException)
            except BaseException as exc:  # a reading failed (a device gone): log once, keep going
                if self.error is None:
                    self.error = exc
                    _log.error("llmmem.monitor: a sample failed; sampling goes on", exc_info=exc)
            self._stop.wait(self.interval)

    def start(self) -> Monitor:
        """Starts the sampling thread (a daemon). Raises ``RuntimeError`` if it is running."""
        if self._thread is not None and self._thread.is_alive():
            raise RuntimeError("monitor: already started")
        self._stop.clear()
        torch = sys.modules.get("torch")
        if self.device is None and torch is not None and torch.cuda.is_initialized():
            # the current device is per thread: read it here, on the caller's, not on the sampler's
            self.device = f"cuda:{torch.cuda.current_device()}"
        self._thread = threading.Thread(target=self._run, name="llmmem-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stops the thread (waits for it; at most one sample's time) and takes a last sample on the
        calling thread, passed to the callback unless the callback raised something other than an
        ``Exception`` on the sampler (``SystemExit``, ``KeyboardInterrupt``: see ``error``). It
        never raises what the callback raised on the sampler; an ``Exception`` the callback raises
        now is recorded in the same way, anything else propagates."""
        thread = self._thread
        if thread is None:
            return
        self._stop.set()
        thread.join()
        self._thread = None
        quit_asked = self.error is not None and not isinstance(self.error, Exception)
        self._sample(Exception, callback=not quit_asked)

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def __enter__(self) -> Monitor:
        return self.start()

    def __exit__(self, *exc) -> bool:
        self.stop()
        return False


def monitor(interval: float = 1.0, callback=None, *, device=None, pools=(), live=None, keep: int = 3600) -> Monitor:
    """A background sampler of device and host memory every ``interval`` seconds (see the module
    docstring). Use it as a context manager, or call ``start()`` and ``stop()``.

    :param callback: called with each :class:`MemorySample` on the sampler's thread (default: log
        it at INFO level on the ``llmmem.monitor`` logger).
    :param device: the CUDA device to read (default: the current one, once torch has initialised CUDA).
    :param pools: llmmem pools whose statistics to include (default: the installed one, if any).
    :param live: a LiveBytes or MemoryTracker whose live tensor bytes to include.
    :param keep: how many samples to keep in ``samples``.

    Example::

        with llmmem.monitor(1.0, callback=lambda s: bar.set_postfix_str(str(s))) as mon:
            train()
        print(mon.peak["rss_peak"])
    """
    return Monitor(interval, callback, device=device, pools=pools, live=live, keep=keep)
