"""The app `kvscope tour` runs: the one KvscopeApp, its dashboard replaced by the tour's screen.

The feed is an EventFeed over the tour driver (anything with ``poll()``, ``connection``, ``close()``
and a ``status``): the same fold loop and reducer as live and replay.
"""

from __future__ import annotations

from typing import Any

from textual.screen import Screen

from kvscope.tui.app import KvscopeApp
from kvscope.tui.feeds.base import EventFeed
from kvscope.tui.screens.tour import LOOK_CLASS, TourScreen

PAUSED_PHASES = ("paused", "frozen", "over", "the end", "error")
# The engine runs on a thread of this process: a slower repaint leaves it more of the interpreter, so
# its step times (and the ITL the chapters measure) are the engine's, not the screen's.
TOUR_FPS = 10.0


class TourFeed(EventFeed):
    """The tour driver's events; paused while the world is frozen, and a new version at every caption."""

    def __init__(self, driver: Any) -> None:
        super().__init__(driver, name="tour", address="kvscope tour")
        self.driver = driver

    @property
    def version(self) -> tuple:
        return (id(self.state), self.state.version, self.driver.status.serial)

    @property
    def paused(self) -> bool:
        return self.driver.status.phase in PAUSED_PHASES


class TourApp(KvscopeApp):
    CSS = f"""
    .{LOOK_CLASS} {{
        outline: heavy $warning;
    }}
    """

    def __init__(self, driver: Any, *, palette: str = "default", auto_tick: bool = True) -> None:
        self.driver = driver
        super().__init__([TourFeed(driver)], palette=palette, auto_tick=auto_tick, fps=TOUR_FPS)
        self.title = "kvscope tour"

    @property
    def tour_screen(self) -> TourScreen:
        return next(s for s in self.screen_stack if isinstance(s, TourScreen))

    def on_mount(self) -> None:
        super().on_mount()
        self.driver.start()  # the engine starts once the screen is there to show it

    def get_default_screen(self) -> Screen:
        return TourScreen(self.feeds[0], self.driver)  # type: ignore[arg-type]
