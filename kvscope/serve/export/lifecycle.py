"""Each request's life, rebuilt from the event stream: its phases as time slices, and its totals at the end.

State is kept only for live requests, so memory follows the number of requests
in flight, not the length of the trace. A phase is one of:

- ``queued``: arrival until first scheduled;
- ``preempted`` / ``swapped``: back in WAITING after a recompute / swap preemption, until readmitted;
- ``prefill``: one slice per step that computed a prefill chunk of it;
- ``decode``: from its first decode step to its last, one slice per uninterrupted run.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from kvscope.protocol.events import DECODE, PREFILL, RequestEvent, SnapshotEvent, StepEvent

QUEUED, PREEMPTED, SWAPPED = "queued", "preempted", "swapped"
WAIT_PHASES = (QUEUED, PREEMPTED, SWAPPED)


@dataclass(slots=True)
class Slice:
    phase: str
    start: float
    end: float
    tokens: int = 0  # prefill: tokens of this chunk; decode: tokens decoded in this run


@dataclass(slots=True)
class Life:
    req: int
    arrival: float
    prompt_len: int = 0
    max_tokens: int = 0
    priority: int = 0
    source: str = ""
    cached_tokens: int = 0
    ttft: float | None = None
    first_scheduled: float | None = None
    prefill_chunks: int = 0
    preemptions: int = 0
    output_len: int = 0
    e2e: float | None = None
    finish_reason: str = ""
    finish_t: float | None = None
    phase: str = QUEUED
    phase_start: float = 0.0  # start of the open wait or decode slice
    phase_tokens: int = 0
    last_end: float = 0.0  # end of the last step that computed it
    slices: list[Slice] = field(default_factory=list)


class Lifecycles:
    """Feed it events in order; `on_end(life)` is called once per request, when it finishes or at `close()`."""

    def __init__(self, on_end: Callable[[Life], None]) -> None:
        self.on_end = on_end
        self.live: dict[int, Life] = {}

    def _get(self, req: int, t: float) -> Life:
        life = self.live.get(req)
        if life is None:  # seen before its request event (a trace cut in, or a late subscriber)
            life = self.live[req] = Life(req, t, phase_start=t)
        return life

    def request(self, ev: RequestEvent) -> None:
        life = self._get(ev.req, ev.arrival)
        life.arrival, life.phase_start = ev.arrival, ev.arrival
        life.prompt_len, life.max_tokens, life.priority = ev.prompt_len, ev.max_tokens, ev.priority
        life.source = getattr(ev, "source", "")

    def snapshot(self, ev: SnapshotEvent) -> None:
        """Only requests not seen before matter: those already live when the trace began."""
        for rs in ev.requests:
            if rs.req in self.live:
                continue
            life = self._get(rs.req, rs.arrival)
            life.prompt_len, life.max_tokens, life.priority = rs.prompt_len, rs.max_tokens, rs.priority
            life.cached_tokens, life.ttft, life.preemptions = rs.cached_tokens, rs.ttft, rs.preemptions
            life.source = getattr(rs, "source", "")
            if rs.state in (QUEUED, "waiting", PREEMPTED, SWAPPED):
                life.phase = {"waiting": QUEUED}.get(rs.state, rs.state)
                life.phase_start = rs.arrival if life.phase == QUEUED else ev.t
            else:  # running: its slices start at the snapshot
                life.phase, life.phase_start, life.last_end = "running", ev.t, ev.t
                life.first_scheduled = ev.t

    def step(self, ev: StepEvent) -> None:
        start, end = ev.t, ev.t + ev.dur
        for p in ev.preemptions:  # applied at the start of the step, before its batch ran
            life = self._get(p.req, start)
            self._close_running(life)
            life.preemptions += 1
            life.phase, life.phase_start = (SWAPPED if p.mode == "swap" else PREEMPTED), start
        for h in ev.hits:
            life = self._get(h.req, start)
            if life.first_scheduled is None:
                life.cached_tokens = h.tokens
        for b in ev.batch:
            life = self._get(b.req, start)
            if life.phase in WAIT_PHASES:
                if start > life.phase_start:
                    life.slices.append(Slice(life.phase, life.phase_start, start))
                if life.first_scheduled is None:
                    life.first_scheduled = start
            if b.kind == PREFILL:
                self._close_running(life)
                life.slices.append(Slice(PREFILL, start, end, b.tokens))
                life.prefill_chunks += 1
                life.phase = PREFILL
            elif life.phase != DECODE:
                self._close_running(life)
                life.phase, life.phase_start, life.phase_tokens = DECODE, start, b.tokens
            else:
                life.phase_tokens += b.tokens
            life.last_end = end
        for ft in ev.first_tokens:
            self._get(ft.req, start).ttft = ft.ttft
        for f in ev.finished:
            life = self.live.pop(f.req, None) or Life(f.req, start, phase_start=start)
            if life.phase in WAIT_PHASES and start > life.phase_start:  # ended while waiting (an abort)
                life.slices.append(Slice(life.phase, life.phase_start, start))
            self._close_running(life)
            life.output_len, life.e2e, life.finish_reason = f.output_len, f.e2e, f.reason
            life.ttft = life.ttft if life.ttft is not None else (f.ttft or None)
            life.finish_t = life.last_end if life.phase not in WAIT_PHASES else start
            self.on_end(life)

    @staticmethod
    def _close_running(life: Life) -> None:
        if life.phase in (DECODE, "running") and life.last_end > life.phase_start:
            life.slices.append(Slice(life.phase, life.phase_start, life.last_end, life.phase_tokens))
        if life.phase not in WAIT_PHASES:
            life.phase = "done"

    def close(self, t: float) -> None:
        """The trace ended: hand over the requests still live, their open slices closed at t."""
        for life in self.live.values():
            if life.phase in WAIT_PHASES and t > life.phase_start:
                life.slices.append(Slice(life.phase, life.phase_start, t))
            self._close_running(life)
            self.on_end(life)
        self.live.clear()
