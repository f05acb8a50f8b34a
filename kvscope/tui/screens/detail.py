"""Request detail: lifecycle timeline and block table of one request."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical, VerticalScroll
from textual.screen import Screen
from textual.widgets import Footer

from kvscope.tui.widgets import BlockMap, HeaderBar, StateWidget
from kvscope.tui.widgets.request import BlockTablePanel, LifecycleLog, RequestSummary


class RequestDetailScreen(Screen):
    BINDINGS = [
        Binding("escape,backspace", "app.pop_screen", "Back"),
    ]

    def __init__(self, req: int) -> None:
        super().__init__()
        self.req = req

    def compose(self) -> ComposeResult:
        yield HeaderBar(id="header")
        yield RequestSummary(self.req, id="summary")
        with Horizontal(id="detail-body"):
            with VerticalScroll(id="lifecycle-scroll"):
                yield LifecycleLog(self.req, id="lifecycle")
            with Vertical(id="detail-side"):
                yield BlockTablePanel(self.req, id="blocktable")
                yield BlockMap(id="detail-map", title="POOL")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one("#lifecycle-scroll").focus()
        app = self.app
        if hasattr(app, "state"):
            self.show_state(app.state, app.pal, app.selected)

    def show_state(self, state, pal, selected) -> None:
        for w in self.query(StateWidget):
            w.show(state, pal, self.req)
