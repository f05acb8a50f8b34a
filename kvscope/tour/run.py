"""`kvscope tour`: the driver and the dashboard together; the engine stops when the app does."""

from __future__ import annotations

from kvscope.tour.chapters import CHAPTERS
from kvscope.tour.driver import TourDriver, TourOptions


def make_tour_app(options: TourOptions, *, chapter: int = 1, palette: str = "default", auto_tick: bool = True):
    """The app and its driver; the driver starts when the app mounts (tests drive it with Pilot)."""
    from kvscope.tui.launch.tour import tour_app

    driver = TourDriver(CHAPTERS, options, start_chapter=chapter)
    return tour_app(driver, palette=palette, auto_tick=auto_tick), driver


def run_tour(options: TourOptions, *, chapter: int = 1, palette: str = "default") -> str | None:
    """Run the tour in the terminal. Returns the driver's error line, if the engine failed."""
    app, driver = make_tour_app(options, chapter=chapter, palette=palette)
    try:
        app.run()
    finally:
        driver.close()
    return driver.error
