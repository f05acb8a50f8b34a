"""The report page: every figure inline, styles inline, no script and no request when it opens."""

from __future__ import annotations

import html
import math
import os
from typing import Callable, Sequence

from kvscope.errors import KvscopeError
from kvscope.output_paths import HTML, check_output
from kvscope.report import plots
from kvscope.report.inputs import (DIAGNOSIS, MAX_TRACES, RESULTS, TRACE, Input, ReportError, classify, plain_text,
                                   race_traces)
from kvscope.report.series import RunSeries, read_trace

LABELS = "ABCD"
CSS = """
body{font-family:system-ui,-apple-system,"Segoe UI",sans-serif;margin:24px auto;max-width:960px;color:#222;
padding:0 12px}
h1{font-size:1.5em;margin-bottom:4px} h2{font-size:1.15em;margin-top:32px;border-bottom:1px solid #ddd}
table{border-collapse:collapse;font-size:.85em;margin:8px 0} th,td{border:1px solid #ddd;padding:3px 7px;
text-align:right} th:first-child,td:first-child,td.text{text-align:left} th{background:#f4f4f4}
figure{margin:12px 0} figure svg{max-width:100%;height:auto} .notice{background:#fff4e5;border-left:4px solid
#E69F00;padding:6px 10px;margin:6px 0} .swatch{display:inline-block;width:10px;height:10px;margin-right:4px}
.meta{color:#666;font-size:.85em} code{background:#f4f4f4;padding:0 3px}
"""


def _e(x) -> str:
    return html.escape(str(x))


def _num(v, digits: int = 3) -> str:
    if v is None:
        return "–"
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return _e(v)
    if not math.isfinite(v):
        return "–"
    if isinstance(v, int):
        return f"{v:,}"
    if abs(v) >= 100:
        return f"{v:,.1f}"
    return f"{v:.{digits}g}"


def _table(headers: Sequence[str], rows: Sequence[Sequence]) -> str:
    head = "".join(f"<th>{_e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _figure(svg: str, caption: str, plot_id: str) -> str:
    return f'<figure class="plot" id="{plot_id}">{svg}<figcaption class="meta">{_e(caption)}</figcaption></figure>'


def _notice(text: str) -> str:
    return f'<div class="notice">{_e(text)}</div>'


def _goodput_cells(run: RunSeries, f: dict) -> list[str]:
    from kvscope.goodput import fmt_share, fmt_usd

    cells = []
    if run.goodput.slo:
        cells = [_e(f["slo"]), _num(f["goodput_tok_per_s"]), _e(fmt_share(f["slo_attainment"])),
                 _e(", ".join(f"{k} {fmt_share(v)}" for k, v in f["slo_met"].items()))]
    if run.cost_per_hour:
        cells += [_e(fmt_usd(f.get("usd_per_mtok"))), _e(fmt_usd(f.get("usd_per_mgood")))]
    return cells


def trace_section(runs: list[RunSeries]) -> str:
    parts = ["<h2>Runs</h2>"]
    rows = []
    for i, run in enumerate(runs):
        f = run.figures()
        c = run.config
        swatch = f'<span class="swatch" style="background:{plots.colour(i)}"></span>'
        rows.append([f"{swatch}{run.label} {_e(run.name)}<br><span class=\"meta\">{_e(os.path.basename(run.path))}: "
                     f"{_e(c.get('model', ''))} on {_e(c.get('device', ''))}</span>", _num(f["steps"]), _num(f["requests"]),
                     _num(f["output_tokens"]), _num(f["duration_s"]), _num(f["output_tok_per_s"]),
                     _num(f["ttft_p50_s"]), _num(f["ttft_p99_s"]), _num(f["itl_p50_s"]), _num(f["itl_p99_s"]),
                     _num(f["preemptions"])] + _goodput_cells(run, f))
    judged = any(run.goodput.slo for run in runs)
    parts.append(_table(["run", "steps", "requests", "output tokens", "duration s",
                         "output tok/s", "TTFT p50 s", "TTFT p99 s", "ITL p50 s", "ITL p99 s", "preemptions"]
                        + (["SLO", "goodput tok/s", "SLO met (all)", "met per target"] if judged else [])
                        + (["$/Mtok", "$/Mgood"] if any(r.cost_per_hour for r in runs) else []), rows))
    for run in runs:
        for n in run.notices:
            parts.append(_notice(f"{run.label} {run.path}: {n}"))
    live = [r for r in runs if r.steps.steps]
    if not live:
        parts.append(_notice("no steps to plot"))
        return "\n".join(parts)
    parts.append(_figure(plots.throughput(live), "output tokens per second, per point of the timeline", "throughput"))
    if any(r.goodput.slo for r in live):
        parts.append(_figure(plots.goodput([r for r in live if r.goodput.slo]),
                             "goodput per point of the timeline (docs/GOODPUT.md)", "goodput"))
    parts.append(_figure(plots.latencies(live), "time to first token of every request; every inter-token gap",
                         "latency"))
    parts.append(_figure(plots.queues(live), "queue lengths; ▼ preemption, ▲ swap", "queues"))
    parts.append(_figure(plots.kv_blocks(live), "the KV pool; waste is empty slots in held blocks", "kv"))
    parts.append(_figure(plots.tokens_per_step(live), "prefill and decode tokens per step", "tokens"))
    parts.append(_figure(plots.gantt(live), "a sample of requests, spread evenly over arrivals", "gantt"))
    return "\n".join(parts)


RESULT_COLUMNS = (("output_tok_per_s", "output tok/s"), ("ttft_mean_s", "TTFT mean s"), ("ttft_p50_s", "TTFT p50 s"),
                  ("ttft_p99_s", "TTFT p99 s"), ("itl_p50_s", "ITL p50 s"), ("itl_p99_s", "ITL p99 s"),
                  ("preemptions", "preemptions"), ("kv_waste", "KV waste"), ("output_tokens", "output tokens"),
                  ("duration_s", "duration s"), ("goodput_tok_per_s", "goodput tok/s"),
                  ("slo_attainment", "SLO met"), ("usd_per_mtok", "$/Mtok"), ("usd_per_mgood", "$/Mgood"))


MAX_ROWS = 256  # rows of one bench or race JSON drawn (a real one has tens); the rest are counted
MAX_KNOBS = 64


def results_section(inp: Input) -> str:
    data = inp.data or {}
    rows = [r for r in _items(data, "rows", inp.path) if isinstance(r, dict)]
    more, rows = len(rows) - MAX_ROWS, rows[:MAX_ROWS]
    what = "race" if "traces" in data else "bench"
    meta = ", ".join(f"{k} {_e(data[k])}" for k in ("workload", "model", "device", "backend", "num_requests")
                     if isinstance(data.get(k), (str, int, float)))
    parts = [f"<h2>{what.title()} results: {_e(os.path.basename(inp.path))}</h2>", f'<p class="meta">{meta}</p>']
    if not rows:
        parts.append(_notice(f"{inp.path}: no rows"))
        return "\n".join(parts)
    if more > 0:
        parts.append(_notice(f"{inp.path}: {more:,} more rows than the {MAX_ROWS} shown are left out"))
    cols = [(k, h) for k, h in RESULT_COLUMNS if any(k in r for r in rows)]
    parts.append(_table(["row"] + [h for _, h in cols], [[_e(r.get("name", "?"))] + [_num(r.get(k)) for k, _ in cols]
                                                         for r in rows]))
    names = [str(r.get("name", "?"))[:plots.MAX_LABEL] for r in rows]
    peers = ["#999999" if str(r.get("name", "")).startswith(("hf-", "llama")) else plots.colour(i)
             for i, r in enumerate(rows)]
    parts.append(_figure(plots.bars(names, [r.get("output_tok_per_s") for r in rows], title="Output tokens per second",
                                    xlabel="output tok/s", colours=peers),
                         "grey bars: peers (transformers, llama.cpp)" if "#999999" in peers else "",
                         f"bars-{_slug(inp.path)}"))
    if any("ttft_p99_s" in r for r in rows):
        parts.append(_figure(plots.bars(names, [r.get("ttft_p99_s") for r in rows], title="TTFT p99",
                                        xlabel="seconds", colours=peers), "", f"ttft-{_slug(inp.path)}"))
    return "\n".join(parts)


def _items(d: dict, key: str, path: str) -> list:
    """d[key] as the list it must be (absent: empty); any other type is the input's one-line error."""
    v = d.get(key)
    if v is None:
        return []
    if not isinstance(v, list):
        raise ReportError(f"{path}: '{key}' must be a list, got {type(v).__name__}")
    return v


def diagnosis_section(inp: Input) -> str:
    d = inp.data or {}
    parts = [f"<h2>Diagnosis: {_e(os.path.basename(inp.path))}</h2>",
             f"<p><b>Bottleneck: <code>{_e(d.get('bottleneck'))}</code></b> "
             f"(score {_num(d.get('score'))}) — {_e(d.get('source', ''))}</p>"]
    evidence = [e for e in _items(d, "evidence", inp.path) if isinstance(e, dict)]
    if evidence:
        parts.append(_table(["evidence", "value", "threshold"],
                            [[_e(e.get("text", e.get("name", ""))), _num(e.get("value")),
                              f"{_e(e.get('comparison', ''))} {_num(e.get('threshold'))}"] for e in evidence]))
    secondary = [s for s in _items(d, "secondary", inp.path) if isinstance(s, dict)]
    if secondary:
        parts.append("<p>Runners-up: " + "; ".join(f"<code>{_e(s.get('bottleneck'))}</code> ({_num(s.get('score'))}): "
                                                   f"{_e(s.get('evidence', ''))}" for s in secondary) + "</p>")
    if isinstance(d.get("slo"), str) and d.get("slo"):  # diagnosed against an SLO (docs/GOODPUT.md)
        findings = [f for f in _items(d, "slo_findings", inp.path) if isinstance(f, str)][:16]
        parts.append(f"<p><b>SLO <code>{_e(d['slo'])}</code></b>: knobs ranked by predicted goodput; one its "
                     "what-if predicts lower goodput for is refused</p>"
                     + "".join(f"<p class=\"meta\">{_e(f)}</p>" for f in findings))
    knobs = [k for k in _items(d, "knobs", inp.path) if isinstance(k, dict)][:MAX_KNOBS]
    baseline = (d.get("what_if") or {}).get("baseline") if isinstance(d.get("what_if"), dict) else None
    if knobs:
        rows = []
        for k in knobs:
            p = k.get("predicted") if isinstance(k.get("predicted"), dict) else {}
            rows.append([f"<code>{_e(k.get('flag'))}</code>", _e(k.get("from")), _e(k.get("to")), _e(k.get("why", "")),
                         _num(p.get("output_tok_per_s")), _num(p.get("ttft_p99_s")), _num(p.get("itl_p99_s"))]
                        + ([_num(p.get("goodput_tok_per_s"))] if d.get("slo") else []))
        parts.append(_table(["knob", "from", "to", "why", "predicted tok/s", "TTFT p99 s", "ITL p99 s"]
                            + (["predicted goodput tok/s"] if d.get("slo") else []), rows))
        if isinstance(baseline, dict) and any(k.get("predicted") for k in knobs):
            parts.append(_figure(plots.knob_predictions(baseline, knobs), "predicted by re-running the trace's "
                                 "requests in the sim", f"knobs-{_slug(inp.path)}"))
        else:
            parts.append(_notice("no predictions (diagnosed with --no-what-if, or the sim could not re-run it)"))
    else:
        parts.append("<p>No knob to turn.</p>")
    for key, title in (("measure_next", "Measure next"), ("refusals", "Refused"), ("cannot_judge", "Could not judge")):
        v = d.get(key)
        if v:
            items = v if isinstance(v, list) else [v]
            parts.append(f"<p><b>{title}:</b> " + "; ".join(_e(x) for x in items) + "</p>")
    return "\n".join(parts)


def _slug(path: str) -> str:
    return "".join(c if c.isalnum() else "-" for c in os.path.basename(path))


def build(paths: Sequence[str], *, log: Callable[[str], None] = lambda m: None, slo=None,
          cost_per_hour: float | None = None) -> str:
    """The whole page for these inputs."""
    inputs = [classify(p) for p in paths]
    traces = [i.path for i in inputs if i.kind == TRACE]
    for i in inputs:
        if i.kind == RESULTS and not traces:
            traces += race_traces(i)  # a race JSON brings its runs' traces along when they are there
    if len(traces) > MAX_TRACES:
        raise ReportError(f"a report plots at most {MAX_TRACES} traces side by side, got {len(traces)}")
    runs: list[RunSeries] = []
    notices: list[str] = []
    for n, path in enumerate(traces):
        log(f"reading {path}")
        try:
            runs.append(read_trace(path, LABELS[n], slo, cost_per_hour))
        except KvscopeError as e:
            notices.append(f"{LABELS[n]} {path}: not plotted: {str(e).splitlines()[0]}")
        except OSError as e:
            notices.append(f"{LABELS[n]} {path}: not plotted: {e.strerror}")
    body = [f"<h1>kvscope report</h1><p class=\"meta\">{_e(', '.join(os.path.basename(p) for p in paths))}</p>"]
    body += [_notice(n) for n in notices]
    if runs:
        log("plotting the runs")
        body.append(trace_section(runs))
    for i in inputs:
        if i.kind == RESULTS:
            body.append(results_section(i))
        elif i.kind == DIAGNOSIS:
            body.append(diagnosis_section(i))
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            "<meta name=\"viewport\" content=\"width=device-width,initial-scale=1\">"
            f"<title>kvscope report</title><style>{CSS}</style></head><body>\n" + "\n".join(body) +
            "\n</body></html>\n")


def write_report(paths: Sequence[str], out: str, *, log: Callable[[str], None] = lambda m: None, slo=None,
                 cost_per_hour: float | None = None) -> int:
    """Write the page atomically (a temporary file renamed), so a failure leaves no half page."""
    check_output(out, HTML, flag="--html", inputs=paths)  # the one output rule: never an input, nor another kind
    data = plain_text(build(paths, log=log, slo=slo, cost_per_hour=cost_per_hour)).encode("utf-8")
    tmp = f"{out}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, out)
    except OSError as e:
        raise ReportError(f"cannot write {out}: {e.strerror}") from None
    finally:
        if os.path.lexists(tmp):  # whatever failed (even a Ctrl-C), no half page stays behind
            os.unlink(tmp)
    return len(data)



