"""The one replay player: play, pause, step, seek and speed for one recorded run or several in sync.

A player owns ONE position on a shared axis and moves every track's cursor to it:

- ``align="time"``: the position is trace seconds. A single replay puts position 0 at
  trace time 0 (the bar shows the trace's own clock); a compare puts it at each run's
  first arrival, so runs of one workload see the same arrivals at the same moment.
- ``align="step"``: the position is a step number; ×1 plays STEP_RATE steps a second.

Cursors never play on their own clocks: each tick, ``sync`` seeks every cursor to the
last step at or before the position (forward seeks apply events in order, exactly as
live did), so no run can drift from the others. A cursor is anything with the
``Cursor`` face: a kvscope trace (``sources.ReplayController``) or a recorded vLLM
(``adapters.vllm_replay.VllmTraceSource``, whose steps are its recorder's ticks).

A cursor whose step index is still being built (``kvscope replay`` builds it in the
background, tui/model/step_index.py) says so with ``indexed`` False: its track shares the
growing lists, the run is not over until the index is whole, and whatever needs a step
beyond the indexed ones (the end, a fraction of the run, a later preemption) waits for it.

Keys mean the same everywhere (screens/keys.py): ←/→ one step of the focused run,
shift+←/→ a tenth of the run, shift+Home/shift+End its ends.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

from kvscope.traces.replay import MAX_SPEED, MIN_SPEED

ALIGN_TIME, ALIGN_STEP = "time", "step"
ALIGNS = (ALIGN_TIME, ALIGN_STEP)
STEP_RATE = 20.0  # steps per second at ×1 when aligned by step
SPEEDS = (0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
BIG_JUMP = 0.1  # shift+←/→: a tenth of the run


class Cursor(Protocol):
    """A recorded run a player can move: its step index, and a seek that hands out the events."""

    steps: list[int]  # step numbers (ticks, for a recorded vLLM), in order
    step_t: list[float]  # trace time each step ended
    preempt_steps: list[int]  # steps with a preemption or a swap ('p' jumps to the next)
    start_t: float  # trace time the first step began

    def seek(self, step: int) -> int: ...

    def finish(self) -> None:
        """Hand out what follows the last step (the engine's goodbye)."""

    # optional: ``indexed`` (bool, True if absent), ``wait_indexed()``, and ``end_hint``
    # ((last step, its end time) from the trace's own index, or None)


@dataclass(frozen=True, slots=True)
class PlayerStatus:
    """What the replay bar draws."""

    playing: bool
    done: bool
    speed: float
    step: int  # the focused run's step on screen
    first_step: int
    last_step: int
    t: float  # the position on the axis
    start_t: float  # where the axis starts
    end_t: float
    align: str = ALIGN_TIME
    indexing: bool = False  # a run's steps are still being indexed (end_t, last_step: the trace's word)


@dataclass
class Track:
    """One run's place on the shared axis: where its position 0 is, and each step's position."""

    origin: float  # trace time (time align) or step number (step align) at position 0
    keys: list[float]  # per step: its position on the axis
    steps: list[int]
    preempt_steps: list[int] = field(default_factory=list)
    start: float = 0.0  # where this run's stretch of the axis begins

    @property
    def end(self) -> float:
        return self.keys[-1] if self.keys else 0.0

    def step_at(self, pos: float) -> int | None:
        """The last step at or before ``pos``; None before the first."""
        i = bisect.bisect_right(self.keys, pos + 1e-12) - 1
        return self.steps[i] if i >= 0 else None

    def index_of(self, step: int) -> int:
        """Index of the last step at or before ``step`` (0 before the first); keys may trail steps."""
        return max(0, bisect.bisect_right(self.steps, step, 0, len(self.keys)) - 1)


def make_track(cursor: Cursor, align: str = ALIGN_TIME, first_arrival: float | None = None,
               *, own_clock: bool = False) -> Track:
    """A cursor's track. ``own_clock``: position 0 is trace time 0 (a single replay); its track
    shares the cursor's lists, so it grows with an index built in the background."""
    if own_clock:
        steps, pre = cursor.steps, cursor.preempt_steps
        if align == ALIGN_STEP:
            first = getattr(cursor, "first_step", None)
            start = float(steps[0]) if steps else float(first or 0)
            return Track(0.0, steps, steps, pre, start)  # position = step number
        return Track(0.0, cursor.step_t, steps, pre, cursor.start_t)
    steps = list(cursor.steps)
    pre = list(cursor.preempt_steps)
    if align == ALIGN_STEP:
        origin = float(steps[0]) if steps else 0.0
        return Track(origin, [s - origin for s in steps], steps, pre)
    origin = first_arrival if first_arrival is not None else cursor.start_t
    if steps and origin > cursor.step_t[0]:
        origin = cursor.start_t
    return Track(origin, [t - origin for t in cursor.step_t], steps, pre)


class Player:
    """Play, pause, speed, step and seek for N cursors at once (None = a run that could not be read)."""

    def __init__(self, cursors: Sequence[Cursor | None], tracks: Sequence[Track | None] | None = None, *,
                 align: str = ALIGN_TIME, speed: float = 1.0, playing: bool = True,
                 clock: Callable[[], float]) -> None:
        if align not in ALIGNS:
            raise ValueError(f"align must be one of {', '.join(ALIGNS)}")
        self.cursors = list(cursors)
        if tracks is None:  # one run on its own clock
            tracks = [make_track(c, align, own_clock=True) if c is not None else None for c in self.cursors]
        self.tracks = list(tracks)
        self.align = align
        self._now = clock
        self.speed = _clamp(speed)
        self.playing = playing
        self.focus = 0
        growing = [t for c, t in zip(self.cursors, self.tracks) if t is not None and not _indexed(c)]
        live = [t for t in self.tracks if t is not None and t.keys]
        self.start = min((t.start for t in live + growing), default=0.0)
        self._pos = self.start
        self._anchor = clock()
        self._shown: list[int | None] = [None] * len(self.cursors)
        self._finished: list[bool] = [False] * len(self.cursors)

    # -- the step index -----------------------------------------------------------------
    @property
    def end(self) -> float:
        """Where the axis ends: the last indexed step of the longest run (it grows while indexing)."""
        return max((t.end for t in self.tracks if t is not None and t.keys), default=0.0)

    @property
    def indexing(self) -> bool:
        """Some run's steps are still being indexed: the run is not over, its end not yet known."""
        return any(not _indexed(c) for c in self.cursors if c is not None)

    def _limit(self) -> float:
        return math.inf if self.indexing else self.end

    def _need_index(self) -> None:
        """Wait until every run is indexed (what needs the end: shift+End, a tenth of the run, ...)."""
        for c in self.cursors:
            if c is not None and not _indexed(c):
                c.wait_indexed()

    # -- the clock ------------------------------------------------------------------
    def _rate(self) -> float:
        return self.speed * (STEP_RATE if self.align == ALIGN_STEP else 1.0)

    def position(self) -> float:
        if self.playing:
            return min(self._pos + (self._now() - self._anchor) * self._rate(), self._limit())
        return min(self._pos, self._limit())

    def _jump(self, pos: float) -> None:
        self._pos = max(self.start, min(pos, self._limit()))
        self._anchor = self._now()

    @property
    def done(self) -> bool:
        return not self.indexing and self.position() >= self.end

    def play(self) -> None:
        if not self.playing:
            if self.done:  # at the end, play starts again from the top
                self._jump(self.start)
            self._anchor = self._now()
            self.playing = True

    def start_clock(self) -> None:
        """Playing starts now, from where it was set up: the seconds a screen took to open (or a race took
        to compute its runs) are not played past unseen."""
        self._anchor = self._now()

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
        if tr is not None and self.indexing and bisect.bisect_right(tr.keys, self._pos + 1e-12) >= len(tr.keys):
            self._need_index()  # the next step is not indexed yet
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

    def jump(self, fraction: float) -> None:
        """Move by a fraction of the run (shift+←/→), keeping play or pause."""
        self._need_index()
        self._jump(self.position() + fraction * (self.end - self.start))

    def to_start(self) -> None:
        self._jump(self.start)

    def to_end(self) -> None:
        self._need_index()
        self._jump(self.end)

    def seek(self, step: int) -> None:
        """Go to the focused run's step ``step``; every other run follows to the same moment."""
        tr = self._focused()
        if tr is not None and self.indexing and (not tr.keys or step > tr.steps[len(tr.keys) - 1]):
            self._need_index()
        if tr is None or not tr.keys:
            return
        self._jump(tr.keys[tr.index_of(step)])

    def seek_time(self, t: float) -> None:
        """Go to ``t`` on the axis (trace seconds, since the first arrival in a compare, or a step offset)."""
        if self.indexing and t > self.end:
            self._need_index()
        self._jump(t)

    def next_preemption(self) -> int | None:
        """Pause at the focused run's next step with a preemption; None (and no move) if there is none."""
        tr = self._focused()
        if tr is None:
            return None
        shown = self._shown[self.focus] if 0 <= self.focus < len(self._shown) else None
        cur = shown if shown is not None else (tr.steps[0] - 1 if tr.steps else 0)
        i = bisect.bisect_right(tr.preempt_steps, cur)
        if i >= len(tr.preempt_steps) and self.indexing:
            self._need_index()  # none among the steps indexed so far: the rest may hold one
        if i >= len(tr.preempt_steps):
            return None
        self.pause()
        self.seek(tr.preempt_steps[i])
        return tr.preempt_steps[i]

    # -- moving the cursors ----------------------------------------------------------
    def sync(self) -> None:
        """Move every cursor to the current position (their events then wait in each feed)."""
        pos = self.position()
        indexing = self.indexing
        end = self.end
        if self.playing and not indexing and pos >= end:
            self._jump(end)
            self.playing = False
        for k, (cur, tr) in enumerate(zip(self.cursors, self.tracks)):
            if cur is None or tr is None:
                continue
            step = tr.step_at(pos)
            if step is None and self._shown[k] is not None and tr.steps:
                step = tr.steps[0]  # back before the first step: the run's opening picture
            if step is not None and step != self._shown[k]:
                cur.seek(step)
                self._shown[k] = step
                self._finished[k] = False
            if (tr.keys and not indexing and step == tr.steps[-1] and pos >= end
                    and not self._finished[k]):
                cur.finish()  # the whole run has played: what followed its last step too
                self._finished[k] = True

    def shown_step(self, k: int) -> int | None:
        return self._shown[k]

    def status(self) -> PlayerStatus:
        tr = self._focused()
        step = self._shown[self.focus] if 0 <= self.focus < len(self._shown) else None
        pos = self.position()
        indexing = self.indexing
        end = self.end
        done = not indexing and pos >= end
        first = tr.steps[0] if tr and tr.steps else 0
        last = tr.steps[len(tr.keys) - 1] if tr and tr.keys else 0
        if indexing and tr is not None:
            cur = self.cursors[self.focus] if 0 <= self.focus < len(self.cursors) else None
            first = tr.steps[0] if tr.steps else getattr(cur, "first_step", 0)
            hint = getattr(cur, "end_hint", None)
            if hint is not None:  # the trace's own word on its end, until the index gets there
                last = max(last, hint[0])
                end = max(end, (hint[1] if self.align == ALIGN_TIME else float(hint[0])) - tr.origin)
            end = max(end, pos)
        return PlayerStatus(
            playing=self.playing and not done, done=done, speed=self.speed,
            step=step if step is not None else 0, first_step=first, last_step=last,
            t=pos, start_t=self.start, end_t=end, align=self.align, indexing=indexing)


def _indexed(cursor) -> bool:
    return cursor is None or getattr(cursor, "indexed", True)


def _clamp(speed: float) -> float:
    return min(MAX_SPEED, max(MIN_SPEED, float(speed)))
