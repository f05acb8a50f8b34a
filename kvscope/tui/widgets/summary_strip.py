"""The compare screen's summary strip: each run's whole-trace figures, the best marked ★.

The figures are the run's bench row computed from its trace (kvscope.traces.figures),
so they equal what `kvscope bench` and `kvscope race --json` print for that run.
"""

from __future__ import annotations

from rich.text import Text

from kvscope.tui import fmt
from kvscope.tui.sources.runs import Run
from kvscope.tui.widgets.base import StateWidget, join_lines

BEST = "★"

# (key, title, higher is better, formatter)
COLUMNS = (
    ("output_tok_per_s", "tok/s", True, fmt.rate),
    ("ttft_mean_s", "TTFT mean", False, fmt.latency),
    ("ttft_p99_s", "TTFT p99", False, fmt.latency),
    ("itl_p99_s", "ITL p99", False, fmt.latency),
    ("preemptions", "preempt", False, lambda v: str(int(v))),
    ("kv_waste", "KV waste", False, lambda v: fmt.pct(float(v))),
)
# with an SLO (--slo, or the traces' own) and a price (--cost-per-hour): docs/GOODPUT.md
GOODPUT_COLUMNS = (("goodput_tok_per_s", "goodput", True, fmt.rate),
                   ("slo_attainment", "SLO met", True, lambda v: fmt.pct(float(v))))
COST_COLUMNS = (("usd_per_mtok", "$/Mtok", False, lambda v: f"${v:,.2f}"),
                ("usd_per_mgood", "$/Mgood", False, lambda v: f"${v:,.2f}"))


def columns_for(runs: list[Run]) -> tuple:
    cols = COLUMNS
    if any(r.ok and r.figures.get("slo") for r in runs):
        cols += GOODPUT_COLUMNS
    if any(r.ok and r.figures.get("usd_per_mtok") is not None for r in runs):
        cols += COST_COLUMNS
    return cols


def best_of(runs: list[Run], key: str, higher: bool) -> set[int]:
    """Indices of the runs holding the best value of ``key`` (ties all marked)."""
    values = [(i, r.figures.get(key)) for i, r in enumerate(runs) if r.ok and r.figures.get(key) is not None]
    if len(values) < 2:
        return set()
    target = max(v for _, v in values) if higher else min(v for _, v in values)
    return {i for i, v in values if v == target}


class SummaryStrip(StateWidget):
    """A header row and one row per run."""

    def __init__(self, runs: list[Run], *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.runs = runs

    def on_mount(self) -> None:
        self.styles.height = len(self.runs) + 1

    def render(self) -> Text:
        pal = self.pal
        width = max(10, self.size.width)
        name_w = max(8, min(24, max((len(r.label) + 1 + len(r.name) for r in self.runs), default=8)))
        columns = columns_for(self.runs)
        cell = max(8, min(12, (width - name_w - 1) // len(columns)))
        if name_w + 1 + cell * len(columns) > width:
            name_w = max(6, width - 1 - cell * len(columns))
        head = Text(f" {'run':<{name_w}}", style=f"bold {pal.dim}", no_wrap=True)
        for _, title, _, _ in columns:
            head.append(f"{title:>{cell}}", style=f"bold {pal.dim}")
        lines = [head]
        best = {key: best_of(self.runs, key, higher) for key, _, higher, _ in columns}
        for i, run in enumerate(self.runs):
            ln = Text(f" {(run.label + ' ' + run.name)[:name_w]:<{name_w}}", no_wrap=True)
            if not run.ok:
                ln.append(f"  cannot read: {run.error}", style=pal.bad)
                lines.append(ln)
                continue
            for key, _, _, f in columns:
                v = run.figures.get(key)
                text = "-" if v is None else f(v)
                if i in best[key]:
                    ln.append(f"{BEST + ' ' + text:>{cell}}", style=f"bold {pal.ok}")
                else:
                    ln.append(f"{text:>{cell}}")
            lines.append(ln)
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines)
