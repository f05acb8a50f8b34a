"""Latency figures across a replay seek: seeking to step N shows what playing to N showed.

A backward seek restarts the state from a snapshot, which carries no latency
samples. While the replay controller indexes the trace it keeps, at snapshots,
a packed copy of the TTFT and ITL sketches over every step up to there; a seek
hands the reducer a ``LatencySeed`` with the sketches as of the snapshot it
restarts from, and the steps after it add theirs as in play.
"""

from __future__ import annotations

import threading

from kvscope.goodput import NO_SLO, GoodputTally, Slo
from kvscope.protocol.events import SnapshotEvent, StepEvent
from kvscope.traces.summary import LatencyTally

MAX_CHECKPOINTS = 512  # then keep every other one: a seek re-reads at most the steps between two


class LatencySeed:
    """Not a protocol event: the reducer replaces its TTFT/ITL samples with these sketches."""

    type = "latency"
    __slots__ = ("ttft", "itl", "goodput")

    def __init__(self, tally: LatencyTally) -> None:
        self.ttft = tally.ttft
        self.itl = tally.itl
        self.goodput = tally.goodput  # the finish records so far, judged against the replay's SLO


class LatencyCheckpoints:
    """Packed TTFT/ITL sketches at a trace's snapshots; memory bounded by MAX_CHECKPOINTS.

    One thread observes (the step index's, perhaps in the background), another seeds: the
    checkpoints are shared under a lock."""

    def __init__(self, slo: Slo = NO_SLO) -> None:
        self.slo = slo  # what the replay judges goodput by (docs/GOODPUT.md)
        self._tally = LatencyTally(goodput=GoodputTally(slo))
        self._last_step = 0
        self._points: dict[int, tuple] = {}  # snapshot step -> packed (ttft, itl, goodput)
        self._every = 1
        self._snapshots = 0
        self._lock = threading.Lock()

    def observe(self, ev) -> None:
        """Call with every event of the trace, in order, once."""
        t = type(ev)
        if t is StepEvent:
            self._tally.add(ev)
            self._last_step = ev.step
        elif t is SnapshotEvent and ev.step not in self._points:
            self._snapshots += 1
            if self._snapshots % self._every == 0:
                point = (self._tally.ttft.packed(), self._tally.itl.packed(), self._tally.goodput.copy())
                with self._lock:
                    self._points[ev.step] = point
                    if len(self._points) > MAX_CHECKPOINTS:
                        self._points = dict(list(self._points.items())[1::2])
                        self._every *= 2

    def seed(self, trace, events: list) -> LatencySeed:
        """The seed for a restart from ``events`` (``trace.seek``'s answer): steps up to its snapshot."""
        tally = LatencyTally(goodput=GoodputTally(self.slo))
        snap = next((ev for ev in events if type(ev) is SnapshotEvent), None)
        if snap is None:
            return LatencySeed(tally)  # restarts from the beginning: nothing before it
        with self._lock:
            below = [s for s in self._points if s <= snap.step]
            base = max(below) if below else None
            packed = self._points[base] if base is not None else None
        if packed is not None:
            ttft, itl, goodput = packed
            tally.ttft.unpack(ttft)
            tally.itl.unpack(itl)
            tally.goodput = goodput.copy()
        if base != snap.step:
            for ev in _steps_after(trace, base):
                if ev.step > snap.step:
                    break
                tally.add(ev)
        return LatencySeed(tally)


def _steps_after(trace, step: int | None):
    """Step events after step ``step`` (all of them for None)."""
    it_from = getattr(trace, "iter_from", None) if step is not None else None
    source = it_from(step) if it_from is not None else iter(trace)
    for ev in source:
        if type(ev) is StepEvent and (step is None or ev.step > step):
            yield ev
