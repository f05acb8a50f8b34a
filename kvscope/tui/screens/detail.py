"""Request detail: lifecycle timeline and block table of one request of one feed."""

from __future__ import annotations

from typing import TYPE_CHECKING

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.widgets import Footer

from kvscope.tui.screens.base import FeedScreen
from kvscope.tui.widgets import BlockMap, HeaderBar, StateWidget
from kvscope.tui.widgets.request import BlockTablePanel, LifecycleLog, RequestSummary, RequestText

if TYPE_CHECKING:
    from kvscope.tui.feeds import EventFeed
    from kvscope.tui.palette import Palette


class RequestDetailScreen(FeedScreen):
    BINDINGS = [
        Binding("escape,backspace", "app.pop_screen", "Back"),
    ]

    def __init__(self, feed: "EventFeed", req: int) -> None:
        super().__init__()
        self.feed = feed
        self.req = req
        self.selected = req

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        yield RequestSummary(self.req, id="summary")
        with Horizontal(id="detail-body"):
            with VerticalScroll(id="lifecycle-scroll"):
                yield RequestText(self.req, id="request-text")
                yield LifecycleLog(self.req, id="lifecycle")
            with Vertical(id="detail-side"):
                yield BlockTablePanel(self.req, id="blocktable")
                yield BlockMap(id="detail-map", title="POOL")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#lifecycle-scroll").focus()
        self.draw(self.kvscope.pal)

    def draw(self, pal: "Palette") -> None:
        for h in self.query(HeaderBar):
            h.address, h.paused, h.loading = self.feed.address, self.feed.paused, self.feed.loading
        for w in self.query(StateWidget):
            w.show(self.feed.state, pal, self.req)
