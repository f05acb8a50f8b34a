"""The dashboard: header, queues, block map, batch, latency; live and replay variants."""

from __future__ import annotations

from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal, Vertical
from textual.screen import Screen
from textual.widgets import Footer

from kvscope.tui.widgets import BatchView, BlockMap, HeaderBar, LatencyPanel, QueueTable, ReplayBar, StateWidget


class DashboardScreen(Screen):
    """Same widgets in every mode; subclasses add the mode's keys."""

    BINDINGS = [
        Binding("tab", "app.focus_next", "Next queue", show=False),
        Binding("shift+tab", "app.focus_previous", "Prev queue", show=False),
        Binding("d", "app.diagnose", "Diagnose", show=False),
    ]

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
        app = self.app
        if hasattr(app, "state"):
            self.show_state(app.state, app.pal, app.selected)

    def show_state(self, state, pal, selected) -> None:
        for w in self.query(StateWidget):
            w.show(state, pal, selected)


class LiveDashboard(DashboardScreen):
    BINDINGS = [
        Binding("b", "app.control('burst')", "Burst"),
        Binding("l", "app.control('long')", "Long prompt"),
        Binding("space", "app.toggle_engine", "Pause"),
        Binding("s", "app.control('snapshot')", "Resync", show=False),
    ]


# The replay keys, shared by the replay dashboard and the compare screen.
REPLAY_KEYS = [
    Binding("space", "app.replay('toggle')", "Play"),
    Binding("right", "app.replay('step_forward')", "Step"),
    Binding("left", "app.replay('step_back')", "Back", show=False),
    Binding("g", "app.seek_prompt('step')", "Seek"),
    Binding("t", "app.seek_prompt('time')", "Time", show=False),
    Binding("plus,equals_sign", "app.replay('faster')", "Speed±"),
    Binding("minus", "app.replay('slower')", "Slow", show=False),
]


class ReplayDashboard(DashboardScreen):
    # "p" sits before the speed keys, where the footer has always shown it
    BINDINGS = REPLAY_KEYS[:5] + [Binding("p", "app.replay('next_preemption')", "Preempt")] + REPLAY_KEYS[5:]

    def compose_extra(self) -> ComposeResult:
        yield ReplayBar(id="replaybar")

    def on_mount(self) -> None:
        super().on_mount()
        self.query_one(ReplayBar).replay = getattr(self.app, "replay", None)
