"""`kvscope tui --connect A --connect B ... [--vllm URL ...]`: many engines, one row each.

One timer (4 Hz) pumps every feed and redraws the table, or the engine screen on top.
It stays responsive with 16 engines: each pump only drains what arrived, and the
table is rebuilt from 16 small typed rows.
"""

from __future__ import annotations

import time

from textual.app import App
from textual.binding import Binding
from textual.screen import Screen

from kvscope.tui.palette import get_palette
from kvscope.tui.screens.overview import EngineDashboard, OverviewScreen
from kvscope.tui.widgets import QueueTable

TICK_S = 0.25


class OverviewApp(App):
    CSS_PATH = "styles/app.tcss"
    TITLE = "kvscope · engines"
    BINDINGS = [Binding("q", "quit", "Quit")]

    def __init__(self, feeds: list, *, palette: str = "default", auto_tick: bool = True) -> None:
        super().__init__()
        names = [f.name for f in feeds]
        if len(set(names)) != len(names):
            raise ValueError("engine names must be unique")
        self.feeds = {f.name: f for f in feeds}
        self.pal = get_palette(palette)
        self.auto_tick = auto_tick
        self.selected: int | None = None
        self.engine_paused = False

    def get_default_screen(self) -> Screen:
        return OverviewScreen()

    def on_mount(self) -> None:
        self.pump()
        if self.auto_tick:
            self.set_interval(TICK_S, self.pump, name="kvscope-overview")

    def pump(self) -> None:
        now = time.monotonic()
        for feed in self.feeds.values():
            feed.pump(now)
        self.refresh_overview()

    def refresh_overview(self) -> None:
        screen = self.screen
        if isinstance(screen, OverviewScreen):
            screen.show_rows([f.row() for f in self.feeds.values()], self.pal)
        elif isinstance(screen, EngineDashboard):
            screen.show_feed(self.feeds[screen.engine_name], self.pal, self.selected)
        pump = getattr(screen, "pump", None)  # the vLLM screen draws itself from its source
        if pump is not None and not isinstance(screen, OverviewScreen):
            pump()

    def open_engine(self, name: str | None) -> None:
        feed = self.feeds.get(name) if name else None
        if feed is None:
            return
        if feed.kind == "vllm":
            from kvscope.tui.vllm_app import VllmScreen

            self.push_screen(VllmScreen(feed.source, auto_tick=False))
        else:
            self.push_screen(EngineDashboard(name))
        self.call_after_refresh(self.refresh_overview)

    def _current_feed(self):
        screen = self.screen
        return self.feeds.get(getattr(screen, "engine_name", None))

    # the live dashboard's keys talk to the engine on screen
    def action_control(self, cmd: str) -> None:
        feed = self._current_feed()
        request = getattr(getattr(feed, "source", None), "request", None)
        if request is None:
            self.notify("control needs a live engine with a control address", severity="warning", timeout=2)
            return
        request(cmd)

    def action_toggle_engine(self) -> None:
        self.action_control("resume" if self.engine_paused else "pause")

    def on_queue_table_highlighted(self, message: QueueTable.Highlighted) -> None:
        self.selected = message.req

    def on_queue_table_opened(self, message: QueueTable.Opened) -> None:
        self.notify("request detail: open this engine alone with kvscope tui --connect", timeout=3)

    def on_unmount(self) -> None:
        for feed in self.feeds.values():
            feed.close()


def run_overview(kvscope: list[tuple[str, str | None]], vllm: list[tuple[str, str | None, str | None]], *,
                 interval: float = 1.0, palette: str = "default") -> None:
    """kvscope: (events addr, control addr or None); vllm: (url, kv events addr, kv replay addr)."""
    from kvscope.adapters.vllm_source import VllmSource
    from kvscope.tui.engines import KvscopeFeed, VllmFeed
    from kvscope.tui.sources import LiveSource

    feeds: list = []
    for addr, control in kvscope:
        feeds.append(KvscopeFeed(addr, LiveSource(addr, control)))
    for url, kv, replay in vllm:
        feeds.append(VllmFeed(url, VllmSource(url, kv, replay, interval=interval).start()))
    OverviewApp(feeds, palette=palette).run()
