"""`kvscope export TRACE`: Perfetto / chrome://tracing JSON and CSV tables, in one streaming pass (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.protocol.events import RejectEvent, RequestEvent, SnapshotEvent, StepEvent
from kvscope.serve.export.lifecycle import Lifecycles


@dataclass
class ExportStats:
    steps: int = 0
    requests: int = 0
    slices: int = 0
    lanes: int = 0


def export_trace(trace: str, perfetto: str | None = None, requests_csv: str | None = None,
                 steps_csv: str | None = None) -> ExportStats:
    from kvscope.output_paths import CSV, JSON, check_outputs
    from kvscope.traces.reader import engine_trace

    check_outputs([(perfetto, JSON, "--perfetto"), (requests_csv, CSV, "--requests"), (steps_csv, CSV, "--steps")],
                  inputs=[trace])  # never over the trace it reads, nor over a file of another kind
    reader = engine_trace(trace, "export")
    writers = []
    if perfetto:
        from kvscope.serve.export.perfetto import PerfettoWriter

        writers.append(PerfettoWriter(perfetto, title=f"kvscope {trace}"))
    if requests_csv or steps_csv:
        from kvscope.serve.export.tables import RequestsCsv, StepsCsv

        writers += [RequestsCsv(requests_csv)] if requests_csv else []
        writers += [StepsCsv(steps_csv)] if steps_csv else []
    on_step = [w.step for w in writers if hasattr(w, "step")]
    on_request = [w.request for w in writers if hasattr(w, "request")]
    on_reject = [w.reject for w in writers if hasattr(w, "reject")]
    stats = ExportStats()

    def ended(life) -> None:
        stats.requests += 1
        for f in on_request:
            f(life)

    lives = Lifecycles(ended)
    t_end = 0.0
    try:
        for ev in reader:
            if isinstance(ev, StepEvent):
                stats.steps += 1
                lives.step(ev)
                for f in on_step:
                    f(ev)
                t_end = ev.t + ev.dur
            elif isinstance(ev, RequestEvent):
                lives.request(ev)
            elif isinstance(ev, SnapshotEvent):
                lives.snapshot(ev)
                t_end = max(t_end, ev.t)
            elif isinstance(ev, RejectEvent):
                for f in on_reject:
                    f(ev)
        lives.close(t_end)
    finally:
        for w in writers:
            w.close()
    for w in writers:
        stats.slices += getattr(w, "slices", 0)
        stats.lanes = max(stats.lanes, getattr(getattr(w, "lanes", None), "count", 0))
    return stats
