"""The text form of a Diagnosis: the same content as its JSON, laid out for a terminal."""

from __future__ import annotations

from kvscope.analysis.diagnose import Diagnosis
from kvscope.analysis.figures import RunFigures, relative_change

FIGURES = (("output_tok_per_s", "out tok/s"), ("ttft_p50_s", "TTFT p50"), ("ttft_p99_s", "TTFT p99"),
           ("itl_p99_s", "ITL p99"), ("preemptions", "preemptions"))
GOODPUT_FIGURES = (("goodput_tok_per_s", "goodput"), ("slo_attainment", "SLO met"))


def _fmt(key: str, v) -> str:
    if v is None:
        return "-"
    if key in ("output_tok_per_s", "goodput_tok_per_s"):
        return f"{v:,.1f}"
    if key == "slo_attainment":
        return f"{v * 100:.0f}%"
    if key == "preemptions":
        return f"{v:,}"
    return f"{v * 1000:,.1f} ms" if v < 1 else f"{v:,.2f} s"


def _pct(x: float | None) -> str:
    return "" if x is None else f"{x * 100:+.0f}%"


def figures_table(cols: list[tuple[str, RunFigures | None]], indent: str = "    ", change: bool = False) -> list[str]:
    head = f"{indent}{'':13}" + "".join(f"{name:>14}" for name, _ in cols) + (f"{'change':>9}" if change else "")
    lines = [head]
    judged = any(f is not None and f.goodput_tok_per_s is not None for _, f in cols)
    for key, label in FIGURES + (GOODPUT_FIGURES if judged else ()):
        vals = [getattr(f, key) if f is not None else None for _, f in cols]
        row = f"{indent}{label:13}" + "".join(f"{_fmt(key, v):>14}" for v in vals)
        if change:
            row += f"{_pct(relative_change(vals[-1], vals[-2])):>9}"
        lines.append(row)
    return lines


def _vllm_head(d: Diagnosis) -> list[str]:
    v = d.vllm
    lines = [f"diagnosis of {d.source}",
             f"  vLLM serving {d.config.get('model') or '?'}: {v.scrapes:,} scrapes over {v.span_s:,.0f} s "
             f"({v.busy_intervals:,} busy intervals, {v.iterations:,} engine steps), {d.requests:,} finished requests"
             + (f" (last {d.window} intervals only)" if d.window else ""),
             "  settings (vLLM's flags, and where each value came from):"]
    lines += [f"    {s.name} {'?' if s.value is None else s.value}  ({s.source})" for s in v.settings]
    return lines


def format_text(d: Diagnosis) -> str:
    if d.backend == "vllm" and d.vllm is not None:
        return "\n".join(_vllm_head(d) + _body(d))
    c = d.config
    where = (f"sim {c.get('model')} on {c.get('gpu')}" + (f" x{c.get('tp')}" if (c.get('tp') or 1) > 1 else "")
             if d.backend == "sim" else f"{c.get('model', '?')} on {c.get('device', '?')}")
    lines = [f"diagnosis of {d.source}",
             f"  {where}; mode {c.get('mode')}, policy {c.get('policy')}, max_num_seqs {c.get('max_num_seqs')}, "
             f"max_num_batched_tokens {c.get('max_num_batched_tokens')}, {c.get('num_blocks')} KV blocks",
             f"  {d.steps:,} steps" + (f" (last {d.window} only)" if d.window else "") + f", {d.requests:,} requests"]
    return "\n".join(lines + _body(d))


def _body(d: Diagnosis) -> list[str]:
    lines = ["", f"bottleneck: {d.bottleneck}  (score {d.score:g})", "evidence:"]
    lines += [f"  - {e.text}" for e in d.evidence]
    if d.slo:
        lines.append(f"SLO {d.slo} (knobs ranked by predicted goodput; one that lowers it is refused):")
        lines += [f"  - {x}" for x in d.slo_findings]
    if d.secondary:
        lines.append("secondary:")
        lines += [f"  {i}. {r.bottleneck} (score {r.score:g}): {r.evidence}" for i, r in enumerate(d.secondary, 1)]
    lines.append("")
    w = d.what_if
    if not d.knobs:
        lines.append("knobs: none (nothing for the scheduler to change)")
    else:
        lines.append("knobs, in order:")
        for i, k in enumerate(d.knobs, 1):
            frm = "?" if k.from_ is None and d.backend == "vllm" else k.from_
            lines.append(f"  {i}. {k.flag} {frm} -> {k.to}: {k.why}")
            if k.predicted is not None:
                lines += figures_table([("baseline", k.baseline), ("predicted", k.predicted)], "       ", change=True)
            elif w is not None and w.ran:
                lines.append("       (no prediction: the sim could not run this setting)")
    if w is not None:
        lines += ["", f"what-if: {w.note}"]
        if w.caution:
            lines.append(f"  caution: {w.caution}")
        if w.ran:
            lines.append("  how far to trust it: the sim's baseline beside the trace's own figures")
            lines += figures_table([("trace", w.trace), ("sim baseline", w.baseline)], "    ")
            lines.append(f"  {w.sim_steps:,} sim steps in {w.wall_s:.1f} s")
    elif d.knobs:
        lines += ["", "what-if: not run (--no-what-if)"]
    if d.refusals:
        lines += ["", "refusals:"] + [f"  - {r}" for r in d.refusals]
    lines += ["", f"measure next: {d.measure_next}"]
    if d.cannot_judge:
        lines += ["", "could not judge:"] + [f"  - {x}" for x in d.cannot_judge]
    return lines
