"""One pass over a trace into what the report plots, in memory that does not grow with the trace.

Per-step values go into at most ``MAX_BUCKETS`` buckets of equal step count; when they fill,
neighbours merge and the width doubles, so a 160k-step trace costs what a 1k-step one does.
Each bucket keeps the minimum, maximum and sum of every column: the plots draw the mean
with a band from the minimum to the maximum, so a one-step spike is never averaged away.
Latencies go into QuantileSketches; a sample of requests, spread evenly over arrivals,
keeps its timeline for the Gantt chart.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Iterable

from kvscope.goodput import GoodputTally, RequestRecord, Slo, resolve_slo, row_fields
from kvscope.protocol.events import DECODE, PREFILL
from kvscope.quantiles import QuantileSketch

MAX_BUCKETS = 600
GANTT_REQUESTS = 12  # requests drawn per run (the sample keeps between this and twice this many)
MAX_SLICES = 256  # prefill chunks kept per sampled request; later ones are counted only
# A trace's times and latencies are any finite float (up to 1.8e308 s); matplotlib cannot lay out an
# axis that wide. Engine times beyond +-MAX_SECONDS (about 32 years) and latencies outside
# [0, MAX_SECONDS] are left out of the plots and counted in a notice.
MAX_SECONDS = 1e9

COLUMNS = ("out_tokens", "prefill", "decode", "padding", "budget", "running", "waiting", "preempted",
           "kv_used", "kv_shared", "kv_cached", "kv_free", "kv_total", "waste_slots", "token_slots",
           "preemptions", "swaps", "good_tokens")  # good_tokens: output tokens of good requests finished
_IX = {name: i for i, name in enumerate(COLUMNS)}


@dataclass
class Bucket:
    t0: float  # engine time the first step began
    t1: float  # engine time the last step ended
    steps: int
    lo: list[float]
    hi: list[float]
    sum: list[float]

    def merge(self, other: "Bucket") -> None:
        self.t1 = max(self.t1, other.t1)
        self.steps += other.steps
        self.lo = [min(a, b) for a, b in zip(self.lo, other.lo)]
        self.hi = [max(a, b) for a, b in zip(self.hi, other.hi)]
        self.sum = [a + b for a, b in zip(self.sum, other.sum)]


class StepSeries:
    """Per-step columns, downsampled to at most ``limit`` buckets as they arrive."""

    def __init__(self, limit: int = MAX_BUCKETS) -> None:
        self.limit = max(2, limit - limit % 2)
        self.width = 1  # steps per bucket
        self.buckets: list[Bucket] = []
        self.steps = 0

    def add(self, t0: float, t1: float, values: list[float]) -> None:
        self.steps += 1
        last = self.buckets[-1] if self.buckets else None
        if last is not None and last.steps < self.width:  # in place: this runs once per step
            last.t1 = max(last.t1, t1)
            last.steps += 1
            lo, hi, total = last.lo, last.hi, last.sum
            for i, v in enumerate(values):
                if v < lo[i]:
                    lo[i] = v
                elif v > hi[i]:
                    hi[i] = v
                total[i] += v
            return
        self.buckets.append(Bucket(t0, t1, 1, list(values), list(values), list(values)))
        if len(self.buckets) > self.limit:
            merged = []
            for i in range(0, len(self.buckets) - 1, 2):
                a = self.buckets[i]
                a.merge(self.buckets[i + 1])
                merged.append(a)
            if len(self.buckets) % 2:
                merged.append(self.buckets[-1])
            self.buckets = merged
            self.width *= 2

    def column(self, name: str) -> tuple[list[float], list[float], list[float]]:
        """(mean, min, max) of one column per bucket."""
        i = _IX[name]
        return ([b.sum[i] / b.steps for b in self.buckets], [b.lo[i] for b in self.buckets],
                [b.hi[i] for b in self.buckets])

    def times(self) -> list[float]:
        """Each bucket's midpoint, in engine seconds."""
        return [(b.t0 + b.t1) / 2 for b in self.buckets]

    def rate(self, name: str) -> list[float]:
        """A column's sum per second of engine time in each bucket (e.g. output tokens per second)."""
        i = _IX[name]
        return [b.sum[i] / (b.t1 - b.t0) if b.t1 > b.t0 else 0.0 for b in self.buckets]

    def total(self, name: str) -> float:
        i = _IX[name]
        return sum(b.sum[i] for b in self.buckets)


@dataclass
class RequestLine:
    """One sampled request's timeline, for the Gantt chart."""

    req: int
    arrival: float
    prompt_len: int
    prefill: list[tuple[float, float]] = field(default_factory=list)  # (start, end) of each chunk
    more_chunks: int = 0  # chunks past MAX_SLICES, counted only
    decode_start: float | None = None
    end: float | None = None
    finish: str | None = None
    preempted_at: list[float] = field(default_factory=list)


class RequestSample:
    """Every ``stride``-th arrival; the stride doubles when the sample grows past twice the target."""

    def __init__(self, target: int = GANTT_REQUESTS) -> None:
        self.target = target
        self.stride = 1
        self.arrivals = 0
        self.lines: dict[int, RequestLine] = {}
        self._ordinal: dict[int, int] = {}

    def arrive(self, req: int, arrival: float, prompt_len: int) -> None:
        ordinal = self.arrivals
        self.arrivals += 1
        if ordinal % self.stride:
            return
        self.lines[req] = RequestLine(req, arrival, prompt_len)
        self._ordinal[req] = ordinal
        if len(self.lines) > 2 * self.target:
            self.stride *= 2
            for r in [r for r, o in self._ordinal.items() if o % self.stride]:
                del self.lines[r], self._ordinal[r]

    def get(self, req: int) -> RequestLine | None:
        return self.lines.get(req)


@dataclass
class RunSeries:
    """Everything the report draws of one trace."""

    path: str
    label: str
    name: str  # what the run is, for legends: its mode and policy
    config: dict
    steps: StepSeries = field(default_factory=StepSeries)
    ttft: QuantileSketch = field(default_factory=QuantileSketch)
    itl: QuantileSketch = field(default_factory=QuantileSketch)
    requests: RequestSample = field(default_factory=RequestSample)
    finished: int = 0
    notices: list[str] = field(default_factory=list)
    t_end: float = 0.0
    goodput: GoodputTally = field(default_factory=GoodputTally)  # finish records against the SLO (docs/GOODPUT.md)
    cost_per_hour: float | None = None  # --cost-per-hour: $ per million tokens in the runs table
    out_of_range: int = 0  # steps, arrivals and latency samples left out (times beyond MAX_SECONDS)

    @property
    def output_tokens(self) -> int:
        return int(self.steps.total("out_tokens"))

    @property
    def preemptions(self) -> int:
        return int(self.steps.total("preemptions"))

    def figures(self) -> dict:
        span = self.t_end - (self.steps.buckets[0].t0 if self.steps.buckets else 0.0)
        p = lambda s, q: s.quantile(q) if s.n else None  # noqa: E731
        return {"steps": self.steps.steps, "requests": self.requests.arrivals, "finished": self.finished,
                "output_tokens": self.output_tokens, "duration_s": span,
                "output_tok_per_s": self.output_tokens / span if span > 0 else 0.0,
                "ttft_p50_s": p(self.ttft, 0.5), "ttft_p99_s": p(self.ttft, 0.99),
                "itl_p50_s": p(self.itl, 0.5), "itl_p99_s": p(self.itl, 0.99), "preemptions": self.preemptions,
                **row_fields(self.goodput.figures(span), self.cost_per_hour)}


def fold(run: RunSeries, events: Iterable) -> RunSeries:
    """Apply a trace's events, in order, to ``run``."""
    sample = run.requests
    for ev in events:
        kind = ev.type
        if kind == "step":
            _step(run, ev)
        elif kind == "request":
            if -MAX_SECONDS <= ev.arrival <= MAX_SECONDS:
                sample.arrive(ev.req, ev.arrival, ev.prompt_len)
            else:
                run.out_of_range += 1
    return run


def _latency(run: RunSeries, sketch, v: float) -> None:
    if 0.0 <= v <= MAX_SECONDS:
        sketch.add(v)
    else:
        run.out_of_range += 1


def _step(run: RunSeries, ev) -> None:
    t0, t1 = ev.t, ev.t + ev.dur
    if not (-MAX_SECONDS <= t0 <= MAX_SECONDS and -MAX_SECONDS <= t1 <= MAX_SECONDS):
        run.out_of_range += 1  # a step out of any run's time: nothing of it can be placed on an axis
        return
    prefill = decode = 0
    for b in ev.batch:
        if b.kind == PREFILL:
            prefill += b.tokens
            line = run.requests.get(b.req)
            if line is not None:
                if len(line.prefill) < MAX_SLICES:
                    line.prefill.append((t0, t1))
                else:
                    line.more_chunks += 1
        elif b.kind == DECODE:
            decode += b.tokens
            line = run.requests.get(b.req)
            if line is not None and line.decode_start is None:
                line.decode_start = t0
    for p in ev.preemptions:
        line = run.requests.get(p.req)
        if line is not None and len(line.preempted_at) < MAX_SLICES:
            line.preempted_at.append(t0)
    for f in ev.first_tokens:
        _latency(run, run.ttft, f.ttft)
    for s in ev.itl:
        _latency(run, run.itl, s.gap)
    good_tokens = 0
    for f in ev.finished:
        if run.goodput.add(RequestRecord.of_finish(f), t1).good:
            good_tokens += f.output_len
        run.finished += 1
        line = run.requests.get(f.req)
        if line is not None:
            line.end, line.finish = t1, f.reason
    kv = ev.kv
    values = [float(len(ev.sampled)), float(prefill), float(decode), float(ev.padding), float(ev.budget),
              float(len(ev.running)), float(len(ev.waiting)), float(len(ev.preempted) + len(ev.swapped)),
              float(kv.used), float(kv.shared), float(kv.cached), float(kv.free), float(kv.total),
              float(kv.tail_waste + kv.reserve_waste), float(kv.token_slots),
              float(len(ev.preemptions)), float(len(ev.swaps)), float(good_tokens)]
    if all(math.isfinite(v) for v in values):
        run.steps.add(t0, t1, values)
        run.t_end = max(run.t_end, t1)


def read_trace(path: str, label: str, slo: Slo | None = None, cost_per_hour: float | None = None) -> RunSeries:
    """A trace's series; damage becomes notices (what was read before it still plots)."""
    from kvscope.protocol.codec import ProtocolError
    from kvscope.traces.reader import TraceReader

    reader = TraceReader(path)  # a file that is no trace at all raises, for the caller to report
    config = reader.hello.config
    as_dict = config.as_dict() if hasattr(config, "as_dict") else {}
    if as_dict.get("backend") == "vllm":
        raise ProtocolError("a recorded vLLM has no scheduler steps to plot (kvscope replay shows it)")
    mode = str(as_dict.get("mode") or "")
    policy = str(as_dict.get("policy") or "")
    name = mode + (f" / {policy}" if policy and policy != "fcfs" else "")
    from kvscope.report.inputs import plain_text

    run = RunSeries(path=path, label=label, name=plain_text(name or os.path.basename(path)), config=as_dict,
                    goodput=GoodputTally(resolve_slo(slo, config)), cost_per_hour=cost_per_hour)
    try:
        fold(run, reader)
    except ProtocolError as e:
        run.notices.append(f"damaged after step {run.steps.steps}: {e}")
    if run.out_of_range:
        run.notices.append(f"{run.out_of_range} steps, arrivals or latencies with times beyond "
                           f"{MAX_SECONDS:.0e} s (or negative latencies) are left out of the plots")
    run.notices.extend(reader.warnings)
    return run
