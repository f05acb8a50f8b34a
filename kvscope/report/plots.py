"""The report's figures, drawn with matplotlib as static SVG strings.

Static SVG because the page must open offline, forwarded as one file, with no script to
run and so nothing on a browser's console; text stays text (``svg.fonttype: none``), which
keeps the files small and searchable, and a fixed hash salt and no date make the same
input give the same bytes.
"""

from __future__ import annotations

import io
import re
from typing import Sequence

from kvscope.report.series import RunSeries

# One colour per run, A to D, in every plot: Okabe & Ito's colour-blind-safe set, as the TUI's cb palette.
RUN_COLOURS = ("#0072B2", "#E69F00", "#009E73", "#CC79A7")
PREFILL, DECODE, BUDGET = "#E69F00", "#56B4E9", "#000000"
PERCENTILE_STYLES = {0.5: ("p50", ":"), 0.9: ("p90", "--"), 0.99: ("p99", "-.")}
WIDTH = 9.5  # inches
MAX_LABEL = 80  # characters of a row or knob name drawn beside its bar


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcParams.update({"svg.fonttype": "none", "svg.hashsalt": "kvscope-report", "font.size": 9,
                         "axes.spines.top": False, "axes.spines.right": False, "axes.grid": True,
                         "grid.alpha": 0.3, "figure.dpi": 96, "figure.constrained_layout.use": True,
                         # labels are names from files (runs, modes, policies, knob flags, workloads): drawn as
                         # they are written, never parsed as mathtext ($\\frac{ would be a parse error) or TeX
                         "text.parse_math": False, "text.usetex": False})
    return plt


def to_svg(fig) -> str:
    plt = _plt()
    buf = io.StringIO()
    fig.savefig(buf, format="svg", metadata={"Date": None, "Creator": "kvscope report"})
    plt.close(fig)
    text = buf.getvalue()
    text = text[text.index("<svg"):]  # inline: no XML prolog or doctype
    return re.sub(r"\s*<metadata>.*?</metadata>", "", text, count=1, flags=re.S)  # RDF naming its schemas' URLs


def colour(i: int) -> str:
    return RUN_COLOURS[i % len(RUN_COLOURS)]


def _band(ax, x, mean, lo, hi, c, label):
    ax.plot(x, mean, color=c, lw=1.2, label=label)
    if any(a != b for a, b in zip(lo, hi)):
        ax.fill_between(x, lo, hi, color=c, alpha=0.18, lw=0)


def _legend(ax):
    if ax.get_legend_handles_labels()[0]:
        ax.legend(loc="best", fontsize=8, frameon=False)


def _rate_over_time(runs: Sequence[RunSeries], column: str, title: str, ylabel: str, label) -> str:
    """One line per run: a step column's rate over engine time."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 3.2))
    for i, run in enumerate(runs):
        ax.plot(run.steps.times(), run.steps.rate(column), color=colour(i), lw=1.2, label=label(run))
    ax.set_title(title)
    ax.set_xlabel("engine time (s)")
    ax.set_ylabel(ylabel)
    ax.set_ylim(bottom=0)
    _legend(ax)
    return to_svg(fig)


def throughput(runs: Sequence[RunSeries]) -> str:
    return _rate_over_time(runs, "out_tokens", "Output tokens per second over time", "output tok/s",
                           lambda run: f"{run.label} {run.name}")


def goodput(runs: Sequence[RunSeries]) -> str:
    """Goodput over time (tokens of requests that met every SLO target, at their finish) beside tok/s."""
    return _rate_over_time(runs, "good_tokens",
                           "Goodput over time: output tokens of requests that met every SLO target, as they finish",
                           "goodput tok/s", lambda run: f"{run.label} {run.name} (SLO {run.goodput.slo.describe()})")


def _cdf_points(sketch) -> tuple[list[float], list[float]]:
    xs, ys, acc = [], [], 0
    for value, count in sketch.buckets():
        acc += count
        xs.append(min(max(value, sketch.vmin), sketch.vmax))
        ys.append(acc / sketch.n)
    return xs, ys


def latencies(runs: Sequence[RunSeries]) -> str:
    """TTFT and ITL as CDFs on a log time axis, p50/p90/p99 marked on each run's curve."""
    plt = _plt()
    fig, axes = plt.subplots(1, 2, figsize=(WIDTH, 3.4))
    for ax, which, title in ((axes[0], "ttft", "TTFT"), (axes[1], "itl", "ITL (gap between a request's tokens)")):
        drawn = False
        for i, run in enumerate(runs):
            sketch = getattr(run, which)
            if not sketch.n:
                continue
            xs, ys = _cdf_points(sketch)
            xs = [max(x, 1e-6) for x in xs]
            ax.step(xs, ys, where="post", color=colour(i), lw=1.2, label=f"{run.label} {run.name}")
            for q, (name, style) in PERCENTILE_STYLES.items():
                v = sketch.quantile(q)
                if v is not None and v > 0:
                    ax.plot([v], [q], marker="o", ms=4, color=colour(i))
                    ax.axvline(v, color=colour(i), ls=style, lw=0.8, alpha=0.7)
            drawn = True
        if drawn:
            ax.set_xscale("log")
        else:
            ax.text(0.5, 0.5, "no samples", ha="center", va="center", transform=ax.transAxes)
        ax.set_title(f"{title} CDF", fontsize=9)
        ax.set_xlabel("seconds (log)")
        ax.set_ylabel("fraction of samples")
        ax.set_ylim(0, 1.02)
        _legend(ax)
    fig.suptitle("Latency distributions; markers and lines at p50 (dotted), p90 (dashed), p99 (dash-dot)",
                 fontsize=10)
    return to_svg(fig)


def _grid(n: int, height: float):
    plt = _plt()
    fig, axes = plt.subplots(n, 1, figsize=(WIDTH, height * n), squeeze=False, sharex=False)
    return fig, [a[0] for a in axes]


def queues(runs: Sequence[RunSeries]) -> str:
    """Running / waiting / preempted over time, preemptions and swaps marked, one panel per run."""
    fig, axes = _grid(len(runs), 2.4)
    styles = (("running", "#0072B2"), ("waiting", "#E69F00"), ("preempted", "#D55E00"))
    for ax, run in zip(axes, runs):
        x = run.steps.times()
        for name, c in styles:
            _band(ax, x, *run.steps.column(name), c, name)
        top = max([1.0] + run.steps.column("running")[2] + run.steps.column("waiting")[2])
        for name, marker, c in (("preemptions", "v", "#D55E00"), ("swaps", "^", "#CC79A7")):
            hits = [t for t, n in zip(x, run.steps.column(name)[2]) if n > 0]
            if hits:
                ax.plot(hits, [top * 1.04] * len(hits), ls="none", marker=marker, ms=4, color=c,
                        label=f"{name} ({int(run.steps.total(name))})")
        ax.set_title(f"{run.label} {run.name}: requests by state", fontsize=9)
        ax.set_ylabel("requests")
        ax.set_ylim(bottom=0)
        _legend(ax)
    axes[-1].set_xlabel("engine time (s)")
    fig.suptitle("Running / waiting / preempted over time (band: min to max within each point)", fontsize=10)
    return to_svg(fig)


def kv_blocks(runs: Sequence[RunSeries]) -> str:
    """KV blocks used / shared / cached / free, and waste, one panel per run."""
    fig, axes = _grid(len(runs), 2.4)
    for ax, run in zip(axes, runs):
        x = run.steps.times()
        for name, c in (("kv_used", "#0072B2"), ("kv_shared", "#009E73"), ("kv_cached", "#999999"),
                        ("kv_free", "#E69F00")):
            _band(ax, x, *run.steps.column(name), c, name.removeprefix("kv_"))
        total = run.steps.column("kv_total")[2]
        if total:
            ax.axhline(max(total), color="#000000", lw=0.8, ls="--", label="pool")
        ax.set_ylabel("blocks")
        ax.set_ylim(bottom=0)
        waste = ax.twinx()
        used_slots = run.steps.column("token_slots")[0]
        wasted = run.steps.column("waste_slots")[0]
        share = [100.0 * w / (w + u) if w + u > 0 else 0.0 for w, u in zip(wasted, used_slots)]
        waste.plot(x, share, color="#D55E00", lw=0.9, ls=":", label="waste %")
        waste.set_ylabel("waste (% of held slots)", color="#D55E00")
        waste.set_ylim(0, max([5.0] + share) * 1.1)
        waste.grid(False)
        ax.set_title(f"{run.label} {run.name}: KV blocks", fontsize=9)
        _legend(ax)
    axes[-1].set_xlabel("engine time (s)")
    fig.suptitle("KV blocks used / shared / cached / free over time, and waste", fontsize=10)
    return to_svg(fig)


def tokens_per_step(runs: Sequence[RunSeries]) -> str:
    """Tokens per step, prefill stacked on decode, against the budget, one panel per run."""
    fig, axes = _grid(len(runs), 2.2)
    for ax, run in zip(axes, runs):
        x = run.steps.times()
        decode = run.steps.column("decode")[0]
        prefill = run.steps.column("prefill")[0]
        top = [d + p for d, p in zip(decode, prefill)]
        ax.fill_between(x, 0, decode, step="mid", color=DECODE, lw=0, label="decode")
        ax.fill_between(x, decode, top, step="mid", color=PREFILL, lw=0, label="prefill")
        ax.step(x, run.steps.column("budget")[0], where="mid", color=BUDGET, lw=0.9, ls="--", label="budget")
        peak = run.steps.column("prefill")[2]
        if any(p > m * 1.05 for p, m in zip(peak, prefill)):  # averaging hid spikes: show the largest step
            ax.step(x, [p + d for p, d in zip(peak, decode)], where="mid", color=PREFILL, lw=0.6, alpha=0.6,
                    label="largest step")
        ax.set_title(f"{run.label} {run.name}: tokens per step (mean per point)", fontsize=9)
        ax.set_ylabel("tokens / step")
        ax.set_ylim(bottom=0)
        _legend(ax)
    axes[-1].set_xlabel("engine time (s)")
    fig.suptitle("Tokens per step: prefill chunks beside decodes, against the token budget", fontsize=10)
    return to_svg(fig)


def gantt(runs: Sequence[RunSeries]) -> str:
    """A sample of requests per run: queue wait, prefill chunks, decode, preemptions."""
    rows = [len(r.requests.lines) for r in runs]
    plt = _plt()
    fig, axes = plt.subplots(len(runs), 1, figsize=(WIDTH, sum(0.16 * max(n, 4) + 0.9 for n in rows)),
                             squeeze=False, gridspec_kw={"height_ratios": [max(n, 4) for n in rows]})
    for (ax,), run in zip(axes, runs):
        lines = sorted(run.requests.lines.values(), key=lambda r: (r.arrival, r.req))
        for y, line in enumerate(lines):
            first = line.prefill[0][0] if line.prefill else line.decode_start
            end = line.end if line.end is not None else run.t_end
            if first is not None and first > line.arrival:
                ax.barh(y, first - line.arrival, left=line.arrival, height=0.5, color="#DDDDDD", lw=0)
            if line.decode_start is not None:
                ax.barh(y, max(end - line.decode_start, 0), left=line.decode_start, height=0.6, color=DECODE, lw=0)
            for a, b in line.prefill:
                ax.barh(y, max(b - a, 1e-9), left=a, height=0.8, color=PREFILL, lw=0)
            if line.preempted_at:
                ax.plot(line.preempted_at, [y] * len(line.preempted_at), ls="none", marker="x", ms=4,
                        color="#D55E00")
        ax.set_yticks(range(len(lines)), [f"#{line.req}" for line in lines], fontsize=7)
        ax.invert_yaxis()
        ax.set_title(f"{run.label} {run.name}: {len(lines)} of {run.requests.arrivals} requests "
                     f"({_every(run.requests.stride)})", fontsize=9)
        ax.grid(axis="y", visible=False)
    axes[-1][0].set_xlabel("engine time (s)")
    from matplotlib.patches import Patch
    from matplotlib.lines import Line2D

    handles = [Patch(color="#DDDDDD", label="waiting"), Patch(color=PREFILL, label="prefill chunk"),
               Patch(color=DECODE, label="decode"), Line2D([], [], ls="none", marker="x", color="#D55E00",
                                                         label="preempted")]
    fig.legend(handles=handles, loc="outside lower center", fontsize=8, frameon=False, ncol=4)
    fig.suptitle("Requests over time: queue wait, prefill chunks, decode", fontsize=10)
    return to_svg(fig)


def _every(stride: int) -> str:
    if stride == 1:
        return "every arrival"
    suffix = {1: "st", 2: "nd", 3: "rd"}.get(stride % 10 if stride % 100 not in (11, 12, 13) else 0, "th")
    return f"every {stride}{suffix} arrival"


MAX_BAR = 1e15  # a bar's value from a JSON input: beyond it (up to 1.8e308) no axis limit is finite


def _bar_value(v) -> float:
    """A value from a JSON input as a bar: a number in [0, MAX_BAR], else 0 (the table shows it as given)."""
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and 0 <= v <= MAX_BAR else 0.0


def bars(names: Sequence[str], values: Sequence[float], *, title: str, xlabel: str,
         colours: Sequence[str] | None = None) -> str:
    """Horizontal bars, one per row, labelled with their values."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(WIDTH, 0.35 * len(names) + 1.0))
    vals = [_bar_value(v) for v in values]
    cs = list(colours) if colours else [colour(i) for i in range(len(names))]
    ax.barh(range(len(names)), vals, color=cs)
    for y, v in enumerate(vals):
        ax.text(v, y, f" {v:,.1f}", va="center", fontsize=8)
    ax.set_yticks(range(len(names)), list(names))
    ax.invert_yaxis()
    ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_xlim(0, max(vals + [1.0]) * 1.15)
    ax.grid(axis="y", visible=False)
    return to_svg(fig)


def knob_predictions(baseline: dict, knobs: Sequence[dict]) -> str:
    """Each knob's predicted output tok/s and TTFT p99 beside the baseline."""
    plt = _plt()
    names = ["baseline"] + [f"{k.get('flag', '?')} {k.get('from', '')}→{k.get('to', '')}"[:MAX_LABEL] for k in knobs]
    series = [baseline] + [k.get("predicted") if isinstance(k.get("predicted"), dict) else {} for k in knobs]
    fig, (a, b) = plt.subplots(1, 2, figsize=(WIDTH, 0.4 * len(names) + 1.2), sharey=True)
    for ax, key, label in ((a, "output_tok_per_s", "output tok/s"), (b, "ttft_p99_s", "TTFT p99 (s)")):
        vals = [_bar_value(s.get(key)) for s in series]
        ax.barh(range(len(names)), vals, color=["#999999"] + [RUN_COLOURS[0]] * (len(names) - 1))
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:,.3g}", va="center", fontsize=8)
        ax.set_xlabel(label)
        ax.set_xlim(0, max(vals + [1e-9]) * 1.25)
        ax.grid(axis="y", visible=False)
    a.set_yticks(range(len(names)), names)
    a.invert_yaxis()
    fig.suptitle("What the sim predicts for each knob, beside the baseline", fontsize=10)
    return to_svg(fig)
