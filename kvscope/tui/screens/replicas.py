"""Replicas side by side: one live column per engine of a data-parallel deployment, and the imbalance between them.

    kvscope tui --replicas 2          # vLLM's data-parallel ranks: events on 5557 + rank (kvscope serve --engine vllm)

Each column is one rank's feed: its queues, its own KV block map and its batch. The strip on top sets the ranks
beside each other (running, waiting, KV use, tok/s) and says when the load is uneven: one rank queues while
another has room. Tab / shift+tab move between columns, Enter opens a rank's full dashboard, d its diagnosis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.message import Message
from textual.widgets import Footer

from kvscope.tui import fmt
from kvscope.tui.feeds import EngineRow
from kvscope.tui.screens.base import FeedScreen
from kvscope.tui.screens.dashboard import LiveDashboard
from kvscope.tui.widgets.base import StateWidget, join_lines
from kvscope.tui.widgets.batch import BatchView
from kvscope.tui.widgets.blockmap import BlockMap
from kvscope.tui.widgets.queues import blocked_reason

if TYPE_CHECKING:
    from kvscope.tui.feeds import EventFeed
    from kvscope.tui.palette import Palette

MIN_QUEUE = 2  # waiting requests on the busiest rank before an imbalance is named at all


@dataclass(frozen=True)
class Imbalance:
    """Where the load sits: the busiest rank (most waiting, then most running) against the idlest."""

    busiest: int
    idlest: int
    uneven: bool  # one rank queues while another has room
    text: str


def imbalance(rows: Sequence[EngineRow], max_num_seqs: Sequence[int | None]) -> Imbalance | None:
    """The load of the ranks set side by side; None until two of them report."""
    live = [i for i, r in enumerate(rows) if r.running is not None and r.waiting is not None]
    if len(live) < 2:
        return None
    load = {i: (rows[i].waiting or 0, rows[i].running or 0) for i in live}
    busiest = max(live, key=lambda i: load[i])
    idlest = min(live, key=lambda i: load[i])
    wb, rb = load[busiest]
    wi, ri = load[idlest]
    cap = max_num_seqs[idlest]
    room = wi == 0 and (cap is None or ri < cap)
    uneven = wb >= MIN_QUEUE and room
    total_wait = sum(w for w, _ in load.values())
    if uneven:
        share = wb / total_wait if total_wait else 1.0
        text = (f"uneven: rank {busiest} queues {wb} ({share:.0%} of all waiting) while rank {idlest} has room "
                f"({ri}{'/' + str(cap) if cap else ''} running, none waiting)")
    else:
        text = f"balanced: waiting {' · '.join(str(load[i][0]) for i in live)}, running " \
               f"{' · '.join(str(load[i][1]) for i in live)}"
    return Imbalance(busiest, idlest, uneven, text)


class ImbalanceStrip(StateWidget):
    """One line per figure across the ranks, and the imbalance verdict."""

    def __init__(self, feeds: "Sequence[EventFeed]", *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.feeds = feeds

    def render(self) -> Text:
        pal = self.pal
        rows = [f.row() for f in self.feeds]
        caps = [getattr(f.state.config, "max_num_seqs", None) if f.state.config is not None else None
                for f in self.feeds]
        lines = []
        head = Text(f" {len(rows)} replicas ", style="bold reverse", no_wrap=True, overflow="ellipsis")
        for label, cells in (("RUN", [r.running for r in rows]), ("WAIT", [r.waiting for r in rows]),
                             ("KV", [fmt.pct(r.kv_used) if r.kv_used is not None else None for r in rows]),
                             ("tok/s", [fmt.rate(r.tok_per_s) if r.tok_per_s is not None else None for r in rows])):
            head.append(f"  {label} ", style=pal.dim)
            head.append(" · ".join("-" if c is None else str(c) for c in cells), style="bold")
        lines.append(head)
        verdict = imbalance(rows, caps)
        if verdict is None:
            lines.append(Text(" waiting for the ranks' first steps", style=pal.dim, no_wrap=True))
        else:
            lines.append(Text(f" {verdict.text}", style=f"bold {pal.warn}" if verdict.uneven else pal.dim,
                              no_wrap=True, overflow="ellipsis"))
        return join_lines(lines)


class ReplicaHeader(StateWidget):
    """The rank, its address and connection, queue counts and heads, KV use and latency."""

    def __init__(self, feed: "EventFeed", index: int, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.feed = feed
        self.index = index
        self.focused = False

    def render(self) -> Text:
        pal = self.pal
        st = self.state
        row = self.feed.row()
        title = Text(no_wrap=True, overflow="ellipsis")
        title.append(f" rank {self.index} ", style=f"bold reverse {pal.ok}" if self.focused else "bold reverse")
        dot = ("●", pal.ok) if row.connection == "live" else ("○", pal.bad)
        title.append(f" {dot[0]} ", style=dot[1])
        title.append(self.feed.name, style="bold")
        lines = [title]
        counts = Text(" ", no_wrap=True, overflow="ellipsis")
        if st is None:
            lines.append(counts)
            return join_lines(lines)
        counts.append(f"RUN {len(st.running)}", style="bold")
        counts.append(f"  WAIT {len(st.waiting)}", style=f"bold {pal.warn}" if st.waiting else "bold")
        counts.append(f"  PRE {len(st.preempted)}", style=f"bold {pal.warn}" if st.preempted else "bold")
        if st.step >= 0:
            counts.append(f"   step {st.step}", style=pal.dim)
        lines.append(counts)
        heads = Text(" ", no_wrap=True, overflow="ellipsis", style=pal.dim)
        reason = blocked_reason(st)
        if st.waiting:
            heads.append(f"wait #{st.waiting[0]}", style="")
            if reason:
                heads.append(f": {reason.split(': ', 1)[-1]}", style=pal.warn if "blocked" in reason else pal.dim)
        lines.append(heads)
        figs = Text(" ", no_wrap=True, overflow="ellipsis")
        figs.append("tok/s ", style=pal.dim)
        figs.append(fmt.rate(row.tok_per_s) if row.tok_per_s is not None else "-")
        for name, v in (("TTFT p99", row.ttft_p99_s), ("ITL p99", row.itl_p99_s)):
            figs.append(f"  {name} ", style=pal.dim)
            figs.append(fmt.latency(v) if v is not None else "-")
        lines.append(figs)
        return join_lines(lines)


class ReplicaColumn(Vertical, can_focus=True):
    BINDINGS = [Binding("enter", "open", "Dashboard")]

    class Opened(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    class Focused(Message):
        def __init__(self, index: int) -> None:
            super().__init__()
            self.index = index

    def __init__(self, feed: "EventFeed", index: int) -> None:
        super().__init__(id=f"replica-{index}", classes="replica-column")
        self.feed = feed
        self.index = index

    def compose(self) -> ComposeResult:
        yield ReplicaHeader(self.feed, self.index, id=f"replica-header-{self.index}")
        yield BlockMap(id=f"replica-map-{self.index}", title="KV")
        yield BatchView(id=f"replica-batch-{self.index}")

    def show(self, pal) -> None:
        for w in self.query(StateWidget):
            w.show(self.feed.state, pal, None)

    def action_open(self) -> None:
        self.post_message(self.Opened(self.index))

    def on_focus(self) -> None:
        self._mark(True)
        self.post_message(self.Focused(self.index))

    def on_blur(self) -> None:
        self._mark(False)

    def _mark(self, on: bool) -> None:
        header = self.query_one(ReplicaHeader)
        header.focused = on
        header.refresh()


class ReplicasScreen(FeedScreen):
    BINDINGS = [
        Binding("tab", "focus_column(1)", "Next rank", show=False),
        Binding("shift+tab", "focus_column(-1)", "Prev rank", show=False),
        Binding("d", "diagnose", "Diagnose"),
    ]

    def __init__(self, feeds: "Sequence[EventFeed]") -> None:
        super().__init__()
        self.feeds = list(feeds)
        self.focus_index = 0

    def compose(self) -> ComposeResult:
        yield ImbalanceStrip(self.feeds, id="replicas-strip")
        with Horizontal(id="replicas-columns"):
            for i, feed in enumerate(self.feeds):
                yield ReplicaColumn(feed, i)
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.columns()[0].focus()

    def columns(self) -> list[ReplicaColumn]:
        return list(self.query(ReplicaColumn))

    def draw_key(self) -> tuple:
        return (self.focus_index, self.size)

    def draw(self, pal: "Palette") -> None:
        for w in self.query(ImbalanceStrip):
            w.show(None, pal, None)
        for col in self.columns():
            col.show(pal)

    def action_focus_column(self, delta: int) -> None:
        self.focus_index = (self.focus_index + delta) % len(self.feeds)
        self.columns()[self.focus_index].focus()

    @on(ReplicaColumn.Focused)
    def _focused(self, message: ReplicaColumn.Focused) -> None:
        self.focus_index = message.index

    @on(ReplicaColumn.Opened)
    def _open(self, message: ReplicaColumn.Opened) -> None:
        self.kvscope.push_screen(ReplicaDashboard(self.feeds[message.index]))

    def action_diagnose(self) -> None:
        self.kvscope.open_diagnosis(self.feeds[self.focus_index])


class ReplicaDashboard(LiveDashboard):
    """One rank's full live dashboard; Escape goes back to the ranks side by side."""

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]
