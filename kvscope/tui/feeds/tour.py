"""The tour's feed (`kvscope tour`): the events of the engine its driver runs, and the driver itself.

An EventFeed over the driver (anything with ``poll()``, ``connection``, ``close()`` and a ``status``):
the same fold loop and reducer as live and replay. Paused while the world is frozen, and a new
version at every change of the caption.
"""

from __future__ import annotations

from typing import Any

from kvscope.tui.feeds.base import EventFeed

PAUSED_PHASES = ("paused", "frozen", "over", "the end", "error")


class TourFeed(EventFeed):
    def __init__(self, driver: Any) -> None:
        super().__init__(driver, name="tour", address="kvscope tour")
        self.driver = driver  # kvscope.tui.screens.tour.TourControls

    @property
    def version(self) -> tuple:
        return (id(self.state), self.state.version, self.driver.status.serial)

    @property
    def paused(self) -> bool:
        return self.driver.status.phase in PAUSED_PHASES
