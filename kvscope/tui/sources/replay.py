"""The replay source: a trace as a cursor for the player (``kvscope.tui.model.player``): its step
index, and seeks that hand out exactly the events live showed; on its own it also plays against a
clock (benches and scripts use that). No textual, torch or engine.
"""

from __future__ import annotations

import bisect
import itertools
import time
from typing import Callable

from kvscope.protocol.events import HelloEvent, SnapshotEvent, StepEvent
from kvscope.tui.model.state import CONN_REPLAY
from kvscope.tui.model.step_index import StepIndex
from kvscope.tui.model.player import SPEEDS



def _events_after_step(trace, step: int):
    """Events after the step event ``step`` (iter_from when the trace has one)."""
    it_from = getattr(trace, "iter_from", None)
    if it_from is not None:
        return it_from(step)
    it = iter(trace)
    for ev in it:
        if type(ev) is StepEvent and ev.step >= step:
            break
    return it


class ReplayController:
    """Plays a trace through the app: ``poll`` returns the events that are due.

    Uses ``kvscope.traces.replay.ReplayClock`` for trace time vs wall time. Going
    forward (play, single step, seek ahead, next preemption) applies every event in
    order, exactly as live did. Going back (or far ahead) starts over from
    ``trace.seek(step)``: a hello (fresh state), the nearest snapshot, then the
    events up to the step, with the TTFT/ITL samples up to that snapshot handed
    over first (``latency_seed``), so the figures equal those of playing to the step.
    """

    FORWARD_LIMIT = 20_000  # seek ahead by applying events when fewer steps than this

    def __init__(self, trace, *, speed: float = 1.0, playing: bool = True,
                 clock: Callable[[], float] = time.monotonic, max_per_poll: int = 5000,
                 index_in_background: bool = False, slo=None) -> None:
        """``index_in_background``: index the steps on a thread started at the second ``poll``
        (once the first frame is drawn), so opening costs the trace's start only; what needs a
        step not yet indexed waits for it. Otherwise the whole trace is indexed here."""
        from kvscope.traces.replay import ReplayClock, event_time

        self.trace = trace
        self.hello = trace.hello
        self._now = clock
        self._event_time = event_time
        self.max_per_poll = max_per_poll
        self.connection = CONN_REPLAY
        # The step index: (step, end time, had a preemption) per step; these lists grow with it.
        self.index = StepIndex(trace, slo)  # slo: the command line's (--slo), else the trace's own
        self.steps: list[int] = self.index.steps
        self.step_t: list[float] = self.index.step_t
        self.preempt_steps: list[int] = self.index.preempt_steps
        self._latency = self.index.latency
        self._polls = 0
        self._index_later = index_in_background
        if not index_in_background:
            self.index.build()
        # The events before the first step (hello, opening snapshot, first arrivals)
        # are shown at once; the clock starts at the first step.
        it = iter(trace)
        head: list = []
        first = None
        for ev in it:
            if type(ev) is StepEvent:
                first = ev
                break
            head.append(ev)
        self.start_t = first.t if first is not None else 0.0
        self.first_step = first.step if first is not None else 0
        self.cur_step = self.first_step - 1 if first is not None else 0
        span = getattr(trace, "indexed_span", None)
        span = span() if span is not None else None
        # what the trace's own index says its last step and end are, before the steps are indexed
        self.end_hint: tuple[int, float] | None = (span[1], span[3]) if span is not None else None
        self.pending: list = head
        rest = itertools.chain([first], it) if first is not None else it
        self.clock = ReplayClock(rest, now=clock(), speed=speed, playing=playing)

    # -- the step index ---------------------------------------------------------------
    @property
    def indexed(self) -> bool:
        """Whether every step is indexed (``steps``, ``step_t`` and ``preempt_steps`` are whole)."""
        return self.index.complete

    def wait_indexed(self) -> None:
        self.index.wait()

    def _need_step(self, step: int) -> None:
        """Wait for the index to reach ``step`` (or the end): seeks land on indexed steps only."""
        if not self.index.complete and (not self.step_t or step > self.steps[len(self.step_t) - 1]):
            self.index.wait()

    @property
    def end_t(self) -> float:
        return self.step_t[-1] if self.step_t else 0.0

    @property
    def last_step(self) -> int:
        return self.steps[-1] if self.steps else 0

    # -- status ---------------------------------------------------------------------
    @property
    def playing(self) -> bool:
        return self.clock.playing

    @property
    def speed(self) -> float:
        return self.clock.speed

    @property
    def done(self) -> bool:
        return self.clock.done and not self.pending

    def status(self) -> dict:
        now = self._now()
        t = self.clock.position(now)
        if self.done:
            t = self.end_t
        return {
            "playing": self.clock.playing and not self.done,
            "done": self.done,
            "speed": self.clock.speed,
            "step": max(self.cur_step, 0),
            "first_step": self.first_step,
            "last_step": self.last_step,
            "t": min(max(t, self.start_t), self.end_t) if self.steps else 0.0,
            "start_t": self.start_t,
            "end_t": self.end_t,
        }

    # -- the app side ---------------------------------------------------------------
    def _track(self, events: list) -> list:
        for ev in events:
            if type(ev) is StepEvent or type(ev) is SnapshotEvent:
                self.cur_step = ev.step
        return events

    def poll(self) -> list:
        self._polls += 1
        if self._index_later and self._polls == 2:
            self.index.start()  # after the first frame: it shares the GIL with the app
        out = self.pending
        self.pending = []
        now = self._now()
        # Paused, nothing more is due: the picture stays exactly at the step shown
        # (an arrival stamped at the same time as the step's end waits for play).
        due = self.clock.due(now, limit=self.max_per_poll) if self.clock.playing else []
        if due:
            if len(due) >= self.max_per_poll and self.clock.playing:
                # Behind: hold the clock at the last event handed out instead of
                # building an ever-growing backlog.
                t = self._event_time(due[-1])
                if t is not None:
                    self.clock.jump(t, now)
            out = out + due if out else due
        if self.clock.playing and self.clock.done:
            self.clock.pause(now)
        return self._track(out)

    def toggle(self) -> bool:
        now = self._now()
        if self.done:
            self.seek(self.first_step)
            self.clock.play(now)
            return True
        return self.clock.toggle(now)

    def pause(self) -> None:
        self.clock.pause(self._now())

    def play(self) -> None:
        self.clock.play(self._now())

    def faster(self) -> float:
        return self._set_speed(+1)

    def slower(self) -> float:
        return self._set_speed(-1)

    def _set_speed(self, direction: int) -> float:
        cur = self.clock.speed
        i = min(range(len(SPEEDS)), key=lambda j: abs(SPEEDS[j] - cur))
        i = max(0, min(len(SPEEDS) - 1, i + direction))
        return self.clock.set_speed(SPEEDS[i], self._now())

    def step_forward(self) -> None:
        """Pause and hand out the events up to and including the next step event."""
        now = self._now()
        self.clock.pause(now)
        self.pending.extend(self._events_through_step(now, None))

    def _events_through_step(self, now: float, step: int | None) -> list:
        """Events from the clock up to and including the next step event (at or past `step` if given)."""
        out = []
        while (ev := self.clock.step(now)) is not None:
            out.append(ev)
            if type(ev) is StepEvent and (step is None or ev.step >= step):
                break
        return out

    def step_back(self) -> None:
        self.pause()
        target = self.cur_step - 1
        if target < self.first_step:
            target = self.first_step
        self.seek(target)

    def seek(self, step: int) -> int:
        """Go to just after step ``step`` (clamped to the trace); returns the step."""
        self._need_step(step)
        n = len(self.step_t)  # steps indexed with their times (a background index may be mid-batch)
        if not n:
            return self.cur_step
        i = bisect.bisect_right(self.steps, step, 0, n) - 1
        step = self.steps[max(0, i)]
        now = self._now()
        playing = self.clock.playing
        if self.cur_step < step and step - self.cur_step <= self.FORWARD_LIMIT and not self.pending:
            self.pending.extend(self._events_through_step(now, step))
            self.cur_step = step
        else:
            events = list(self.trace.seek(step))
            seed = self._latency.seed(self.trace, events)
            if not events or not isinstance(events[0], HelloEvent):
                events.insert(0, self.hello)
            events.insert(1, seed)
            self.pending = events
            self.cur_step = step
            t = self.step_t[self.steps.index(step, 0, n)]
            self.clock.load(_events_after_step(self.trace, step), now, start=t)
        if not playing:
            self.clock.pause(now)
        return step

    def seek_time(self, t: float) -> int:
        """Go to the last step that ended at or before trace time ``t``."""
        if not self.indexed and (not self.step_t or t > self.step_t[-1]):
            self.index.wait()
        if not self.step_t:
            return self.cur_step
        i = bisect.bisect_right(self.step_t, t) - 1
        return self.seek(self.steps[max(0, i)])

    def next_preemption(self) -> int | None:
        i = bisect.bisect_right(self.preempt_steps, self.cur_step)
        if i >= len(self.preempt_steps) and not self.indexed:
            self.index.wait()  # none among the steps indexed so far: the rest may hold one
        if i >= len(self.preempt_steps):
            return None
        self.pause()
        return self.seek(self.preempt_steps[i])

    def finish(self) -> None:
        """Hand out everything after the last step (the engine's goodbye): the player's end."""
        now = self._now()
        self.clock.pause(now)
        while (ev := self.clock.step(now)) is not None:
            self.pending.append(ev)

    def now(self) -> float:
        """The clock this controller was made with (its player keeps time on the same one)."""
        return self._now()

    def close(self) -> None:
        self.index.close()


def open_trace(path: str):
    """A TraceReader for ``path`` (imports the trace package lazily)."""
    from kvscope.traces.reader import TraceReader

    return TraceReader(path)


__all__ = ["ReplayController", "open_trace"]
