"""Wall time, forward passes and peak memory of one call, taken the same way for every method.

Peak memory is resident memory (RSS) sampled by a thread every few milliseconds during the call,
minus the RSS just before it: tracemalloc cannot see torch's CPU allocations, and the kernel's
high-water mark (VmHWM) cannot be reset between runs. The allocator keeps freed pages, and a timed
run that reuses them reads lower, so ``pcd bench`` takes memory from one more run of each method,
untimed, made after handing the freed pages back (``timed(..., fresh_memory=True)``).

A backend with a ``synchronize`` method (torch on CUDA) is synchronised before the clock starts and
before it stops, so that a call's time includes the device work it queued and none queued before.
On such a device RSS misses what the device holds, so a backend that can (``device_memory_mark``)
also gives the rise of its allocator's peak over the call (``Timed.device_peak_mb``).
"""

from __future__ import annotations

import ctypes
import os
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Self

_PAGE_BYTES = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def rss_bytes() -> int:
    """Resident memory of this process now: /proc on Linux, psutil elsewhere, 0 if neither exists."""
    try:
        with open("/proc/self/statm", "rb") as statm:
            return int(statm.read().split()[1]) * _PAGE_BYTES
    except OSError:
        pass
    try:
        import psutil
    except ImportError:
        return 0
    return int(psutil.Process().memory_info().rss)


def weights_dtype(backend: Any) -> str | None:
    """The dtype a torch backend computes in (``float32``, ``bfloat16``), for the records whose ratio
    it moves: on a CPU with AMX a bfloat16 batch gains more over one input than a float32 one does.
    None for a backend that reads its weights as the file stores them (llama.cpp's GGUF).
    """
    placement: dict[str, str] = getattr(backend, "placement", {})
    return placement.get("dtype")


def peak_rss_mb() -> float:
    """The process's peak resident set so far, in MiB (Linux reports ``ru_maxrss`` in KiB)."""
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def release_free_memory() -> None:
    """Hand the allocator's free pages back to the system (glibc), so that the next call's RSS rise
    counts the memory it allocates, not only what it needs beyond memory freed by the call before.
    """
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):  # not glibc: the rise may then be an underestimate
        pass


class PeakSampler:
    """Samples RSS on a daemon thread while the ``with`` block runs; ``peak_mb`` is the rise."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.start = 0
        self.peak = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._sample, daemon=True)

    def _sample(self) -> None:
        while not self._done.wait(self.interval_s):
            self.peak = max(self.peak, rss_bytes())

    def __enter__(self) -> Self:
        self.start = self.peak = rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self.peak = max(self.peak, rss_bytes())

    @property
    def peak_mb(self) -> float:
        return (self.peak - self.start) / 2**20


def _no_device() -> None:
    """A backend without a device queue: nothing to wait for."""


def _no_device_memory() -> None:
    """A backend whose memory RSS sees: no device counter to read."""


@dataclass
class Timed:
    result: Any
    ms: float
    forward_passes: int
    peak_mem_mb: float
    device_peak_mb: float | None = None


def timed(backend: Any, call: Callable[[], Any], *, fresh_memory: bool = False) -> Timed:
    """Run ``call`` once and measure it. ``fresh_memory`` first hands freed pages back, so that the
    RSS rise counts all the memory the call allocates; the call then pays for faulting fresh pages
    in, so a run made for its memory is not a run to time.
    """
    passes = backend.forward_passes
    synchronize = getattr(backend, "synchronize", _no_device)
    if fresh_memory:
        release_free_memory()
    synchronize()
    mark = getattr(backend, "device_memory_mark", _no_device_memory)()
    with PeakSampler() as sampler:
        started = time.perf_counter()
        result = call()
        synchronize()
        ms = (time.perf_counter() - started) * 1000.0
    device_peak_mb = None if mark is None else (backend.device_memory_peak() - mark) / 2**20
    return Timed(result, ms, backend.forward_passes - passes, sampler.peak_mb, device_peak_mb)
