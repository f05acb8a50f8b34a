"""How many cores other processes keep busy, from the kernel's own accounting (/proc/stat).

The thread tuner (cpu_threads.py) learns which thread count is faster by running both, which
costs steps on the slower one. This tells it where to start and when to look again: the
machine's busy time over a window, less this process's own CPU time over the same window, is
what everyone else used. A competing CPU-bound process reads as about one core.

Niced time is left out: a niced process yields to the engine's threads (beside a nice 19 busy
loop the tiny model's 2-thread bench lost 7-9% here, beside a plain one 71-75%), and where it does not
(scheduler autogroups) the tuner's probes still find it. Where /proc/stat is missing (not
Linux) there is no reading, and the tuner probes as before.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass

PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuSample:
    busy_s: float  # every CPU's user + system + irq + softirq time since boot, in seconds
    own_s: float  # this process's CPU time, every thread
    t: float  # time.monotonic()


def _ticks_per_s() -> int:
    try:
        return os.sysconf("SC_CLK_TCK")
    except (AttributeError, ValueError, OSError):
        return 100


def read_busy_s(path: str = PROC_STAT, ticks: int | None = None) -> float | None:
    """The machine's busy CPU seconds since boot (user, system, irq, softirq; not idle, iowait, nice or steal)."""
    try:
        with open(path, encoding="ascii", errors="replace") as f:
            first = f.readline().split()
    except OSError:
        return None
    if len(first) < 8 or first[0] != "cpu":
        return None
    try:
        user, _nice, system, _idle, _iowait, irq, softirq = (int(v) for v in first[1:8])
    except ValueError:
        return None
    return (user + system + irq + softirq) / (ticks or _ticks_per_s())


def sample(path: str = PROC_STAT) -> CpuSample | None:
    busy = read_busy_s(path)
    return None if busy is None else CpuSample(busy, time.process_time(), time.monotonic())


def others_busy(a: CpuSample, b: CpuSample) -> float | None:
    """Cores kept busy by other processes between two samples (None over too short a window to say)."""
    wall = b.t - a.t
    if wall < 0.05:
        return None
    return max(0.0, (b.busy_s - a.busy_s) - (b.own_s - a.own_s)) / wall


class OtherLoad:
    """Other processes' load over a moving window: `busy_cores()` reads it since the last call (or start())."""

    def __init__(self, path: str = PROC_STAT) -> None:
        self.path = path
        self._last = sample(path)

    def start(self) -> None:
        self._last = sample(self.path)

    def busy_cores(self) -> float | None:
        now = sample(self.path)
        if now is None or self._last is None:
            return None
        busy = others_busy(self._last, now)
        if busy is not None:  # too short a window: keep measuring from the same start
            self._last = now
        return busy
