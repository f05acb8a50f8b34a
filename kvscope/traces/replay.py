"""ReplayClock: plays a recorded event stream against the wall clock.

Pure and small: nothing here reads a clock. Every method that depends on time takes
``now`` (any monotonic seconds, e.g. ``time.monotonic()``), so a TUI timer drives it
and tests drive it with made-up times.
"""

from __future__ import annotations

import itertools
from typing import Iterable, Iterator

from ..protocol.events import (
    ByeEvent,
    RejectEvent,
    RequestEvent,
    SnapshotEvent,
    StepEvent,
    VllmKvEvent,
    VllmMetricsEvent,
    VllmSnapshotEvent,
)

__all__ = ["ReplayClock", "event_time", "MIN_SPEED", "MAX_SPEED"]

MIN_SPEED, MAX_SPEED = 0.1, 100.0


def event_time(ev) -> float | None:
    """Engine time at which an event happened; None for events without one (hello)."""
    t = type(ev)
    if t is StepEvent:
        return ev.t + ev.dur  # a step event is emitted when the step ends
    if t is RequestEvent:
        return ev.arrival
    if t in (SnapshotEvent, RejectEvent, ByeEvent, VllmMetricsEvent, VllmKvEvent, VllmSnapshotEvent):
        return ev.t
    return None


def clamp_speed(speed: float) -> float:
    return min(MAX_SPEED, max(MIN_SPEED, float(speed)))


class ReplayClock:
    """Maps trace time to wall time at ``speed`` (0.1..100), with play/pause.

    Trace time never runs backwards through the events: an event's due time is the
    larger of its own time and the previous event's, so out-of-order stamps (an
    arrival stamped before the step that reports it) are due at once.
    """

    def __init__(self, events: Iterable = (), *, now: float = 0.0, speed: float = 1.0, playing: bool = False):
        self.speed = clamp_speed(speed)
        self.playing = playing
        self._pos = 0.0  # trace time at the anchor
        self._anchor = now
        self._it: Iterator = iter(())
        self._next = None
        self._next_t = 0.0
        self._last_t = 0.0
        self.load(events, now)

    # ------------------------------------------------------------------ source

    def load(self, events: Iterable, now: float, start: float | None = None) -> None:
        """Play a new event source (e.g. after ``TraceReader.seek``) from ``start``,
        or from the time of its first timed event. Events stamped before ``start``
        are due at once."""
        it = iter(events)
        head = []
        first_t = None
        for ev in it:
            head.append(ev)
            first_t = event_time(ev)
            if first_t is not None:
                break
        if start is None:
            start = first_t if first_t is not None else self.position(now)
        self._it = itertools.chain(head, it)
        self._last_t = start
        self._advance()
        self.jump(start, now)

    def _advance(self) -> None:
        for ev in self._it:
            t = event_time(ev)
            if t is None or t < self._last_t:
                t = self._last_t
            self._next, self._next_t = ev, t
            self._last_t = t
            return
        self._next = None

    @property
    def done(self) -> bool:
        return self._next is None

    # ------------------------------------------------------------------ time

    def position(self, now: float) -> float:
        """Current trace time."""
        if self.playing:
            return self._pos + (now - self._anchor) * self.speed
        return self._pos

    def jump(self, t: float, now: float) -> None:
        self._pos = t
        self._anchor = now

    def play(self, now: float) -> None:
        if not self.playing:
            self._anchor = now
            self.playing = True

    def pause(self, now: float) -> None:
        if self.playing:
            self._pos = self.position(now)
            self._anchor = now
            self.playing = False

    def toggle(self, now: float) -> bool:
        (self.pause if self.playing else self.play)(now)
        return self.playing

    def set_speed(self, speed: float, now: float) -> float:
        """Change speed without a jump in position; returns the clamped speed."""
        self._pos = self.position(now)
        self._anchor = now
        self.speed = clamp_speed(speed)
        return self.speed

    # ------------------------------------------------------------------ events

    def due(self, now: float, limit: int | None = None) -> list:
        """Pop every event whose time has come (at most ``limit``)."""
        out = []
        pos = self.position(now)
        while self._next is not None and self._next_t <= pos:
            if limit is not None and len(out) >= limit:
                break
            out.append(self._next)
            self._advance()
        return out

    def step(self, now: float):
        """Pop the next event regardless of time and move the position to it
        (single-stepping while paused). None when the stream is done."""
        if self._next is None:
            return None
        ev, t = self._next, self._next_t
        self._advance()
        if t > self.position(now):
            self.jump(t, now)
        return ev

    def next_due_in(self, now: float) -> float | None:
        """Wall seconds until the next event is due: 0 if due now, None if paused or done."""
        if self._next is None:
            return None
        gap = self._next_t - self.position(now)
        if gap <= 0:
            return 0.0
        if not self.playing:
            return None
        return gap / self.speed
