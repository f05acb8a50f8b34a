"""Request detail widgets: summary with a lifecycle strip, the event log, the block table."""

from __future__ import annotations

import textwrap

from rich.text import Text

from kvscope.protocol.events import FINISHED, PREEMPTED, RUNNING, SWAPPED, WAITING
from kvscope.tui import fmt
from kvscope.tui.palette import owner_color
from kvscope.tui.model.state import (
    LOG_DECODE,
    LOG_FINISH,
    LOG_FIRST,
    LOG_PREEMPT,
    LOG_PREFILL,
    LOG_QUEUED,
    LOG_REJECT,
    LOG_RESYNC,
)
from kvscope.tui.widgets.base import StateWidget, join_lines

# Phase glyphs of the lifecycle strip (glyph and colour both differ).
PH_QUEUED, PH_PREFILL, PH_DECODE, PH_PREEMPTED = "·", "█", "▓", "░"


def phases(r, now: float) -> list[tuple[float, float, str]]:
    """(start, end, phase) spans from arrival to now (or the finish).

    A phase lasts from its log entry to the next one: queued from arrival, prefill
    from a chunk (gaps between chunks count as prefill), decode from a decode run,
    preempted from a preemption until the request runs again.
    """
    pts: list[tuple[float, str]] = [(r.arrival, "queued")]
    for e in r.log:
        if e.kind == LOG_PREFILL:
            pts.append((e.t, "prefill"))
        elif e.kind == LOG_DECODE:
            pts.append((e.t, "decode"))
        elif e.kind == LOG_PREEMPT:
            pts.append((e.t, "preempted"))
    end = r.end_t if r.end_t is not None else now
    spans = []
    for (t0, p), (t1, _) in zip(pts, pts[1:] + [(max(end, pts[-1][0]), "")]):
        if t1 > t0:
            spans.append((t0, t1, p))
    if not spans:
        spans.append((pts[-1][0], pts[-1][0] + 1e-9, pts[-1][1]))
    return spans


class RequestWidget(StateWidget):
    """A widget about one request, named by id."""

    def __init__(self, req: int, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.req = req


class RequestSummary(RequestWidget):
    """Request fields, then a strip from arrival to now: queued · prefill █ decode ▓ preempted ░."""

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(10, self.size.width)
        t = Text(no_wrap=True, overflow="ellipsis")
        t.append(f" REQUEST #{self.req} ", style=f"bold reverse {owner_color(pal, self.req)}")
        r = st.get(self.req) if st is not None else None
        if r is None:
            t.append("  no longer in view (finished long ago, or before a restart)", style=pal.dim)
            return t
        state_style = {RUNNING: pal.ok, WAITING: pal.dim, PREEMPTED: pal.warn, SWAPPED: pal.warn,
                       FINISHED: pal.bar}.get(r.state, "")
        t.append(f" {r.state.upper()} ", style=f"bold {state_style}")
        if r.finish_reason:
            t.append(f"({r.finish_reason}) ", style=pal.dim)
        t.append(f" prio {r.priority}")
        if r.source:
            t.append(f" · from {r.source.upper()}", style=f"bold {pal.ok}")
        l2 = Text(no_wrap=True, overflow="ellipsis")
        done, total = st.chunks(r)
        l2.append(f" prompt {r.prompt_len} · computed {r.computed} · chunks {done}/{total} (life {r.total_chunks})"
                  f" · out {r.output_len}/{r.max_tokens}")
        if r.cached_tokens:
            l2.append(f" · prefix hit {r.cached_tokens}")
        if r.swaps:
            l2.append(f" · swapped {r.swaps}x", style=pal.warn)
        l3 = Text(no_wrap=True, overflow="ellipsis")
        end = r.end_t if r.end_t is not None else st.t
        l3.append(f" arrival {r.arrival:.3f}s · age {fmt.dur(max(0.0, end - r.arrival))} · ttft {fmt.latency(r.ttft)}")
        if r.e2e is not None:
            l3.append(f" · e2e {fmt.latency(r.e2e)}")
        if r.preemptions:
            l3.append(f" · preempted {r.preemptions}×", style=f"bold {pal.warn}")
        j = r.judgement
        if j is not None and j.checks:  # against the SLO (docs/GOODPUT.md): met, or missed and by how much
            if j.good:
                l3.append(" · SLO met", style=f"bold {pal.ok}")
            else:
                why = ", ".join(f"{k} +{fmt.latency(v - t)}" for k, v, t in j.missed) or "ended early"
                l3.append(f" · SLO missed ({why})", style=f"bold {pal.bad}")
        strip = self._strip(r, st.t, width - 2)
        lines = [t, l2, l3, strip]
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines)

    def _strip(self, r, now: float, w: int) -> Text:
        pal = self.pal
        spans = phases(r, now)
        t = Text(" ", no_wrap=True)
        if not spans or w <= 0:
            return t
        t0 = spans[0][0]
        t1 = max(spans[-1][1], t0 + 1e-9)
        style = {"queued": (PH_QUEUED, pal.dim), "prefill": (PH_PREFILL, pal.prefill),
                 "decode": (PH_DECODE, pal.decode), "preempted": (PH_PREEMPTED, pal.warn)}
        cells = []
        for c in range(w):
            x = t0 + (c + 0.5) * (t1 - t0) / w
            ph = spans[-1][2]
            for a, b, p in spans:
                if a <= x < b:
                    ph = p
                    break
            cells.append(ph)
        # Short phases (a preemption, a one-step prefill) must stay visible.
        for a, b, p in spans:
            if p in ("preempted", "prefill"):
                c = min(w - 1, int((a - t0) / (t1 - t0) * w))
                if cells[c] == "queued":
                    cells[c] = p
        for ph in cells:
            g, colour = style[ph]
            t.append(g, style=colour)
        return t


def wrap(text: str, width: int) -> list[str]:
    """Text cut into lines of at most width cells, its own line breaks kept."""
    out = []
    for para in text.replace("\r", "").split("\n"):
        out += textwrap.wrap(para, width, replace_whitespace=False, drop_whitespace=True) or [""]
    return out


class RequestText(RequestWidget):
    """The prompt (its last 4,000 characters, where the question is) and the completion as text, whole:
    the completion grows as it is generated, and the detail screen scrolls. Shown only when the events
    carry text (a model with a real tokenizer), hidden otherwise."""

    DEFAULT_CSS = """
    RequestText {
        height: auto;
        display: none;
    }
    """

    def __init__(self, req: int, **kw) -> None:
        super().__init__(req, **kw)
        self._shape: tuple = ()

    def show(self, state, pal, selected) -> None:
        r = state.get(self.req) if state is not None else None
        self.display = r is not None and bool(r.prompt_text or r.output_text)
        super().show(state, pal, selected)
        shape = (len(r.prompt_text), len(r.output_text), r.state, self.size.width) if r is not None else ()
        if shape != self._shape:  # height: auto is measured again only on a layout refresh
            self._shape = shape
            self.refresh(layout=True)

    def render(self) -> Text:
        r = self.state.get(self.req) if self.state is not None else None
        pal = self.pal
        width = max(20, self.size.width - 2)
        lines = []
        if r is None:
            return join_lines(lines)
        lines.append(Text(" PROMPT", style="bold", no_wrap=True))
        lines += [Text(" " + ln, style=pal.dim) for ln in wrap(r.prompt_text.strip(), width)]
        done = r.state == FINISHED
        head = Text(" COMPLETION", style="bold", no_wrap=True)
        if not done:
            head.append(f"  generating … {r.output_len}/{r.max_tokens} tokens", style=pal.dim)
        lines.append(head)
        if r.output_text:
            body = wrap(r.output_text.strip(), width)
            lines += [Text(" " + ln) for ln in body]
            if not done:
                lines[-1].append("▌", style=pal.dim)
        else:
            lines.append(Text(" (the first words appear with its first tokens)" if not done else " (empty)",
                              style=pal.dim))
        lines.append(Text(""))
        return join_lines(lines)


class LifecycleLog(RequestWidget):
    """One line per lifecycle event (runs of decode steps folded into one)."""

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        head = Text(" LIFECYCLE", style="bold", no_wrap=True)
        r = st.get(self.req) if st is not None else None
        if r is None:
            return head
        head.append(f"  (last {len(r.log)} entries)", style=pal.dim)
        lines = [head, Text("    step        t  event", style=f"bold {pal.dim}")]
        chunk_no = 0
        for e in r.log:
            ln = Text(no_wrap=True, overflow="ellipsis")
            if e.kind == LOG_DECODE and e.end_step > e.step:
                ln.append(f"{e.step}-{e.end_step}".rjust(9))
            else:
                ln.append(f"{e.step}".rjust(9))
            ln.append(f"{e.t:>8.3f}s ", style=pal.dim)
            if e.kind == LOG_QUEUED:
                ln.append("arrived, queued", style=pal.dim)
            elif e.kind == LOG_PREFILL:
                chunk_no += 1
                ln.append(f"{PH_PREFILL} prefill chunk {chunk_no}", style=pal.prefill)
                ln.append(f" {e.tokens} tok [{e.start}:{e.start + e.tokens}]")
            elif e.kind == LOG_FIRST:
                ln.append(f"first token, ttft {fmt.latency(float(e.note))}", style="bold")
            elif e.kind == LOG_DECODE:
                n = e.end_step - e.step + 1
                ln.append(f"{PH_DECODE} decode", style=pal.decode)
                ln.append(f" ×{n} step{'s' if n != 1 else ''}")
                if e.end_t > e.t:
                    ln.append(f" over {fmt.dur(e.end_t - e.t)}", style=pal.dim)
            elif e.kind == LOG_PREEMPT:
                chunk_no = 0
                ln.append(f"{PH_PREEMPTED} preempted ({e.note})", style=f"bold {pal.warn}")
            elif e.kind == LOG_FINISH:
                ln.append(f"finished: {e.note}", style=f"bold {pal.ok}")
            elif e.kind == LOG_REJECT:
                ln.append(f"rejected: {e.note}", style=f"bold {pal.bad}")
            elif e.kind == LOG_RESYNC:
                ln.append("resync from snapshot (earlier history not seen)", style=pal.dim)
            else:
                ln.append(e.kind)
            lines.append(ln)
        return join_lines(lines)


class BlockTablePanel(RequestWidget):
    """The request's block table (logical → physical), shared blocks marked."""

    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(10, self.size.width)
        head = Text(" BLOCK TABLE", style="bold", no_wrap=True)
        if st is None:
            return head
        table = st.tables.get(self.req, [])
        r = st.get(self.req)
        bs = st.block_size
        slots = len(table) * bs
        head.append(f"  {len(table)} blocks, {slots} slots", style=pal.dim)
        lines = [head]
        if r is not None and table:
            used = min(r.computed, slots)
            lines.append(Text(f" {used} tokens cached, {slots - used} slots empty", style=pal.dim))
        if not table:
            msg = "no blocks held" if r is None or r.state != FINISHED else "blocks returned to the pool"
            lines.append(Text(f" ({msg})", style=pal.dim))
            return join_lines(lines)
        refc = st.blocks.refcount
        colour = owner_color(pal, self.req)
        cells: list[Text] = []
        for i, b in enumerate(table):
            c = Text(no_wrap=True)
            c.append(f"{i:>3}→", style=pal.dim)
            shared = b < len(refc) and refc[b] > 1
            c.append(f"{b:<5}", style=f"bold {colour}")
            c.append(f"▒{refc[b]}" if shared else "  ", style=pal.warn if shared else "")
            cells.append(c)
        per_line = max(1, (width - 1) // 12)
        for i in range(0, len(cells), per_line):
            ln = Text(" ", no_wrap=True)
            for c in cells[i:i + per_line]:
                ln.append_text(c)
                ln.append(" ")
            lines.append(ln)
        lines.append(Text(" ▒n = shared block, n references", style=pal.dim))
        return join_lines(lines)
