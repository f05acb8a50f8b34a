"""A recorded vLLM (`kvscope record --vllm`) played back into the same VllmState the live view draws.

VllmTraceSource has the live VllmSource's face (``state``, ``lock``, ``start``, ``close``)
plus the player's controls: pause, speed, seek. One thread pops the events whose time
has come (traces.replay.ReplayClock) and applies them under the lock; the screen's timer
draws, exactly as for a live vLLM.
"""

from __future__ import annotations

import itertools
import os
import threading
import time

from kvscope.adapters.vllm_source import ReplayPosition, VllmState, apply_batch
from kvscope.adapters.vllm_trace import batch_from, cache_from, metrics_from, restore_kv, scrape_from
from kvscope.engine.errors import KvscopeError
from kvscope.protocol.events import VllmKvEvent, VllmMetricsEvent, VllmSnapshotEvent
from kvscope.traces.reader import TraceReader
from kvscope.traces.replay import ReplayClock

APPLY_LIMIT = 5000  # events applied per wake-up, so a fast replay still lets the screen take the lock
IDLE_S = 0.05


class VllmTraceSource:
    def __init__(self, path: str | os.PathLike, *, speed: float = 1.0, playing: bool = True,
                 window_s: float = 30.0) -> None:
        self.path = os.fspath(path)
        self.reader = self.trace = TraceReader(self.path)
        if not self.reader.vllm_recording:
            raise KvscopeError(f"{self.path} is a kvscope engine trace, not a vLLM recording")
        self.window_s = window_s
        self.summary = self.reader.summary()
        self.first_step = self.summary.first_step or 0
        self.last_step = self.summary.last_step or 0
        self.lock = threading.Lock()
        self.state = self._fresh()
        self.step = self.first_step
        self.t = 0.0
        self.clock = ReplayClock(now=time.monotonic(), speed=speed, playing=playing)
        self._load(self.reader.iter_from(self.first_step), None)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._label()

    def _fresh(self) -> VllmState:
        cfg = self.reader.hello.config.as_dict()
        st = VllmState(cfg.get("vllm_url"), cfg.get("vllm_kv_events"), cfg.get("vllm_kv_replay"))
        st.metrics.window_s = self.window_s
        return st

    # -- applying ------------------------------------------------------------------
    def apply(self, ev) -> None:
        """One recorded event into the state (the caller holds the lock)."""
        st = self.state
        t = type(ev)
        if t is VllmMetricsEvent:
            if ev.error is not None:
                st.metrics.fail(ev.error)
            else:
                st.metrics.add(scrape_from(ev, self.reader.hello.wall_start))
                st.metrics.last_error = None
        elif t is VllmKvEvent:
            restore_kv(st.kv, ev.kv)  # the tallies before this batch, malformed frames included
            apply_batch(st, ev.seq, batch_from(ev), ev.replayed)
        elif t is VllmSnapshotEvent:
            # A chunk's snapshot equals the state here unless events were lost on the way:
            # only then replace the view (which restarts its rate window).
            if st.cache.batches != ev.batches or st.cache.cached_blocks != len(ev.blocks):
                st.cache = cache_from(ev)
                restore_kv(st.kv, ev.kv)
            if st.metrics.last is None:  # after a seek: the window's ends, so rates show at once
                st.metrics = metrics_from(ev, self.reader.hello.wall_start, self.window_s)
        else:
            return
        self.step = ev.step  # a snapshot at step s holds the state after tick s
        self.t = ev.t
        st.version += 1

    def _load(self, events, target: int | None) -> None:
        """Apply events at once up to tick ``target`` (None: only the opening snapshot), then play the rest."""
        it = iter(events)
        pending = None
        for ev in it:
            if target is None and type(ev) is not VllmSnapshotEvent:
                pending = ev
                break
            if target is not None and type(ev) is not VllmSnapshotEvent and ev.step > target:
                pending = ev
                break
            self.apply(ev)
        head = [pending] if pending is not None else []
        self.clock.load(itertools.chain(head, it), time.monotonic(), start=self.t)

    # -- the player ----------------------------------------------------------------
    def start(self) -> "VllmTraceSource":
        self._thread = threading.Thread(target=self._run, name="kvscope-vllm-replay", daemon=True)
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2.0)

    def _run(self) -> None:
        while not self._stop.is_set():
            with self.lock:
                self.pump(time.monotonic())
                wait = self.clock.next_due_in(time.monotonic())
            self._stop.wait(IDLE_S if wait is None else min(IDLE_S, max(0.0, wait)))

    def pump(self, now: float) -> int:
        """Apply what is due (the caller holds the lock); returns how many events."""
        due = self.clock.due(now, APPLY_LIMIT)
        for ev in due:
            self.apply(ev)
        if due:  # the label shows the last event's time; the clock is done right after its last pop
            self._label()
        return len(due)

    def play_to_end(self) -> None:
        with self.lock:
            while not self.clock.done:
                ev = self.clock.step(time.monotonic())
                if ev is not None:
                    self.apply(ev)
            self._label()

    def toggle(self) -> None:
        with self.lock:
            self.clock.toggle(time.monotonic())
            self._label()

    def set_speed(self, factor: float) -> None:
        with self.lock:
            self.clock.set_speed(self.clock.speed * factor, time.monotonic())
            self._label()

    def seek(self, step: int) -> None:
        """Rebuild the view at tick ``step`` from the nearest snapshot, then play on from there."""
        step = max(self.first_step, min(self.last_step, int(step)))
        with self.lock:
            self.state = self._fresh()
            self.t, self.step = 0.0, self.first_step
            self._load(self.reader.iter_from(step), step)
            self._label()

    def seek_by(self, fraction: float) -> None:
        span = max(1, self.last_step - self.first_step)
        self.seek(self.step + round(span * fraction))

    def _label(self) -> None:
        c = self.clock
        self.state.replay = ReplayPosition(os.path.basename(self.path), c.playing, c.done, c.speed, self.t,
                                           self.summary.t_last or 0.0, self.step, self.last_step)
        self.state.version += 1
