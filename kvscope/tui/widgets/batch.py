"""This step's batch against the token budget, and the per-step history (stacked)."""

from __future__ import annotations

from rich.style import Style
from rich.text import Text

from kvscope.tui.widgets.base import StateWidget, join_lines

EIGHTHS = " ▁▂▃▄▅▆▇█"
G_PREFILL, G_DECODE, G_PAD, G_UNUSED = "█", "▓", "░", "·"


def stack_cell(lo: int, segs: list[tuple[int, str]]) -> tuple[str, str | None, str | None]:
    """Glyph, foreground and background for one character of a stacked column.

    ``segs`` are (cumulative end, colour) in eighths of a character from the
    bottom; the cell covers [lo, lo + 8). The lower segment is drawn with a lower
    eighth block, the one above it as the background.
    """
    hi = lo + 8
    parts = []
    prev = 0
    for end, colour in segs:
        a, b = max(prev, lo), min(end, hi)
        if b > a:
            parts.append((a - lo, b - lo, colour))
        prev = end
    if not parts:
        return " ", None, None
    if len(parts) == 1:
        return EIGHTHS[parts[0][1]], parts[0][2], None
    return EIGHTHS[parts[0][1]], parts[0][2], parts[1][2]


class BatchView(StateWidget):
    """Line 1: numbers; line 2: this step's bar; below: one column per recent step."""

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(10, self.size.width)
        height = max(1, self.size.height)
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(" BATCH ", style="bold")
        b = st.last_batch if st is not None else None
        if b is None:
            title.append(" no step yet", style=pal.dim)
            return title
        title.append(f"step {b.step}: ")
        title.append(f"{G_PREFILL} prefill {b.prefill}", style=pal.prefill)
        title.append(" + ")
        title.append(f"{G_DECODE} decode {b.decode}", style=pal.decode)
        if b.padding:
            title.append(" + ")
            title.append(f"{G_PAD} pad {b.padding}", style=pal.padding)
        title.append(f" / budget {b.budget}")
        lines = [title]
        if height >= 2:
            bar_w = width - 2
            lines.append(self._bar(b, bar_w))
        hist_rows = height - 2
        if hist_rows > 0:
            lines.extend(self._history(st, width - 1, hist_rows))
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines)

    def _bar(self, b, w: int) -> Text:
        pal = self.pal
        budget = max(1, b.budget, b.prefill + b.decode + b.padding)
        p = round(w * b.prefill / budget)
        d = round(w * b.decode / budget)
        pad = round(w * b.padding / budget)
        if b.decode and d == 0:
            d = 1
        if b.prefill and p == 0:
            p = 1
        over = p + d + pad - w
        if over > 0:
            p = max(0, p - over)
        t = Text(" ", no_wrap=True)
        t.append(G_PREFILL * p, style=pal.prefill)
        t.append(G_DECODE * d, style=pal.decode)
        t.append(G_PAD * pad, style=pal.padding)
        t.append(G_UNUSED * max(0, w - p - d - pad), style=pal.free)
        return t

    def _history(self, st, w: int, rows: int) -> list[Text]:
        pal = self.pal
        hist = list(st.history)[-w:]
        units = rows * 8
        cols = []
        for s in hist:
            budget = max(1, s.budget, s.prefill + s.decode + s.padding)
            p = round(units * s.prefill / budget)
            d = round(units * (s.prefill + s.decode) / budget)
            pad = round(units * (s.prefill + s.decode + s.padding) / budget)
            cols.append([(p, pal.prefill), (d, pal.decode), (pad, pal.padding)])
        styles: dict[tuple, Style] = {}
        out = []
        for r in range(rows):
            lo = (rows - 1 - r) * 8
            line = Text(" " * (1 + w - len(cols)), no_wrap=True)
            run: list[str] = []
            run_style = None
            for segs in cols:
                g, fg, bg = stack_cell(lo, segs)
                key = (fg, bg)
                style = styles.get(key)
                if style is None:
                    style = styles[key] = Style(color=fg, bgcolor=bg)
                if style is not run_style and run:
                    line.append("".join(run), style=run_style)
                    run = []
                run_style = style
                run.append(g)
            if run:
                line.append("".join(run), style=run_style)
            out.append(line)
        return out
