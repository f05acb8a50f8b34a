"""A run's headline figures from its events alone: what `kvscope bench` prints for it.

`RowTally` folds a trace's events, in order, into the bench row's figures (output
tok/s, TTFT mean/p50/p99, ITL p50/p99, preemptions, mean KV waste), with the same
definitions the engine's own MetricsCollector uses:
- only finished requests count (a request's TTFT, e2e and output tokens come from its
  `finish` record; its ITL gaps from the step `itl` samples);
- tok/s = output tokens / (last finish - first arrival), over finished requests;
- percentiles are nearest-rank, from the same fixed-memory estimator (QuantileSketch,
  docs/QUANTILES.md) over the same samples, so they equal the bench row's;
- KV waste is the mean over steps with allocated blocks of (tail + reserve waste) /
  allocated slots.
So a trace recorded by `kvscope race` gives the same row as bench for that run.

Goodput (kvscope.goodput) folds the same finish records, judged against the
SLO given (the trace's own unless overridden), over the same span as tok/s.
"""

from __future__ import annotations

from array import array
from typing import Any, Iterable

from ..goodput import NO_SLO, GoodputTally, RequestRecord, Slo, row_fields
from ..protocol.events import RequestEvent, StepEvent
from ..quantiles import QuantileSketch


class RowTally:
    """Streaming accumulator: ``add`` every event, then ``row()``. Memory: 8 bytes per ITL gap of a
    request still running, fixed for the finished ones."""

    def __init__(self, block_size: int = 16, slo: Slo = NO_SLO, cost_per_hour: float | None = None) -> None:
        self.block_size = max(1, int(block_size))  # the trace's, from its hello
        self.goodput = GoodputTally(slo)
        self.cost_per_hour = cost_per_hour
        self.arrivals: dict[int, float] = {}
        self.itl_by_req: dict[int, array] = {}
        self.ttft = QuantileSketch()
        self.itl = QuantileSketch()
        self.output_tokens = 0
        self.finished = 0
        self.requests = 0
        self.preemptions = 0
        self.steps = 0
        self.first_arrival: float | None = None
        self.last_finish: float | None = None
        self._waste_sum = 0.0
        self._waste_steps = 0

    def add(self, ev: Any) -> None:
        t = type(ev)
        if t is StepEvent:
            self._step(ev)
        elif t is RequestEvent:
            if ev.req not in self.arrivals:
                self.requests += 1
            self.arrivals[ev.req] = float(ev.arrival)

    def add_all(self, events: Iterable) -> "RowTally":
        for ev in events:
            self.add(ev)
        return self

    def _step(self, ev: StepEvent) -> None:
        self.steps += 1
        self.preemptions += len(ev.preemptions)
        for s in ev.itl:
            gaps = self.itl_by_req.get(s.req)
            if gaps is None:
                gaps = self.itl_by_req[s.req] = array("d")
            gaps.append(s.gap)
        end_t = float(ev.t + ev.dur)
        for f in ev.finished:
            self.goodput.add(RequestRecord.of_finish(f), end_t)
            self.finished += 1
            self.output_tokens += f.output_len
            if f.ttft is not None:
                self.ttft.add(f.ttft)
            gaps = self.itl_by_req.pop(f.req, None)
            if gaps is not None:
                self.itl.extend(gaps)
            arrival = self.arrivals.get(f.req)
            if arrival is not None:
                if self.first_arrival is None or arrival < self.first_arrival:
                    self.first_arrival = arrival
                if f.e2e is not None:
                    end = arrival + f.e2e
                    if self.last_finish is None or end > self.last_finish:
                        self.last_finish = end
        kv = ev.kv
        bs = self.block_size
        allocated = kv.used * bs
        if allocated:
            self._waste_sum += (kv.tail_waste + kv.reserve_waste) / allocated
            self._waste_steps += 1

    def row(self, name: str = "") -> dict[str, Any]:
        """The bench row's figures (same keys as `kvscope bench --json` rows)."""
        ttft, itl = self.ttft, self.itl
        span = (self.last_finish or 0.0) - (self.first_arrival or 0.0)
        return {
            "name": name,
            "output_tok_per_s": self.output_tokens / span if span > 0 else 0.0,
            "ttft_mean_s": ttft.mean,
            "ttft_p50_s": ttft.percentile(50),
            "ttft_p99_s": ttft.percentile(99),
            "itl_p50_s": itl.percentile(50),
            "itl_p99_s": itl.percentile(99),
            "preemptions": self.preemptions,
            "kv_waste": self._waste_sum / self._waste_steps if self._waste_steps else 0.0,
            "output_tokens": self.output_tokens,
            "duration_s": span,
            "steps": self.steps,
            "finished": self.finished,
            "requests": self.requests,
            **row_fields(self.goodput.figures(span), self.cost_per_hour),
        }


def figures_of(events: Iterable, block_size: int = 16, name: str = "", slo: Slo = NO_SLO,
               cost_per_hour: float | None = None) -> dict[str, Any]:
    """One pass over a run's events (hello first or not) to its bench row."""
    return RowTally(block_size, slo, cost_per_hour).add_all(events).row(name)
