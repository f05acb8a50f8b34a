"""The app `kvscope tour` runs: the one KvscopeApp on a TourFeed, opening on the tour's screen."""

from __future__ import annotations

from typing import Any

# The engine runs on a thread of this process: a slower repaint leaves it more of the interpreter, so
# its step times (and the ITL the chapters measure) are the engine's, not the screen's.
TOUR_FPS = 10.0


def tour_app(driver: Any, *, palette: str = "default", auto_tick: bool = True):
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds.tour import TourFeed

    return KvscopeApp([TourFeed(driver)], first="tour", palette=palette, auto_tick=auto_tick, fps=TOUR_FPS)
