"""What a trace holds, in numbers: TraceSummary, and the tally both writer and reader keep."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ..goodput import GoodputTally
from ..protocol.events import TICK_TYPES, RejectEvent, RequestEvent, SnapshotEvent, StepEvent
from ..quantiles import STANDARD, QuantileSketch


@dataclass
class TraceSummary:
    format_version: int
    protocol_version: int
    wall_start: float  # engine start, wall clock (hello)
    events: int  # events after the header (hello not counted)
    steps: int  # step events
    first_step: int | None
    last_step: int | None
    t_first: float | None  # engine time at the start of the first step
    t_last: float | None  # engine time at the end of the last step
    requests: int  # distinct request ids seen (request events and snapshots)
    rejects: int
    preemptions: int
    finished: int
    dropped: int  # events the publisher reported lost (sum of step.dropped)
    chunks: int
    bytes: int  # file size
    complete: bool  # index and footer present and valid
    warnings: list[str] = field(default_factory=list)

    @property
    def span(self) -> float:
        if self.t_first is None or self.t_last is None:
            return 0.0
        return self.t_last - self.t_first


class Tally:
    """Running counts over events; the writer stores them in the index."""

    __slots__ = (
        "events",
        "steps",
        "first_step",
        "last_step",
        "t_first",
        "t_last",
        "req_ids",
        "rejects",
        "preemptions",
        "finished",
        "dropped",
    )

    def __init__(self) -> None:
        self.events = 0
        self.steps = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.req_ids: set[int] = set()
        self.rejects = 0
        self.preemptions = 0
        self.finished = 0
        self.dropped = 0

    def add(self, ev) -> None:
        self.events += 1
        t = type(ev)
        if t is StepEvent:
            self._tick(ev, float(ev.t + ev.dur))  # a step ends when its event is sent
            self.preemptions += len(ev.preemptions)
            self.finished += len(ev.finished)
            self.dropped += ev.dropped
        elif t is RequestEvent:
            self.req_ids.add(ev.req)
        elif t is RejectEvent:
            self.rejects += 1
        elif t is SnapshotEvent:
            self.req_ids.update(r.req for r in ev.requests)
        elif t in TICK_TYPES:  # a recorded vLLM's scrapes and KV batches
            self._tick(ev, float(ev.t))

    def _tick(self, ev, end: float) -> None:
        self.steps += 1
        if self.first_step is None:
            self.first_step = ev.step
            self.t_first = float(ev.t)
        self.last_step = ev.step
        if self.t_last is None or end > self.t_last:
            self.t_last = end

    def to_wire(self) -> dict[str, Any]:
        return {
            "events": self.events,
            "steps": self.steps,
            "first_step": self.first_step,
            "last_step": self.last_step,
            "t_first": self.t_first,
            "t_last": self.t_last,
            "requests": len(self.req_ids),
            "rejects": self.rejects,
            "preemptions": self.preemptions,
            "finished": self.finished,
            "dropped": self.dropped,
        }


class LatencyTally:
    """TTFT and ITL over a trace's step events, as the one percentile estimator sees them.

    The same samples the TUI's histograms fold (first-token TTFTs, ITL gaps), in
    ``QuantileSketch``es, so the figures match the dashboard's; fixed memory.
    """

    __slots__ = ("ttft", "itl", "goodput")

    def __init__(self, ttft: QuantileSketch | None = None, itl: QuantileSketch | None = None,
                 goodput: GoodputTally | None = None) -> None:
        self.ttft = ttft if ttft is not None else QuantileSketch()
        self.itl = itl if itl is not None else QuantileSketch()
        self.goodput = goodput if goodput is not None else GoodputTally()  # finish records against an SLO

    def add(self, ev) -> None:
        if type(ev) is StepEvent:
            for ft in ev.first_tokens:
                self.ttft.add(ft.ttft)
            for s in ev.itl:
                self.itl.add(s.gap)
            if ev.finished:
                self.goodput.add_step(ev)

    def figures(self) -> dict[str, dict[str, float | None | int]]:
        """{"ttft": {"n", "p50", "p90", "p99"}, "itl": {...}} in seconds."""
        out: dict[str, dict[str, float | None | int]] = {}
        for name, sk in (("ttft", self.ttft), ("itl", self.itl)):
            row: dict[str, float | None | int] = {"n": sk.n}
            for q, v in zip(STANDARD, sk.quantiles(STANDARD)):
                row[f"p{round(q * 100)}"] = v
            out[name] = row
        return out
