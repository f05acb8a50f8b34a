"""Live TTFT and ITL histograms (log-spaced, p50/p90/p99 markers) and a throughput sparkline."""

from __future__ import annotations

import math

from rich.text import Text

from kvscope.tui import fmt
from kvscope.tui.widgets.base import StateWidget, join_lines

EIGHTHS = " ▁▂▃▄▅▆▇█"
SPARK = "▁▂▃▄▅▆▇█"
MARKS = (("▲", "p50"), ("◆", "p90"), ("●", "p99"))
MAX_DECADE = 9  # the histograms' axis ends at 10^9 s (about 32 years)


def _decade_label(d: int) -> str:
    return fmt.dur(10.0 ** d)


def histogram_lines(h, name: str, width: int, bar_rows: int, pal) -> list[Text]:
    """Title with percentiles, ``bar_rows`` of bars, one row of markers and decade labels."""
    p = h.percentiles()
    title = Text(no_wrap=True, overflow="ellipsis")
    title.append(f" {name} ", style="bold")
    if h.n == 0:
        title.append(" no samples yet", style=pal.dim)
        return [title] + [Text("") for _ in range(bar_rows + 1)]
    colours = (pal.p50, pal.p90, pal.p99)
    figures = [fmt.latency(v) for v in p]
    # Labels when they fit; else the glyphs alone (the help screen names them), so a
    # figure is never cut off.
    labelled = len(name) + 2 + sum(len(g) + len(lb) + len(f) + 2 for (g, lb), f in zip(MARKS, figures)) <= width - 1
    for (glyph, label), v, c in zip(MARKS, figures, colours):
        title.append(f"{glyph}{label} " if labelled else glyph, style=c)
        title.append(f"{v} ")
    title.append(f"n={h.n}", style=pal.dim)
    w = max(4, width - 1)
    # Range: whole decades around the samples.
    lo = math.floor(math.log10(max(h.vmin, 1e-9)))
    hi = math.ceil(math.log10(max(h.vmax, 1e-9)) + 1e-9)
    # A trace or a publisher may send any finite latency, up to 1.8e308 s: the axis stops at
    # 10^MAX_DECADE s (every larger sample falls in its last column), so 10 ** x never overflows.
    lo, hi = min(lo, MAX_DECADE - 1), min(hi, MAX_DECADE)
    if hi <= lo:
        hi = lo + 1
    span = hi - lo
    vals = [0] * w
    for c in range(w):
        x = 10 ** (lo + (c + 0.5) * span / w)
        vals[c] = h.counts[h.index(x)]
    top = max(vals) or 1
    units = bar_rows * 8
    heights = [0 if v == 0 else max(1, round(units * v / top)) for v in vals]
    lines = [title]
    for r in range(bar_rows):
        base = (bar_rows - 1 - r) * 8
        row = Text(" ", no_wrap=True, style=pal.bar)
        row.append("".join(EIGHTHS[min(8, max(0, hgt - base))] for hgt in heights))
        lines.append(row)
    mark_cols: dict[int, str] = {}
    for (glyph, _), v in zip(MARKS, p):
        if v is None:
            continue
        col = int((math.log10(max(v, 1e-9)) - lo) / span * w)
        col = min(w - 1, max(0, col))
        while col in mark_cols and col + 1 < w:
            col += 1  # keep all three visible when they fall in one column
        mark_cols[col] = glyph
    # Decade labels where they do not cover a marker or another label.
    marks = [" "] * w
    for d in range(lo, hi + 1):
        label = _decade_label(d)
        col = round((d - lo) * w / span)
        col = min(col, w - len(label))
        if col < 0:
            continue
        cells = range(max(0, col - 1), min(w, col + len(label) + 1))
        if any(marks[c] != " " or c in mark_cols for c in cells):
            continue
        marks[col:col + len(label)] = list(label)
    row = Text(" ", no_wrap=True, style=pal.dim)
    colour_of = {g: c for (g, _), c in zip(MARKS, colours)}
    for c in range(w):
        g = mark_cols.get(c)
        if g is not None:
            row.append(g, style=f"bold {colour_of[g]}")
        else:
            row.append(marks[c])
    lines.append(row)
    return lines


def sparkline(values: list[float]) -> str:
    if not values:
        return ""
    top = max(values)
    if top <= 0:
        return SPARK[0] * len(values)
    return "".join(SPARK[min(7, int(7 * v / top + 0.5))] for v in values)


class LatencyPanel(StateWidget):
    """TTFT and ITL histograms over everything seen since the last (re)start, and tok/s."""

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(10, self.size.width)
        height = max(1, self.size.height)
        if st is None:
            return Text("")
        bar_rows = max(1, (height - 1 - 4) // 2)
        lines: list[Text] = []
        lines += histogram_lines(st.ttft, "TTFT", width, bar_rows, pal)
        lines += histogram_lines(st.itl, "ITL ", width, bar_rows, pal)
        spark = Text(" tok/s ", no_wrap=True, style="bold")
        _, toks = st.rates()
        label = f" {fmt.rate(toks)}"
        room = max(1, width - 8 - len(label))
        vals = [s.out_tokens / s.dur if s.dur > 0 else 0.0 for s in list(st.history)[-room:]]
        spark.append(sparkline(vals), style=pal.bar)
        spark.append(label, style="bold")
        lines.append(spark)
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines[:height])
