"""The dashboard of one kvscope feed: header, queues, block map, batch, latency; live and replay variants."""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.widgets import Footer

from kvscope.tui.screens.base import Command, FeedScreen
from kvscope.tui.screens.keys import PREEMPT_KEY, REPLAY_KEYS, PlayerKeys
from kvscope.tui.widgets import BatchView, BlockMap, HeaderBar, LatencyPanel, QueueTable, ReplayBar, StateWidget

if TYPE_CHECKING:
    from kvscope.tui.feeds import EventFeed
    from kvscope.tui.palette import Palette
    from kvscope.tui.model.player import Player


class DashboardScreen(FeedScreen):
    """Same widgets in every mode; subclasses add the mode's keys. Enter on a request: its detail."""

    BINDINGS = [
        Binding("tab", "app.focus_next", "Next queue", show=False),
        Binding("shift+tab", "app.focus_previous", "Prev queue", show=False),
        Binding("d", "diagnose", "Diagnose", show=False),
    ]

    def __init__(self, feed: "EventFeed", player: "Player | None" = None) -> None:
        super().__init__()
        self.feed = feed
        self.player = player
        self._armed = False  # nothing is selected until the user moves a cursor

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        with Horizontal(id="body"):
            with Vertical(id="queues"):
                yield QueueTable("running")
                yield QueueTable("waiting")
                yield QueueTable("preempted")
            with Vertical(id="panels"):
                yield BlockMap(id="blockmap")
                yield BatchView(id="batch")
                yield LatencyPanel(id="latency")
        yield from self.compose_extra()
        yield Footer(compact=True)

    def compose_extra(self) -> ComposeResult:
        return iter(())

    def on_mount(self) -> None:
        self.query_one("#running", QueueTable).focus()
        self.draw(self.kvscope.pal)
        self.call_after_refresh(self._arm)

    def _arm(self) -> None:
        self._armed = True

    def draw(self, pal: "Palette") -> None:
        feed = self.feed
        for h in self.query(HeaderBar):
            h.address, h.paused, h.loading = feed.address, feed.paused, feed.loading
        for w in self.query(StateWidget):
            w.show(feed.state, pal, self.selected)

    def on_queue_table_highlighted(self, message: QueueTable.Highlighted) -> None:
        stale = message.req != message.table.cursor_req  # the cursor moved on before this message came
        if self._armed and not stale and message.req is not None and message.req != self.selected:
            self.selected = message.req
            self.kvscope.redraw()

    def on_queue_table_moved(self, message: QueueTable.Moved) -> None:
        """The highlighted request changed queues: the cursor goes with it (unless it was sent elsewhere since)."""
        if message.req != self.selected:
            return
        for table in self.query(QueueTable):
            if table is not message.table and message.req in table.ids:
                table.follow(message.req)
                table.focus()
                return

    def on_queue_table_opened(self, message: QueueTable.Opened) -> None:
        from kvscope.tui.screens.detail import RequestDetailScreen

        self.selected = message.req
        self.kvscope.push_screen(RequestDetailScreen(self.feed, message.req))

    def action_diagnose(self) -> None:
        self.kvscope.open_diagnosis(self.feed)

    def commands(self) -> Iterable[Command]:
        yield ("Diagnose", "The bottleneck of the recent steps, and the knobs to turn", self.action_diagnose)


class LiveDashboard(DashboardScreen):
    """A live engine: its controls on b, l, space and s."""

    BINDINGS = [
        Binding("b", "control('burst')", "Burst"),
        Binding("l", "control('long')", "Long prompt"),
        Binding("space", "toggle_engine", "Pause"),
        Binding("s", "control('snapshot')", "Resync", show=False),
    ]

    def action_control(self, cmd: str) -> None:
        controls = self.feed.controls
        if controls is None:
            self.kvscope.notify("control needs a live engine with a control address", severity="warning", timeout=2)
            return
        controls.request(cmd)

    def action_toggle_engine(self) -> None:
        """Pause, or resume a paused engine: the engine's own replies say which it is."""
        controls = self.feed.controls
        self.action_control("resume" if controls is not None and controls.paused else "pause")

    def commands(self) -> Iterable[Command]:
        yield from super().commands()
        yield ("Burst", "Inject a burst of requests", lambda: self.action_control("burst"))
        yield ("Long prompt", "Inject one long prompt", lambda: self.action_control("long"))
        yield ("Pause / resume engine", "Stop or restart scheduling", self.action_toggle_engine)
        yield ("Snapshot now", "Resync the picture from a snapshot", lambda: self.action_control("snapshot"))


class ReplayDashboard(PlayerKeys, DashboardScreen):
    # "p" sits before the speed keys, where the footer has always shown it
    BINDINGS = REPLAY_KEYS[:5] + [PREEMPT_KEY] + REPLAY_KEYS[5:]

    def __init__(self, feed: "EventFeed", player: "Player") -> None:
        super().__init__(feed, player)
        self.player = player

    def compose_extra(self) -> ComposeResult:
        yield ReplayBar(id="replaybar")

    def on_mount(self) -> None:
        self.query_one(ReplayBar).replay = self.player
        super().on_mount()

    def show_preemption(self, step: int) -> None:
        """`p` landed on a step with a preemption: the victim is selected (its row and blocks light up) and
        the cursor goes to it, also when it was re-admitted within the same step (then RUNNING holds it)."""
        st = self.feed.state
        if st.step != step or not st.preempted_now:
            super().show_preemption(step)
            return
        req, reason, mode = st.preempted_now[0]
        self.selected = req
        self.draw(self.kvscope.pal)  # the tables' rows of this step, before the cursor goes to the victim
        for table in self.query(QueueTable):
            if req in table.ids:
                table.follow(req)
                table.focus()
                break
        where = ("re-admitted in the same step (RUNNING)" if req in st.running else
                 "back in WAITING" if req in st.waiting else "in PREEMPTED")
        more = f" (+{len(st.preempted_now) - 1} more)" if len(st.preempted_now) > 1 else ""
        self.kvscope.toast(f"step {step}: #{req} preempted ({reason}, {mode}){more}, {where}", timeout=4,
                           key="preemption")
        self.kvscope.redraw()

    def commands(self) -> Iterable[Command]:
        yield from super().commands()
        yield from self.player_commands()
