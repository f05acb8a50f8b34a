"""The compare app: N traces, N reducer states, one SyncedReplay clock, ≤30 repaints a second.

Each run has its own state, folded from its own events by the same reducer as the
dashboard, so a column at a moment shows what that run's replay shows at that step.
"""

from __future__ import annotations

import time
from typing import Callable

from textual import on
from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from kvscope.errors import KvscopeError
from kvscope.tui.palette import CB, DEFAULT, get_palette
from kvscope.tui.runs import MAX_RUNS, Run, load_run
from kvscope.tui.screens import HelpScreen, RequestDetailScreen, SeekScreen
from kvscope.tui.screens.compare import CompareScreen, RunDashboard
from kvscope.tui.screens.seek import seek_to
from kvscope.tui.sources import CONN_REPLAY
from kvscope.tui.state import new_state, reduce
from kvscope.tui.sync import ALIGN_TIME, SyncedReplay, make_track
from kvscope.tui.widgets import QueueTable
from kvscope.tui.widgets.run_column import RunColumn

MAX_FPS = 30.0
LABELS = "ABCD"


class CompareError(KvscopeError):
    """A compare the user asked for that cannot be shown (one line)."""


def load_runs(paths: list[str], clock: Callable[[], float]) -> list[Run]:
    if not 2 <= len(paths) <= MAX_RUNS:
        raise CompareError(f"compare takes 2 to {MAX_RUNS} traces, got {len(paths)}")
    return [load_run(p, LABELS[i], clock=clock) for i, p in enumerate(paths)]


class CompareApp(App):
    CSS_PATH = ["styles/app.tcss", "styles/compare.tcss"]
    TITLE = "kvscope compare"
    BINDINGS = [
        Binding("q", "quit", "Quit"),
        Binding("question_mark", "help", "Help"),
        Binding("c", "toggle_palette", "Colours", show=False),
    ]

    def __init__(self, runs: list[Run], *, align: str = ALIGN_TIME, speed: float = 1.0, playing: bool = True,
                 palette: str = "default", clock: Callable[[], float] = time.monotonic, auto_tick: bool = True,
                 notes: list[str] | None = None) -> None:
        super().__init__()
        self.runs = runs
        self.notes = notes or []
        self.pal = get_palette(palette)
        self.auto_tick = auto_tick
        self.states = [new_state(conn=CONN_REPLAY) for _ in runs]
        controllers = [r.controller for r in runs]
        tracks = [make_track(r.controller, align, r.first_arrival) if r.ok else None for r in runs]
        self.sync = SyncedReplay(controllers, tracks, align=align, speed=speed, playing=playing, clock=clock)
        self.selected: int | None = None
        self._drawn_key = None
        self._last_draw = 0.0

    @property
    def replay(self) -> SyncedReplay:
        """The replay bar and the dashboard's replay keys talk to the shared clock."""
        return self.sync

    def get_default_screen(self) -> Screen:
        return CompareScreen(self.runs, self.notes)

    def on_mount(self) -> None:
        self.pump()
        if self.auto_tick:
            self.set_interval(1.0 / MAX_FPS, self.pump, name="kvscope-compare")

    # -- the loop -------------------------------------------------------------------
    def pump(self) -> int:
        batches = self.sync.sync()
        applied = 0
        for k, events in enumerate(batches):
            st = self.states[k]
            for ev in events:
                st = reduce(st, ev)
            self.states[k] = st
            applied += len(events)
        self.redraw()
        return applied

    def redraw(self, force: bool = False) -> None:
        s = self.sync.status()
        key = (tuple((id(st), st.version) for st in self.states), s["playing"], s["speed"], round(s["t"], 2),
               self.sync.focus, self.selected, self.pal.name, len(self.screen_stack), self.size)
        if not force and key == self._drawn_key:
            return
        self._drawn_key = key
        for screen in self.screen_stack:
            if isinstance(screen, CompareScreen):
                screen.show_states(self.states, self.pal)
            elif isinstance(screen, RunDashboard):
                screen.show_states(self.states, self.pal, self.selected)
            elif isinstance(screen, RequestDetailScreen):
                screen.show_state(self.states[self._drilled()], self.pal, self.selected)

    def _drilled(self) -> int:
        for screen in reversed(self.screen_stack):
            if isinstance(screen, RunDashboard):
                return screen.index
        return self.sync.focus

    # -- messages -------------------------------------------------------------------
    @on(RunColumn.Opened)
    def _open_run(self, message: RunColumn.Opened) -> None:
        if not self.runs[message.index].ok:
            self.notify(f"{self.runs[message.index].label}: {self.runs[message.index].error}", severity="warning")
            return
        self.sync.focus = message.index
        self.push_screen(RunDashboard(message.index))
        self.redraw(force=True)

    def on_queue_table_highlighted(self, message: QueueTable.Highlighted) -> None:
        if message.req is not None and message.req != self.selected:
            self.selected = message.req
            self.redraw()

    def on_queue_table_opened(self, message: QueueTable.Opened) -> None:
        self.selected = message.req
        self.push_screen(RequestDetailScreen(message.req))
        self.redraw(force=True)

    # -- actions --------------------------------------------------------------------
    def action_replay(self, name: str) -> None:
        method = getattr(self.sync, name, None)
        if method is None:
            self.notify(f"{name} is not available in compare", timeout=2)
            return
        method()
        self.pump()

    def action_seek_prompt(self, kind: str) -> None:
        def done(target) -> None:
            if seek_to(self.sync, target):
                self.pump()

        self.push_screen(SeekScreen(kind), done)

    def action_help(self) -> None:
        if not isinstance(self.screen, HelpScreen):
            self.push_screen(HelpScreen())

    def action_toggle_palette(self) -> None:
        self.pal = DEFAULT if self.pal is CB else CB
        self.redraw(force=True)


def make_compare_app(paths: list[str], *, align: str = ALIGN_TIME, speed: float = 1.0, playing: bool = True,
                     palette: str = "default", clock: Callable[[], float] = time.monotonic,
                     auto_tick: bool = True, notes: list[str] | None = None) -> CompareApp:
    """The compare app for 2-4 trace files; a damaged trace gets a column that says so."""
    runs = load_runs(paths, clock)
    if not any(r.ok for r in runs):
        raise CompareError("none of the traces can be read: " + "; ".join(f"{r.path}: {r.error}" for r in runs))
    return CompareApp(runs, align=align, speed=speed, playing=playing, palette=palette, clock=clock,
                      auto_tick=auto_tick, notes=notes)
