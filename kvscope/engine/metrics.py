"""Latency and throughput summaries over finished requests."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from kvscope.engine.request import Request
from kvscope.quantiles import QuantileSketch, percentile

__all__ = ["MetricsCollector", "Summary", "mean", "percentile", "summary_table"]


def mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


@dataclass
class MetricsCollector:
    """Accumulates what finished requests report; fixed memory, so it can run forever.

    Percentiles come from ``QuantileSketch`` (nearest rank, within 0.5%; docs/QUANTILES.md).
    """

    ttft: QuantileSketch = field(default_factory=QuantileSketch)
    itl: QuantileSketch = field(default_factory=QuantileSketch)
    output_tokens: int = 0
    requests: int = 0
    rejected: int = 0
    first_arrival: float | None = None
    last_finish: float | None = None

    def add(self, req: Request) -> None:
        m = req.metrics()
        self.requests += 1
        self.output_tokens += m.num_output_tokens
        if m.ttft is not None:
            self.ttft.add(m.ttft)
        self.itl.extend(m.itl)
        if self.first_arrival is None or req.arrival < self.first_arrival:
            self.first_arrival = req.arrival
        if req.finish_time is not None and (self.last_finish is None or req.finish_time > self.last_finish):
            self.last_finish = req.finish_time

    def summary(self, *, preemptions: int, kv_waste: float, steps: int) -> "Summary":
        span = (self.last_finish or 0.0) - (self.first_arrival or 0.0)
        return Summary(
            requests=self.requests,
            rejected=self.rejected,
            output_tokens=self.output_tokens,
            duration_s=span,
            output_tok_per_s=self.output_tokens / span if span > 0 else 0.0,
            ttft_mean_s=self.ttft.mean,
            ttft_p50_s=self.ttft.percentile(50),
            ttft_p99_s=self.ttft.percentile(99),
            itl_p50_s=self.itl.percentile(50),
            itl_p99_s=self.itl.percentile(99),
            preemptions=preemptions,
            kv_waste=kv_waste,
            steps=steps,
        )


@dataclass
class Summary:
    requests: int
    rejected: int
    output_tokens: int
    duration_s: float
    output_tok_per_s: float
    ttft_mean_s: float | None
    ttft_p50_s: float | None
    ttft_p99_s: float | None
    itl_p50_s: float | None
    itl_p99_s: float | None
    preemptions: int
    kv_waste: float | None
    steps: int

    def to_dict(self) -> dict:
        return asdict(self)


def fmt_ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.1f} ms"


def fmt_pct(fraction: float | None) -> str:
    return "-" if fraction is None else f"{fraction * 100:.1f}%"


def summary_table(s: Summary) -> str:
    rows = [
        ("requests", f"{s.requests}" + (f" ({s.rejected} rejected)" if s.rejected else "")),
        ("output tokens", f"{s.output_tokens}"),
        ("duration", f"{s.duration_s:.2f} s"),
        ("output tok/s", f"{s.output_tok_per_s:.1f}"),
        ("TTFT mean / p50 / p99", f"{fmt_ms(s.ttft_mean_s)} / {fmt_ms(s.ttft_p50_s)} / {fmt_ms(s.ttft_p99_s)}"),
        ("ITL p50 / p99", f"{fmt_ms(s.itl_p50_s)} / {fmt_ms(s.itl_p99_s)}"),
        ("preemptions", f"{s.preemptions}"),
        ("KV waste (mean)", fmt_pct(s.kv_waste)),
        ("steps", f"{s.steps}"),
    ]
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)
