"""Queue tables: RUNNING, WAITING and PREEMPTED (+ SWAPPED), one row per request."""

from __future__ import annotations

from rich.text import Text
from textual import events
from textual.binding import Binding
from textual.message import Message

from kvscope.protocol.events import (
    FINISHED,
    BLOCKED_BUDGET,
    BLOCKED_KV,
    BLOCKED_SEQS,
    BLOCKED_STATIC,
    SWAPPED,
    VERDICT_ADMITTED,
    VERDICT_BLOCKED,
)
from kvscope.tui import fmt
from kvscope.tui.palette import owner_color
from kvscope.tui.widgets.base import StateWidget, join_lines

TITLES = {"running": "RUNNING", "waiting": "WAITING", "preempted": "PREEMPTED"}
RECENT_SHOWN = 32  # finished requests an empty RUNNING lists (newest first), for Enter at a replay's end


def blocked_reason(st) -> str:
    """Why the head of WAITING was not admitted this step, in words ('' if it was)."""
    adm = st.admission
    if adm.verdict != VERDICT_BLOCKED:
        if adm.verdict == VERDICT_ADMITTED and adm.req is not None:
            return f"admitted #{adm.req} this step"
        return ""
    head = f"#{adm.req}" if adm.req is not None else "head"
    kv = st.kv
    if adm.reason == BLOCKED_KV:
        return f"{head} blocked: KV blocks ({kv.free}/{kv.total} free)"
    if adm.reason == BLOCKED_BUDGET:
        b = st.last_batch
        used = f" ({b.prefill + b.decode}/{b.budget})" if b else ""
        return f"{head} blocked: token budget spent{used}"
    if adm.reason == BLOCKED_SEQS:
        cap = st.config.max_num_seqs if st.config is not None else None
        return f"{head} blocked: max_num_seqs ({len(st.running)}/{cap or '?'} running)"
    if adm.reason == BLOCKED_STATIC:
        return f"{head} blocked: static batch still running"
    return f"{head} blocked: {adm.reason}"


class QueueTable(StateWidget, can_focus=True):
    """One queue. Arrow keys move the cursor, Enter opens the request's detail.

    The cursor follows a request, not a row: rows above it come and go and it stays on its request.
    When its request moves to another queue (admitted, preempted) the dashboard moves the focus there
    (``Moved``); when it finishes, its row stays, marked done, until the cursor moves. An empty RUNNING
    lists the requests finished last, so Enter opens any of them (at the end of a replay too).
    """

    BINDINGS = [
        Binding("up,k", "cursor(-1)", "Up", show=False),
        Binding("down,j", "cursor(1)", "Down", show=False),
        Binding("pageup", "cursor(-10)", "Page up", show=False),
        Binding("pagedown", "cursor(10)", "Page down", show=False),
        Binding("home", "cursor(-1000000)", "First", show=False),
        Binding("end", "cursor(1000000)", "Last", show=False),
        Binding("enter", "open", "Detail"),
    ]

    class Highlighted(Message):
        def __init__(self, table: "QueueTable", req: int | None) -> None:
            super().__init__()
            self.table = table
            self.req = req

    class Moved(Message):
        """The request under the cursor left this queue for another one."""

        def __init__(self, table: "QueueTable", req: int) -> None:
            super().__init__()
            self.table = table
            self.req = req

    class Opened(Message):
        def __init__(self, table: "QueueTable", req: int) -> None:
            super().__init__()
            self.table = table
            self.req = req

    def __init__(self, kind: str, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id or kind, classes=classes)
        self.kind = kind
        self.ids: list[int] = []
        self.cursor = 0
        self._cursor_req: int | None = None
        self._offset = 0
        self.recent = False  # the rows are recently finished requests (an empty RUNNING)
        self.queue_len = 0

    # -- data ---------------------------------------------------------------------
    def _queue(self) -> list[int]:
        st = self.state
        if st is None:
            return []
        if self.kind == "running":
            return st.running
        if self.kind == "waiting":
            return st.waiting
        return st.preempted + st.swapped

    def show(self, state, pal, selected) -> None:
        self.state = state
        self.pal = pal
        self.selected = selected
        ids = list(self._queue())
        self.queue_len = len(ids)
        self.recent = not ids and self.kind == "running" and state is not None and bool(state.finished)
        if self.recent:
            ids = list(reversed(state.finished))[:RECENT_SHOWN]
        followed = self._cursor_req
        gone = state.get(followed) if followed is not None and followed not in ids and state is not None else None
        if followed is not None and followed in ids:
            self.cursor = ids.index(followed)
        elif gone is not None and self.has_focus and gone.state == FINISHED:
            self.cursor = min(self.cursor, len(ids))
            ids.insert(self.cursor, followed)  # its row stays, marked done, until the cursor moves
        else:
            if gone is not None and self.has_focus:
                self.post_message(self.Moved(self, followed))  # the dashboard moves the focus after it
            self.cursor = min(self.cursor, max(0, len(ids) - 1))
        self.ids = ids
        new_req = ids[self.cursor] if ids else None
        if new_req != self._cursor_req:
            self._cursor_req = new_req
            if self.has_focus and gone is None:
                self.post_message(self.Highlighted(self, new_req))
        self.refresh()

    @property
    def cursor_req(self) -> int | None:
        return self.ids[self.cursor] if self.ids else None

    def follow(self, req: int) -> None:
        """Put the cursor on ``req`` (the dashboard, when a request moved here from another queue)."""
        self._cursor_req = req
        if req in self.ids:
            self.cursor = self.ids.index(req)
        self.refresh()

    # -- actions ------------------------------------------------------------------
    def action_cursor(self, delta: int) -> None:
        if not self.ids:
            return
        self.cursor = max(0, min(len(self.ids) - 1, self.cursor + delta))
        self._cursor_req = self.ids[self.cursor]
        self.post_message(self.Highlighted(self, self._cursor_req))
        self.refresh()

    def action_open(self) -> None:
        req = self.cursor_req
        if req is not None:
            self.post_message(self.Opened(self, req))

    def on_focus(self, event: events.Focus) -> None:
        self.post_message(self.Highlighted(self, self.cursor_req))
        self.refresh()

    def on_blur(self, event: events.Blur) -> None:
        self.refresh()

    def _header_lines(self) -> int:
        return 3 if self.kind == "waiting" else 2

    def on_click(self, event: events.Click) -> None:
        row = event.y - self._header_lines() + self._offset
        if 0 <= row < len(self.ids):
            self.cursor = row
            self._cursor_req = self.ids[row]
            self.post_message(self.Highlighted(self, self._cursor_req))
            if event.chain >= 2:
                self.post_message(self.Opened(self, self._cursor_req))
            self.refresh()

    # -- drawing ------------------------------------------------------------------
    def render(self) -> Text:
        st = self.state
        pal = self.pal
        width = max(10, self.size.width)
        height = max(1, self.size.height)
        title = TITLES.get(self.kind, self.kind.upper())
        ids = self.ids
        lines: list[Text] = []
        head = Text(no_wrap=True, overflow="ellipsis")
        head.append(f" {title} ", style="bold reverse" if self.has_focus else "bold")
        head.append(f" {self.queue_len}", style="bold")
        if self.kind == "preempted" and st is not None and st.swapped:
            head.append(f"  ({len(st.swapped)} swapped)", style=pal.dim)
        if self.kind == "running" and st is not None:
            cap = st.config.max_num_seqs if st.config is not None else None
            if cap:
                head.append(f" / {cap} seqs", style=pal.dim)
            if self.recent:
                head.append("  · finished last (Enter: detail)", style=pal.dim)
        lines.append(head)
        if self.kind == "waiting":
            reason = blocked_reason(st) if st is not None else ""
            style = f"bold {pal.warn}" if st is not None and st.admission.verdict == VERDICT_BLOCKED else pal.dim
            lines.append(Text(" " + (reason or "nothing blocked"), style=style, no_wrap=True, overflow="ellipsis"))
        wide = width >= 42
        cols = Text(no_wrap=True, overflow="ellipsis", style=f"bold {pal.dim}")
        cols.append("     id chunks out/max  age  ttft p" + (" pre" if wide else ""))
        lines.append(cols)
        room = max(0, height - len(lines))
        rows = room if len(ids) <= room else max(1, room - 1)  # keep a line for "more"
        if self.cursor < self._offset:
            self._offset = self.cursor
        elif self.cursor >= self._offset + rows:
            self._offset = self.cursor - rows + 1
        self._offset = max(0, min(self._offset, max(0, len(ids) - rows)))
        if st is None or not ids:
            if room:
                lines.append(Text("  (empty)", style=pal.dim))
        else:
            now = st.t
            end = min(len(ids), self._offset + rows)
            for i in range(self._offset, end):
                lines.append(self._row(st, ids[i], now, i == self.cursor and self.has_focus, wide))
            if len(ids) > rows and room > rows:
                lines.append(Text(f"  ↑{self._offset} ↓{len(ids) - end} more", style=pal.dim))
        for ln in lines:
            ln.truncate(width, overflow="ellipsis")
        return join_lines(lines)

    def _row(self, st, rid: int, now: float, is_cursor: bool, wide: bool) -> Text:
        pal = self.pal
        r = st.get(rid)
        t = Text(no_wrap=True, overflow="ellipsis")
        mark = "▶" if rid == self.selected else " "
        t.append(mark, style=f"bold {pal.selected}")
        t.append("■ ", style=owner_color(pal, rid))
        t.append(f"#{rid}".rjust(5))
        if r is None or not r.known:
            t.append("  (no request record yet)", style=pal.dim)
        else:
            done, total = st.chunks(r)
            t.append(f" {f'{done}/{total}':>6}")
            t.append(f" {f'{r.output_len}/{r.max_tokens}':>7}")
            t.append(f" {fmt.dur(max(0.0, now - r.arrival)):>5}")
            t.append(f" {fmt.dur(r.ttft) if r.ttft is not None else '-':>5}",
                     style=pal.dim if r.ttft is None else "")
            t.append(f" {r.priority:>1}")
            if wide:
                if r.state == FINISHED:
                    t.append(" done", style=pal.dim)
                elif r.state == SWAPPED:
                    t.append(" swp", style=pal.warn)
                elif r.preemptions:
                    t.append(f" ↺{r.preemptions:<2}", style=pal.warn)
        if is_cursor:
            t.stylize("reverse")
        return t
