"""A recorded vLLM (`kvscope record --vllm`) played back into the same VllmState the live view draws.

VllmTraceSource has the live VllmSource's face (``state``, ``lock``, ``close``) and is a
cursor for the TUI's one player (``kvscope.tui.model.player``): its steps are the recorder's
ticks, and ``seek(tick)`` applies the events up to that tick (forward, in order; back,
from the nearest chunk snapshot). The player decides when; nothing here keeps time.
"""

from __future__ import annotations

import itertools
import os
import threading
import time
from array import array

from kvscope.vllm.watch.source import VllmState, apply_batch
from kvscope.vllm.watch.trace import batch_from, cache_from, metrics_from, restore_kv, scrape_from
from kvscope.errors import KvscopeError
from kvscope.protocol.events import VllmKvEvent, VllmMetricsEvent, VllmSnapshotEvent
from kvscope.traces.reader import TraceReader
from kvscope.traces.replay import ReplayClock



class VllmTraceSource:
    def __init__(self, path: str | os.PathLike, *, window_s: float = 30.0, speed: float = 1.0,
                 playing: bool = False) -> None:
        """``speed`` and ``playing`` are accepted from callers of the old self-playing source and
        ignored: a cursor never keeps time, the player (kvscope.tui.model.player) does."""
        self.path = os.fspath(path)
        self.reader = self.trace = TraceReader(self.path)
        if not self.reader.vllm_recording:
            raise KvscopeError(f"{self.path} is a kvscope engine trace, not a vLLM recording")
        self.window_s = window_s
        self.summary = self.reader.summary()
        self._index()
        self.first_step = self.steps[0] if self.steps else (self.summary.first_step or 0)
        self.last_step = self.steps[-1] if self.steps else (self.summary.last_step or 0)
        self.lock = threading.Lock()
        self.state = self._fresh()
        self.step = self.first_step
        self.t = 0.0
        self._held = None  # the first event past the tick shown, popped while seeking forward
        self.clock = ReplayClock(now=time.monotonic(), playing=False)  # paused: only stepped
        self._load(self.reader.iter_from(self.first_step), None)

    def _index(self) -> None:
        """One pass: each tick's time, the cursor's step index (the player's axis)."""
        ticks: dict[int, float] = {}
        for ev in self.reader:
            if type(ev) in (VllmMetricsEvent, VllmKvEvent):
                ticks[ev.step] = max(ticks.get(ev.step, ev.t), ev.t)
        self.steps = sorted(ticks)
        self.step_t = array("d", (ticks[k] for k in self.steps)).tolist()
        self.start_t = self.step_t[0] if self.step_t else 0.0
        self.preempt_steps: list[int] = []  # vLLM's events carry no preemptions

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
        self._held = None
        self.clock.load(itertools.chain(head, it), time.monotonic(), start=self.t)

    # -- the cursor ------------------------------------------------------------------
    def close(self) -> None:
        """Nothing runs on its own: kept for the live source's face."""

    def play_to_end(self) -> None:
        with self.lock:
            self._forward(None)

    def finish(self) -> None:
        self.play_to_end()

    def _forward(self, step: int | None) -> None:
        """Apply recorded events in order up to tick ``step`` (None: to the end); the caller holds the lock."""
        now = time.monotonic()
        while True:
            ev, self._held = (self._held, None) if self._held is not None else (self.clock.step(now), None)
            if ev is None:
                return
            if step is not None and type(ev) is not VllmSnapshotEvent and ev.step > step:
                self._held = ev
                return
            self.apply(ev)

    def seek(self, step: int) -> int:
        """The view at tick ``step``: forward by applying what follows, back from the nearest snapshot."""
        step = max(self.first_step, min(self.last_step, int(step)))
        with self.lock:
            if step < self.step:
                self.state = self._fresh()
                self.t, self.step = 0.0, self.first_step
                self._load(self.reader.iter_from(step), step)
            self._forward(step)
        return step
