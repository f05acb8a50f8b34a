"""Several replicas of one deployment (vLLM's data-parallel ranks, or servers behind one client), judged together.

Each replica's own diagnosis says what limits it; this says whether the load is spread: a replica whose
queue stays long while another has room to run more is an imbalance, and no knob of either replica's
scheduler fixes it (`kvscope diagnose a.kvtrace b.kvtrace`). The figures are each trace's own Signals:
the mean number of requests waiting over its busy steps, the share of those steps with anyone waiting, and
the mean share of its max_num_seqs running.
"""

from __future__ import annotations

import msgspec

from kvscope.analysis.diagnose import Diagnosis

LONG_QUEUE = 2.0  # mean requests waiting on the busiest replica before its queue counts as long
ROOM = 0.8  # a replica running under this share of its max_num_seqs, and with (almost) no queue, has room
NO_QUEUE = 0.5  # mean waiting at or under this: no queue to speak of


class Replica(msgspec.Struct, kw_only=True):
    source: str
    steps: int
    requests: int
    mean_waiting: float
    queued_frac: float
    running_share: float  # mean running / max_num_seqs over busy steps
    max_num_seqs: int | None
    output_tok_per_s: float
    ttft_p99_s: float | None


class ReplicaReport(msgspec.Struct, kw_only=True):
    replicas: list[Replica]
    uneven: bool
    verdict: str
    advice: str


def _replica(d: Diagnosis) -> Replica:
    s = d.signals
    cap = d.config.get("max_num_seqs")
    return Replica(source=d.source, steps=d.steps, requests=d.requests, mean_waiting=s.mean_queued if s else 0.0,
                   queued_frac=s.queued_frac if s else 0.0, running_share=s.running_mean if s else 0.0,
                   max_num_seqs=cap if isinstance(cap, int) else None,
                   output_tok_per_s=d.trace_figures.output_tok_per_s, ttft_p99_s=d.trace_figures.ttft_p99_s)


def judge_replicas(diagnoses: list[Diagnosis]) -> ReplicaReport:
    reps = [_replica(d) for d in diagnoses]
    busiest = max(reps, key=lambda r: (r.mean_waiting, r.running_share))
    idlest = min(reps, key=lambda r: (r.mean_waiting, r.running_share))
    room = idlest.mean_waiting <= NO_QUEUE and idlest.running_share < ROOM
    uneven = busiest is not idlest and busiest.mean_waiting >= LONG_QUEUE and room
    total_tok = sum(r.output_tok_per_s for r in reps)
    if uneven:
        share = busiest.output_tok_per_s / total_tok if total_tok else 0.0
        verdict = (f"imbalance: {busiest.source}'s queue averaged {busiest.mean_waiting:.1f} requests waiting "
                   f"(someone waited in {busiest.queued_frac:.0%} of its busy steps) while {idlest.source} averaged "
                   f"{idlest.mean_waiting:.1f} waiting and ran {_running(idlest)}; "
                   f"{busiest.source} made {share:.0%} of the output tokens")
        advice = ("route by load, not in turn: vLLM's data-parallel front end (one API server, "
                  "--data-parallel-size N) sends each request to the rank with the fewest waiting and running; "
                  "separate servers need a router that does the same (shortest queue, or KV-cache aware), not "
                  "round-robin. No scheduler knob of either replica fixes this")
    else:
        verdict = ("balanced: " + "; ".join(f"{r.source} {r.mean_waiting:.1f} waiting, ran {_running(r)}"
                                            for r in reps))
        advice = "each replica's own diagnosis below says what limits it"
    return ReplicaReport(replicas=reps, uneven=uneven, verdict=verdict, advice=advice)


def _running(r: Replica) -> str:
    """The mean running, as a count of its max_num_seqs when known."""
    if r.max_num_seqs:
        return f"{r.running_share * r.max_num_seqs:.1f} of {r.max_num_seqs} sequences"
    return f"{r.running_share:.0%} of its sequences"


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1000:.0f} ms"


def format_replicas(report: ReplicaReport) -> str:
    lines = [f"replicas: {len(report.replicas)} traces of one deployment, side by side",
             f"  {'trace':<28} {'steps':>6} {'requests':>8} {'waiting':>8} {'queued':>7} {'running':>9} "
             f"{'tok/s':>7} {'TTFT p99':>10}"]
    for r in report.replicas:
        run = f"{r.running_share * r.max_num_seqs:.1f}/{r.max_num_seqs}" if r.max_num_seqs else f"{r.running_share:.0%}"
        name = r.source if len(r.source) <= 28 else "…" + r.source[-27:]
        lines.append(f"  {name:<28} {r.steps:>6} {r.requests:>8} {r.mean_waiting:>8.1f} {r.queued_frac:>7.0%} "
                     f"{run:>9} {r.output_tok_per_s:>7.1f} {_ms(r.ttft_p99_s):>10}")
    lines += ["", report.verdict, f"  {report.advice}"]
    return "\n".join(lines)
