"""Compare: two to four runs side by side on one clock, and one run's full dashboard.

Columns are at least MIN_COLUMN_WIDTH cells wide: four fit from 160 columns; at 80×24
two show at a time and ``[`` / ``]`` (or Tab onto a hidden column) page through the
rest.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterable

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding
from textual.containers import Horizontal
from textual.widgets import Footer, Static

from kvscope.tui.sources.runs import differing_knobs, setup_line, workload_notice
from kvscope.tui.screens.base import Command, FeedScreen
from kvscope.tui.screens.dashboard import ReplayDashboard
from kvscope.tui.screens.keys import PREEMPT_KEY, REPLAY_KEYS, PlayerKeys
from kvscope.tui.widgets import ReplayBar
from kvscope.tui.widgets.run_column import RunColumn
from kvscope.tui.widgets.summary_strip import SummaryStrip

if TYPE_CHECKING:
    from kvscope.tui.feeds import ReplayFeed
    from kvscope.tui.palette import Palette
    from kvscope.tui.model.player import Player

MIN_COLUMN_WIDTH = 38

def columns_that_fit(width: int, runs: int) -> int:
    return max(1, min(runs, width // MIN_COLUMN_WIDTH))


class CompareScreen(PlayerKeys, FeedScreen):
    """One column per run (a ReplayFeed each), all moved by one player; ``d`` judges the focused run."""

    BINDINGS = REPLAY_KEYS + [
        Binding("tab", "focus_column(1)", "Next run", show=False),
        Binding("shift+tab", "focus_column(-1)", "Prev run", show=False),
        Binding("right_square_bracket", "page(1)", "Page", show=False),
        Binding("left_square_bracket", "page(-1)", "Page", show=False),
        Binding(PREEMPT_KEY.key, PREEMPT_KEY.action, PREEMPT_KEY.description, show=False),
        Binding("d", "diagnose", "Diagnose", show=False),
    ]

    def __init__(self, feeds: "list[ReplayFeed]", player: "Player", notes: list[str] | None = None) -> None:
        super().__init__()
        self.feeds = feeds
        self.player = player
        self.runs = [f.run for f in feeds]
        self.notes = [n for n in (notes or []) if n]
        self.focus_index = 0
        self.page_start = 0

    def compose(self) -> ComposeResult:
        setup = setup_line(self.runs)
        yield Static(f" {setup}" if setup else "", id="compare-setup", classes="" if setup else "hidden")
        notes = list(self.notes)
        notice = workload_notice(self.runs)
        if notice:
            notes.append(notice)
        for r in self.runs:
            notes.extend(f"{r.label}: {w}" for w in r.warnings[:2])
        yield Static(" · ".join(notes), id="compare-notice", classes="" if notes else "hidden")
        knobs = differing_knobs(self.runs)
        with Horizontal(id="compare-columns"):
            for i, run in enumerate(self.runs):
                yield RunColumn(run, i, knobs, id=f"run-{i}")
        yield SummaryStrip(self.runs, id="compare-summary")
        yield ReplayBar(id="replaybar")
        yield Footer(compact=True)

    def on_mount(self) -> None:
        self.query_one(ReplayBar).replay = self.player
        self._layout_columns()
        self.columns()[0].focus()

    def on_resize(self) -> None:
        self._layout_columns()

    def columns(self) -> list[RunColumn]:
        return list(self.query(RunColumn))

    def visible_count(self) -> int:
        return columns_that_fit(self.size.width or 80, len(self.runs))

    def _layout_columns(self) -> None:
        n = self.visible_count()
        total = len(self.runs)
        if not (self.page_start <= self.focus_index < self.page_start + n):
            self.page_start = (self.focus_index // n) * n
        self.page_start = max(0, min(self.page_start, max(0, total - n)))
        for i, col in enumerate(self.columns()):
            col.display = self.page_start <= i < self.page_start + n

    def action_focus_column(self, delta: int) -> None:
        self.focus_index = (self.focus_index + delta) % len(self.runs)
        self._layout_columns()
        self.columns()[self.focus_index].focus()

    def action_page(self, delta: int) -> None:
        n = self.visible_count()
        self.focus_index = max(0, min(len(self.runs) - 1, self.page_start + delta * n))
        self.page_start = self.focus_index
        self._layout_columns()
        self.columns()[self.focus_index].focus()

    @on(RunColumn.Focused)
    def _column_focused(self, message: RunColumn.Focused) -> None:
        self.focus_index = message.index
        self.player.focus = message.index

    @on(RunColumn.Opened)
    def _open_run(self, message: RunColumn.Opened) -> None:
        run = self.runs[message.index]
        if not run.ok:
            self.kvscope.notify(f"{run.label}: {run.error}", severity="warning")
            return
        self.player.focus = message.index
        self.kvscope.push_screen(RunDashboard(self.feeds[message.index], self.player, message.index))

    def action_diagnose(self) -> None:
        self.kvscope.open_diagnosis(self.feeds[self.focus_index])

    def draw_key(self) -> tuple:
        return (self.focus_index, self.page_start, self.size)

    def draw(self, pal: "Palette") -> None:
        for col in self.columns():
            if col.display:
                col.show(self.feeds[col.index].state, pal)
        for w in self.query(SummaryStrip):
            w.show(None, pal, None)
        for w in self.query(ReplayBar):
            w.show(None, pal, None)

    def commands(self) -> Iterable[Command]:
        yield from self.player_commands()


class RunDashboard(ReplayDashboard):
    """One run's full dashboard, at the compare clock's moment; Escape goes back."""

    BINDINGS = [Binding("escape,backspace", "app.pop_screen", "Back")]

    def __init__(self, feed: "ReplayFeed", player: "Player", index: int) -> None:
        super().__init__(feed, player)
        self.index = index
