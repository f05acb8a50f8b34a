"""SVG snapshot of the tour's screen: the dashboard, the caption panel, the widget to watch outlined.

A deterministic sim-backend stream stands in for the engine, and a fixed status for the driver.
Update with ``pytest tests/test_tour_snapshot.py --snapshot-update`` and look at the SVG.
"""

from __future__ import annotations

from fakes.sources import ListSource
from fakes.streams import sim_stream

from kvscope.tour.driver import FROZEN, TourStatus
from kvscope.tui.launch.tour import tour_app


class StillTour:
    """The driver's face with nothing behind it: events from a list, one frozen moment."""

    connection = "live"

    def __init__(self, events) -> None:
        self.source = ListSource(events, connection="live")
        self.status = TourStatus(
            4, 8, "A full pool preempts", 0, 2, "4a-recompute", "A full pool preempts",
            "Eight requests start in a pool of 24 blocks that cannot hold them all once they grow. When a running "
            "request needs a block and none is free, the newest is preempted. Watch the block map fill, then "
            "PREEMPTED.", "preempted", FROZEN,
            said="step 18: the pool is full (2 of 24 blocks free); #7, the newest, was preempted (↺).", serial=1)
        self.pressed: list[str] = []

    def poll(self):
        return self.source.poll()

    def start(self) -> None:
        pass

    def close(self) -> None:
        self.source.close()

    def next(self) -> None:
        self.pressed.append("next")

    def replay(self) -> None:
        self.pressed.append("replay")

    def toggle_pause(self) -> None:
        self.pressed.append("pause")


def test_tour_screen_120x36(snap_compare):
    tour = StillTour(sim_stream(300, seed=3, bursts=(100, 200), bye=False))
    assert snap_compare(tour_app(tour, auto_tick=False), terminal_size=(120, 36), press=["right", "left", "space"])
    assert tour.pressed == ["next", "replay", "pause"]  # the keys reach the driver, whatever has the focus
