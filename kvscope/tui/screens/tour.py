"""The tour's screen: the dashboard, a caption panel under it, the widget to look at outlined.

It drives the tour through a small protocol (``TourControls``: status, next, replay, toggle_pause);
the driver behind it (kvscope.tour.driver) runs the engine, which this module never imports.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Iterable, Protocol

from textual.app import ComposeResult
from textual.binding import Binding

from kvscope.tui.screens.base import Command
from kvscope.tui.screens.dashboard import DashboardScreen
from kvscope.tui.widgets.caption import CaptionPanel

if TYPE_CHECKING:
    from kvscope.tui.feeds import EventFeed
    from kvscope.tui.palette import Palette

LOOK_CLASS = "tour-look"


class TourControls(Protocol):
    @property
    def status(self) -> Any: ...  # kvscope.tour.driver.TourStatus

    def start(self) -> None: ...

    def next(self) -> None: ...

    def replay(self) -> None: ...

    def toggle_pause(self) -> None: ...


class TourScreen(DashboardScreen):
    DEFAULT_CSS = f"""
    TourScreen .{LOOK_CLASS} {{
        outline: heavy $warning;
    }}
    """
    BINDINGS = [
        Binding("right", "tour_next", "Next", priority=True),
        Binding("left", "tour_replay", "Replay chapter", priority=True),
        Binding("space", "tour_pause", "Pause", priority=True),
    ]

    def __init__(self, feed: "EventFeed", tour: TourControls) -> None:
        super().__init__(feed)
        self.tour = tour
        self._shown_serial = -1
        self._look = ""

    @property
    def shown_serial(self) -> int:
        """The serial of the tour status the caption panel shows now."""
        return self._shown_serial

    def compose_extra(self) -> ComposeResult:
        yield CaptionPanel(id="caption")

    def on_mount(self) -> None:
        super().on_mount()
        self.tour.start()  # the engine starts once the screen is there to show it

    def draw_key(self) -> tuple:
        return (self.selected, self.tour.status.serial)

    def draw(self, pal: "Palette") -> None:
        status = self.tour.status
        panels = self.query(CaptionPanel)
        if not panels:  # not composed yet (the App's first pump comes before the screen's widgets)
            return
        if status.serial != self._shown_serial:
            self._shown_serial = status.serial
            if status.select is not None:
                self.selected = status.select  # the request the moment is about, lit in the block map
            self._outline(status.look)
        super().draw(pal)
        for panel in panels:
            panel.show(status, pal)

    def _outline(self, look: str) -> None:
        if look == self._look:
            return
        for w in self.query(f".{LOOK_CLASS}"):
            w.remove_class(LOOK_CLASS)
        self._look = look
        if look:
            for w in self.query(f"#{look}"):
                w.add_class(LOOK_CLASS)

    def action_tour_next(self) -> None:
        self.tour.next()

    def action_tour_replay(self) -> None:
        self.tour.replay()

    def action_tour_pause(self) -> None:
        self.tour.toggle_pause()

    def commands(self) -> Iterable[Command]:
        yield from super().commands()
        yield ("Next", "Go on to the next moment of the tour", self.action_tour_next)
        yield ("Replay chapter", "Play this chapter again from its start", self.action_tour_replay)
        yield ("Pause / resume", "Stop or restart the engine and its arrivals", self.action_tour_pause)
