"""`kvscope diagnose`: one bottleneck, the evidence, ordered knobs checked by the sim, what to watch next.

``diagnose_events(events)`` and ``diagnose_trace(path)`` return a typed
``Diagnosis`` (msgspec Struct; JSON is ``msgspec.json.encode`` of it, text is
``format_text`` of the same struct). The verdict reads protocol events only; the
what-if (``what_if=True``) re-runs the trace's requests through the sim, which is
the only step that loads the engine.
"""

from __future__ import annotations

from typing import Any, Iterable

import msgspec

from kvscope.analysis import knobs as K
from kvscope.analysis import verdicts as V
from kvscope.analysis.figures import RunFigures
from kvscope.goodput import GoodputTally, Slo, slo_of_flat
from kvscope.analysis.knobs import Knob
from kvscope.analysis.signals import Signals, StepLog, measure
from kvscope.analysis.verdicts import Evidence
from kvscope.analysis.whatif import TraceRequests
from kvscope.errors import KvscopeError
from kvscope.protocol.events import StepEvent

MIN_BUSY_STEPS = 8  # fewer busy steps than this: too little to judge
CALIBRATION_STEPS = 50_000  # steps kept for calibrating the sim to a model-backend trace


class Runner(msgspec.Struct, kw_only=True):
    bottleneck: str
    score: float
    evidence: str  # its strongest figure


class Diagnosis(msgspec.Struct, kw_only=True):
    source: str
    backend: str
    config: dict[str, Any]
    steps: int
    requests: int
    window: int | None  # None: the whole trace
    bottleneck: str  # one of verdicts.BOTTLENECKS
    score: float
    evidence: list[Evidence]
    secondary: list[Runner]
    knobs: list[Knob]
    measure_next: str
    refusals: list[str]
    cannot_judge: list[str]
    trace_figures: RunFigures
    what_if: Any = None  # predict.WhatIf, or None with --no-what-if
    signals: Signals | None = None
    vllm: Any = None  # adapters.vllm_signals.VllmFacts for a watched vLLM: its settings and where each came from
    # with an SLO (--slo, or the trace's own; docs/GOODPUT.md): what it was, which targets fail and why
    slo: str = ""
    slo_findings: list[str] = []


class NoSteps(KvscopeError, ValueError):
    """The stream holds no step: there is nothing to diagnose."""


def _config_line(cfg: dict) -> dict[str, Any]:
    keys = ("backend", "model", "gpu", "device", "tp", "mode", "policy", "num_blocks", "block_size", "max_num_seqs",
            "max_num_batched_tokens", "gpu_memory_utilization", "kv_cache_dtype", "prefix_caching", "preemption")
    return {k: cfg[k] for k in keys if k in cfg}


def judge(log: StepLog, requests: TraceRequests | None = None, source: str = "<events>",
          warnings: Iterable[str] = ()) -> Diagnosis:
    """The verdict from what a StepLog holds (no what-if); the live panel calls this."""
    if not log.rows:
        raise NoSteps(f"{source}: no steps to diagnose (the engine never ran an iteration)")
    cfg = {k: v for k, v in log.config.items() if not k.startswith("_")}
    s = measure(log)
    cannot = list(warnings)
    if s.busy_steps < MIN_BUSY_STEPS:
        cannot.append(f"only {s.busy_steps} busy steps: too few to judge reliably")
    arrivals = len(requests.requests) if requests is not None else s.requests
    if arrivals == 0:
        cannot.append("no requests in the stream (no request events): TTFT, queue times and the what-if "
                      "cannot be judged")
    elif s.finished < s.requests:
        cannot.append(f"{s.requests - s.finished} of {s.requests} requests had not finished when the stream ended;"
                      " their latencies are not counted")
    if not cfg:
        cannot.append("no hello: the engine config is unknown, so knobs cannot name their current values")
    top, rest = V.rule(s, cfg)
    if str(cfg.get("backend", "")).startswith("vllm"):  # a vLLM's own steps (adapters.vllm_plugin): its flags
        from kvscope.analysis import vllm_knobs

        knobs, refusals = vllm_knobs.choose(top.bottleneck, rest, cfg, s)
    else:
        knobs, refusals = K.choose(top.bottleneck, rest, cfg, s)
    secondary = [Runner(bottleneck=r.bottleneck, score=round(r.score, 2), evidence=r.evidence[0].text) for r in rest]
    figures = requests.figures() if requests is not None else RunFigures(
        output_tok_per_s=0.0, ttft_p50_s=s.ttft_p50, ttft_p99_s=s.ttft_p99, itl_p99_s=s.itl_p99,
        preemptions=s.preemptions_kv + s.preemptions_priority)
    return Diagnosis(
        source=source, backend=str(cfg.get("backend", "model")), config=_config_line(cfg), steps=s.steps,
        requests=s.requests, window=log.window, bottleneck=top.bottleneck, score=round(top.score, 2),
        evidence=top.evidence, secondary=secondary, knobs=knobs, measure_next=K.MEASURE_NEXT[top.bottleneck],
        refusals=refusals, cannot_judge=cannot, trace_figures=figures, signals=s)


def diagnose_events(events: Iterable[Any], *, window: int | None = None, what_if: bool = True,
                    source: str = "<events>", warnings: Iterable[str] = (), slo: Slo | None = None) -> Diagnosis:
    """Diagnose a sequence of protocol events (a trace's, or a live stream's)."""
    log = StepLog(window)
    tr = TraceRequests()
    calib: list[StepEvent] | None = None
    total_steps = 0
    for ev in events:
        log.add(ev)
        tr.add(ev)
        if type(ev) is StepEvent:
            total_steps += 1
            if calib is None and log.config.get("backend", "sim") != "sim":
                calib = []
            if calib is not None and len(calib) < CALIBRATION_STEPS:
                calib.append(ev)
    d = judge(log, tr, source, warnings)
    slo = slo if slo else slo_of_flat(log.config)
    if slo:
        d.slo = slo.describe()
        d.trace_figures = tr.figures(slo=slo)
        d.slo_findings = slo_findings(tr.goodput(slo), d.bottleneck)
    if what_if:
        from kvscope.analysis.predict import predict

        d.what_if = predict(tr, {k: v for k, v in log.config.items() if not k.startswith("_")}, d.knobs,
                            total_steps, calib, slo=slo)
        if slo:
            rank_by_goodput(d)
    return d


# What lengthens each SLO's figure, in the scheduler's terms (the verdict's "why").
SLO_CAUSES = {
    "ttft": "TTFT is queueing in WAITING plus the prompt's prefill",
    "tpot": "TPOT is the decode steps a request shares with prefill chunks and the other running requests",
    "e2el": "end-to-end latency is the queueing, the prefill and every decode step",
}


def slo_findings(tally: GoodputTally, bottleneck: str) -> list[str]:
    """One line per SLO target: the share meeting it, and, for a failing one, why (the bottleneck)."""
    fig = tally.figures()
    out = [f"goodput {fig.goodput_tok_per_s:,.1f} of {fig.output_tok_per_s:,.1f} output tok/s: "
           f"{fig.good_requests} of {fig.requests} finished requests met every target"]
    for key, share in fig.met.items():
        target = tally.slo.target_ms(key)
        if share is None:
            continue
        if share >= 1.0:
            out.append(f"{key} <= {target:g} ms: met by every request")
        else:
            out.append(f"{key} <= {target:g} ms FAILS for {(1 - share) * 100:.0f}% of requests; "
                       f"{SLO_CAUSES[key]}, and the bottleneck is {bottleneck}")
    return out


def rank_by_goodput(d: Diagnosis) -> None:
    """With an SLO, goodput decides: a knob whose own what-if predicts lower goodput than the baseline is
    refused (moved to refusals); the rest are ordered by predicted goodput, best first (unpredicted last)."""
    kept, refused = [], []
    for k in d.knobs:
        base = k.baseline.goodput_tok_per_s if k.baseline is not None else None
        new = k.predicted.goodput_tok_per_s if k.predicted is not None else None
        if base is not None and new is not None and new < base:
            refused.append(f"not recommended: {k.flag} {k.from_} -> {k.to} would raise tok/s "
                           f"{k.baseline.output_tok_per_s:,.1f} -> {k.predicted.output_tok_per_s:,.1f} but its what-if "
                           f"predicts goodput {base:,.1f} -> {new:,.1f} tok/s under SLO {d.slo}"
                           if k.predicted.output_tok_per_s > k.baseline.output_tok_per_s else
                           f"not recommended: {k.flag} {k.from_} -> {k.to}: its what-if predicts goodput "
                           f"{base:,.1f} -> {new:,.1f} tok/s under SLO {d.slo}")
        else:
            kept.append(k)
    kept.sort(key=lambda k: -(k.predicted.goodput_tok_per_s if k.predicted is not None
                              and k.predicted.goodput_tok_per_s is not None else float("-inf")))
    d.knobs = kept
    d.refusals = refused + d.refusals


def diagnose_trace(path: str, *, window: int | None = None, what_if: bool = True,
                   slo: Slo | None = None) -> Diagnosis:
    """Diagnose a .kvtrace file; a trace cut short is diagnosed up to where its good data ends.
    A recorded vLLM (`kvscope record --vllm`) is adapters.vllm_diagnose.diagnose_vllm_trace's."""
    from kvscope.traces.reader import engine_trace

    reader = engine_trace(path, "diagnose_trace")
    d = diagnose_events(reader, window=window, what_if=what_if, source=path, slo=slo)
    if reader.warnings:
        d.cannot_judge.insert(0, f"{reader.warnings[0]}: diagnosed the {d.steps} steps before it")
    return d


def _plain(obj: Any) -> Any:
    item = getattr(obj, "item", None)  # a numpy scalar that slipped into a figure
    if item is None:
        raise TypeError(f"cannot encode {type(obj).__name__}")
    return item()


def to_json(d: Diagnosis) -> bytes:
    return msgspec.json.format(msgspec.json.encode(d, enc_hook=_plain), indent=2)
