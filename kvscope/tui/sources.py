"""Event sources for the app: anything with ``poll() -> list[Event]`` and ``connection``.

- ``LiveSource``: a ZeroMQ subscriber read on a background thread, plus the control
  channel (requests run on another thread, so the UI never waits on the engine).
- ``ReplayController``: a trace as a cursor for the player (``kvscope.tui.player``): its
  step index, and seeks that hand out exactly the events live showed; on its own it
  also plays against a clock (benches and scripts use that).

None of this imports textual, torch or the engine.
"""

from __future__ import annotations

import bisect
import collections
import itertools
import threading
import time
from typing import Any, Callable

from kvscope.protocol.events import HelloEvent, SnapshotEvent, StepEvent
from kvscope.tui.state import CONN_CONNECTING, CONN_DISCONNECTED, CONN_LIVE, CONN_REPLAY
from kvscope.tui.step_index import StepIndex
from kvscope.tui.player import SPEEDS


# The live view's memory is bounded in bytes: decoded events waiting for the UI (counted
# by encoded size; decoded they take a few times that) and raw frames waiting for the decoder.
MAX_BACKLOG_BYTES = 16 << 20
MAX_RAW_BYTES = 32 << 20
RAW_PER_ROUND = 10_000  # frames taken from zmq between two decodes


# ------------------------------------------------------------------------------- live
class LiveSource:
    """Subscribes to an engine's events and talks to its control socket.

    A receiver thread takes every frame zmq holds (cheap: no decoding), keeps at most
    ``max_raw_bytes`` of them, then decodes the oldest one, and goes round again, so
    zmq's own queue stays short however fast frames come. Decoded events wait in a
    backlog of at most ``max_backlog_bytes`` (counted by their encoded size) and
    ``max_backlog`` events; ``poll`` (called by the UI timer) drains it. Whenever a
    cap is reached the OLDEST frames or events are dropped and counted in
    ``take_local_dropped`` (the state is then stale until the next snapshot). Frames
    the decoder refuses are counted in ``take_malformed``. A control thread runs
    requests from a queue; their replies come back through ``take_replies``.

    ``connection``: "live" while events arrive (or the control channel answers, for
    an idle or paused engine), "disconnected" after ``silence_s`` without either,
    "connecting" before anything was heard. After silence the control thread asks
    for a snapshot every ``silence_s``; when events come back a snapshot is asked
    for at once, so a restarted engine resyncs.
    """

    def __init__(
        self,
        events_addr: str,
        control_addr: str | None,
        *,
        silence_s: float = 2.0,
        max_backlog: int = 200_000,
        max_backlog_bytes: int = MAX_BACKLOG_BYTES,
        max_raw_bytes: int = MAX_RAW_BYTES,
        subscriber_factory: Callable[[str], Any] | None = None,
        control_factory: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.events_addr = events_addr
        self.control_addr = control_addr
        self.silence_s = silence_s
        self.max_backlog = max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self.max_raw_bytes = max_raw_bytes
        self._clock = clock
        self._subscriber_factory = subscriber_factory
        self._control_factory = control_factory
        self._lock = threading.Lock()
        self._backlog: collections.deque = collections.deque()  # (event, encoded size)
        self._backlog_bytes = 0
        self._local_dropped = 0
        self._malformed = 0
        self.last_error: str | None = None  # the decoder's last refusal
        self._replies: collections.deque = collections.deque(maxlen=64)
        self._requests: collections.deque = collections.deque(maxlen=64)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_event: float | None = None
        self._last_ctl_ok: float | None = None
        self._last_probe = 0.0
        self._last_snapshot_req = -1e9
        self._was_silent = True
        self.received = 0
        self.error: str | None = None  # set when the subscriber cannot be created
        self.paused: bool | None = None
        self._threads: list[threading.Thread] = []
        if start:
            self.start()

    # -- threads --------------------------------------------------------------------
    def start(self) -> None:
        if self._threads:
            return
        rx = threading.Thread(target=self._recv_loop, name="kvscope-tui-recv", daemon=True)
        rx.start()
        self._threads.append(rx)
        if self.control_addr:
            tx = threading.Thread(target=self._control_loop, name="kvscope-tui-control", daemon=True)
            tx.start()
            self._threads.append(tx)

    def _make_subscriber(self):
        if self._subscriber_factory is not None:
            return self._subscriber_factory(self.events_addr)
        from kvscope.protocol.pubsub import Subscriber

        return Subscriber(self.events_addr)

    def _make_control(self):
        if self._control_factory is not None:
            return self._control_factory(self.control_addr)
        from kvscope.protocol.control import ControlClient

        return ControlClient(self.control_addr, timeout_ms=1000)

    def _recv_loop(self) -> None:
        try:
            sub = self._make_subscriber()
        except Exception as e:  # no zmq, or a malformed address
            self.error = f"cannot subscribe to {self.events_addr}: {e}"
            return
        raw: collections.deque = collections.deque()
        raw_bytes = 0
        try:
            while not self._stop.is_set():
                # 1. everything zmq holds now (bounded per round), oldest dropped past the cap
                wait = 0 if raw else 100
                for _ in range(RAW_PER_ROUND):
                    try:
                        data = sub.recv_frame(wait)
                    except Exception:  # a closed socket at shutdown, or a transport bug
                        data = None
                        if not self._stop.is_set():
                            time.sleep(0.05)
                    if data is None:
                        break
                    wait = 0
                    raw.append(data)
                    raw_bytes += len(data)
                    while raw_bytes > self.max_raw_bytes and len(raw) > 1:
                        raw_bytes -= len(raw.popleft())
                        with self._lock:
                            self._local_dropped += 1
                if not raw:
                    continue
                # 2. decode the oldest frame
                data = raw.popleft()
                raw_bytes -= len(data)
                ev = sub.decode_frame(data)
                if ev is None:
                    self._malformed += 1
                    self.last_error = sub.last_error
                    continue
                self._arrived(ev, len(data))
        finally:
            try:
                sub.close()
            except Exception:
                pass

    def _arrived(self, ev, size: int) -> None:
        self.received += 1
        now = self._clock()
        if self._was_silent:
            self._was_silent = False
            self.request_snapshot(now)
        self._last_event = now
        with self._lock:
            backlog = self._backlog
            backlog.append((ev, size))
            self._backlog_bytes += size
            while len(backlog) > 1 and (len(backlog) > self.max_backlog or self._backlog_bytes > self.max_backlog_bytes):
                _, n = backlog.popleft()
                self._backlog_bytes -= n
                self._local_dropped += 1

    def _control_loop(self) -> None:
        ctl = None
        try:
            while not self._stop.is_set():
                self._wake.wait(0.25)
                self._wake.clear()
                if self._stop.is_set():
                    break
                now = self._clock()
                if self._silent(now) and now - self._last_probe >= self.silence_s:
                    self._last_probe = now
                    self._was_silent = True
                    self._requests.append(("snapshot", {}, True))
                while self._requests and not self._stop.is_set():
                    cmd, args, quiet = self._requests.popleft()
                    if ctl is None:
                        try:
                            ctl = self._make_control()
                        except Exception as e:  # no zmq, bad address
                            self._replies.append((cmd, {"ok": False, "error": str(e)}, quiet))
                            continue
                    try:
                        reply = ctl.request(cmd, **args)
                    except Exception as e:
                        reply = {"ok": False, "error": str(e)}
                    if not isinstance(reply, dict):
                        reply = {"ok": False, "error": f"bad reply {reply!r}"}
                    if reply.get("ok"):
                        self._last_ctl_ok = self._clock()
                        if "paused" in reply:
                            self.paused = bool(reply["paused"])
                    self._replies.append((cmd, reply, quiet))
        finally:
            if ctl is not None:
                try:
                    ctl.close()
                except Exception:
                    pass

    def _silent(self, now: float) -> bool:
        return self._last_event is None or now - self._last_event > self.silence_s

    # -- the app side ---------------------------------------------------------------
    def poll(self, limit: int = 50_000) -> list:
        with self._lock:
            backlog = self._backlog
            out = [backlog.popleft() for _ in range(min(len(backlog), limit))]
            self._backlog_bytes -= sum(n for _, n in out)
        return [ev for ev, _ in out]

    def take_local_dropped(self) -> int:
        with self._lock:
            n, self._local_dropped = self._local_dropped, 0
        return n

    def take_malformed(self) -> tuple[int, str | None]:
        """(frames the decoder refused since the last call, the last refusal's message)."""
        n, self._malformed = self._malformed, 0
        return n, self.last_error

    def take_replies(self) -> list[tuple[str, dict, bool]]:
        out = []
        while self._replies:
            out.append(self._replies.popleft())
        return out

    @property
    def connection(self) -> str:
        if self.error:
            return CONN_DISCONNECTED
        now = self._clock()
        if self._last_event is not None and now - self._last_event <= self.silence_s:
            return CONN_LIVE
        if self._last_ctl_ok is not None and now - self._last_ctl_ok <= self.silence_s + 1.0:
            return CONN_LIVE  # idle or paused, but answering
        if self._last_event is None and self._last_ctl_ok is None:
            return CONN_CONNECTING
        return CONN_DISCONNECTED

    def request(self, cmd: str, quiet: bool = False, **args) -> None:
        """Queue a control request; its reply shows up in ``take_replies``."""
        if not self.control_addr:
            self._replies.append((cmd, {"ok": False, "error": "no control address"}, quiet))
            return
        self._requests.append((cmd, args, quiet))
        self._wake.set()

    def request_snapshot(self, now: float | None = None) -> bool:
        """Ask for a snapshot unless one was asked for in the last second."""
        now = self._clock() if now is None else now
        if now - self._last_snapshot_req < 1.0:
            return False
        self._last_snapshot_req = now
        self.request("snapshot", quiet=True)
        return True

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=2.0)
        self._threads = []


# ----------------------------------------------------------------------------- replay
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


__all__ = ["LiveSource", "ReplayController", "SPEEDS", "open_trace",
           "CONN_CONNECTING", "CONN_DISCONNECTED", "CONN_LIVE", "CONN_REPLAY"]
