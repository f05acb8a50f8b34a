"""Several recorded runs played on one clock, for `kvscope compare` and `kvscope race`.

Each run keeps its own ReplayController (its own trace, seek index and events); this
class owns the one position they all follow and moves every controller to it:

- ``align="time"`` (default): the position is engine seconds since each run's first
  arrival, so runs of one workload see the same arrivals at the same moment;
- ``align="step"``: the position is a step number; ×1 plays STEP_RATE steps a second.

The controllers never play on their own clocks: each tick, ``sync`` seeks every run
forward to the position (forward seeks apply events in order, exactly as live did), so
no run can drift from the others. Nothing here reads a clock; ``now`` comes from the
caller, as in ReplayClock.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass
from typing import Callable

from kvscope.traces.replay import MAX_SPEED, MIN_SPEED

ALIGN_TIME, ALIGN_STEP = "time", "step"
ALIGNS = (ALIGN_TIME, ALIGN_STEP)
STEP_RATE = 20.0  # steps per second at ×1 when aligned by step
SPEEDS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 25.0, 50.0, 100.0)


@dataclass
class Track:
    """One run's place on the shared axis: where its position 0 is, and where it ends."""

    origin: float  # trace time (time align) or step number (step align) at position 0
    keys: list[float]  # per step: its position on the shared axis (end time - origin, or step - origin)
    steps: list[int]

    @property
    def end(self) -> float:
        return self.keys[-1] if self.keys else 0.0

    def step_at(self, pos: float) -> int | None:
        """The last step at or before ``pos``; None before the first."""
        i = bisect.bisect_right(self.keys, pos + 1e-12) - 1
        return self.steps[i] if i >= 0 else None


def make_track(controller, align: str, first_arrival: float | None) -> Track:
    steps = list(controller.steps)
    if align == ALIGN_STEP:
        origin = float(steps[0]) if steps else 0.0
        return Track(origin, [s - origin for s in steps], steps)
    origin = first_arrival if first_arrival is not None else controller.start_t
    if steps and origin > controller.step_t[0]:
        origin = controller.start_t
    return Track(origin, [t - origin for t in controller.step_t], steps)


class SyncedReplay:
    """Play, pause, speed, step and seek for N controllers at once (None = a damaged run)."""

    def __init__(self, controllers: list, tracks: list[Track | None], *, align: str = ALIGN_TIME,
                 speed: float = 1.0, playing: bool = True, clock: Callable[[], float]) -> None:
        if align not in ALIGNS:
            raise ValueError(f"align must be one of {', '.join(ALIGNS)}")
        self.controllers = controllers
        self.tracks = tracks
        self.align = align
        self._now = clock
        self.speed = _clamp(speed)
        self.playing = playing
        self._pos = 0.0
        self._anchor = clock()
        self.focus = 0
        live = [t for t in tracks if t is not None and t.keys]
        self.end = max((t.end for t in live), default=0.0)
        self.start = min((t.keys[0] for t in live), default=0.0)
        self._shown: list[int | None] = [None] * len(controllers)

    # -- the clock ------------------------------------------------------------------
    def _rate(self) -> float:
        return self.speed * (STEP_RATE if self.align == ALIGN_STEP else 1.0)

    def position(self) -> float:
        if self.playing:
            pos = self._pos + (self._now() - self._anchor) * self._rate()
            return min(pos, self.end)
        return self._pos

    def _jump(self, pos: float) -> None:
        self._pos = max(0.0, min(pos, self.end))
        self._anchor = self._now()

    @property
    def done(self) -> bool:
        return self.position() >= self.end

    def play(self) -> None:
        if not self.playing:
            if self.done:
                self._jump(0.0)
            self._anchor = self._now()
            self.playing = True

    def pause(self) -> None:
        if self.playing:
            self._jump(self.position())
            self.playing = False

    def toggle(self) -> bool:
        (self.pause if self.playing else self.play)()
        return self.playing

    def _set_speed(self, direction: int) -> float:
        pos = self.position()
        i = min(range(len(SPEEDS)), key=lambda j: abs(SPEEDS[j] - self.speed))
        self.speed = SPEEDS[max(0, min(len(SPEEDS) - 1, i + direction))]
        self._jump(pos)
        return self.speed

    def faster(self) -> float:
        return self._set_speed(+1)

    def slower(self) -> float:
        return self._set_speed(-1)

    # -- moving the position by the focused run's steps ------------------------------
    def _focused(self) -> Track | None:
        if 0 <= self.focus < len(self.tracks) and self.tracks[self.focus] is not None:
            return self.tracks[self.focus]
        return next((t for t in self.tracks if t is not None), None)

    def step_forward(self) -> None:
        """Pause, and move to the focused run's next step."""
        self.pause()
        tr = self._focused()
        if tr is None or not tr.keys:
            return
        i = bisect.bisect_right(tr.keys, self._pos + 1e-12)
        if i < len(tr.keys):
            self._jump(tr.keys[i])

    def step_back(self) -> None:
        self.pause()
        tr = self._focused()
        if tr is None or not tr.keys:
            return
        i = bisect.bisect_left(tr.keys, self._pos - 1e-12) - 1
        self._jump(tr.keys[max(0, i)])

    def seek(self, step: int) -> None:
        """Go to the focused run's step ``step``; every other run follows to the same moment."""
        tr = self._focused()
        if tr is None or not tr.steps:
            return
        i = max(0, bisect.bisect_right(tr.steps, step) - 1)
        self._jump(tr.keys[i])

    def seek_time(self, t: float) -> None:
        """Go to ``t`` on the shared axis (seconds since first arrival, or a step offset)."""
        self._jump(t)

    # -- moving the runs --------------------------------------------------------------
    def sync(self) -> list[list]:
        """Move every run to the current position; returns each run's new events."""
        pos = self.position()
        if self.playing and pos >= self.end:
            self._jump(self.end)
            self.playing = False
        out: list[list] = []
        for k, (ctl, tr) in enumerate(zip(self.controllers, self.tracks)):
            if ctl is None or tr is None:
                out.append([])
                continue
            step = tr.step_at(pos)
            if step is not None and step != self._shown[k]:
                ctl.seek(step)
                self._shown[k] = step
            out.append(ctl.poll())
        return out

    def shown_step(self, k: int) -> int | None:
        return self._shown[k]

    def status(self) -> dict:
        """What the replay bar draws (the shape of ReplayController.status)."""
        tr = self._focused()
        step = self._shown[self.focus] if 0 <= self.focus < len(self._shown) else None
        return {
            "playing": self.playing and not self.done,
            "done": self.done,
            "speed": self.speed,
            "step": step if step is not None else 0,
            "first_step": tr.steps[0] if tr and tr.steps else 0,
            "last_step": tr.steps[-1] if tr and tr.steps else 0,
            "t": self.position(),
            "start_t": 0.0,
            "end_t": self.end,
            "align": self.align,
        }


def _clamp(speed: float) -> float:
    return min(MAX_SPEED, max(MIN_SPEED, float(speed)))
