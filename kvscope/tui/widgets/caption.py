"""The tour's caption panel: the chapter, what is about to happen and where to look, what the cue found."""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.widget import Widget

from kvscope.tui.palette import DEFAULT, Palette

# phase -> (mark, what the keys do now)
PHASES = {
    "loading": ("⧗", "starting the engine"),
    "running": ("▶", "running to the moment · space pause · → skip · ← replay"),
    "paused": ("❚❚", "paused · space resume · → skip · ← replay"),
    "frozen": ("■", "frozen here · → next · ← replay · space play on"),
    "playing on": ("▶", "playing on past the moment · → next · ← replay"),
    "over": ("■", "this run is over · → next · ← replay"),
    "the end": ("■", "← last chapter again · q quit"),
    "error": ("✗", "q quit"),
}


class CaptionPanel(Widget):
    """Renders a tour status (kvscope.tour.driver.TourStatus: read by attribute, never imported here)."""

    DEFAULT_CSS = """
    CaptionPanel {
        height: auto;
        max-height: 10;
        padding: 0 1;
        background: $panel;
        border-top: heavy $warning;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.status: Any = None
        self.pal: Palette = DEFAULT

    def show(self, status: Any, pal: Palette) -> None:
        self.status = status
        self.pal = pal
        self.refresh(layout=True)

    @property
    def text(self) -> str:
        """What the panel says, as plain text (tests read it)."""
        return self.render().plain

    def render(self) -> Text:
        st = self.status
        if st is None:
            return Text("")
        pal = self.pal
        mark, keys = PHASES.get(st.phase, ("", ""))
        t = Text()
        t.append(f" Chapter {st.chapter}/{st.chapters} ", style="bold reverse")
        t.append(f" {st.chapter_title}", style="bold")
        if st.scenes > 1:
            t.append(f" · part {st.scene + 1} of {st.scenes}", style=pal.dim)
        if st.title and st.title != st.chapter_title:
            t.append(f" · {st.title}")
        t.append("\n")
        t.append(st.caption)
        t.append("\n")
        if st.said:
            style = f"bold {pal.warn}" if st.missed or st.phase == "error" else f"bold {pal.ok}"
            t.append(f"{mark} {st.said}", style=style)
            t.append("\n")
        t.append(keys, style=pal.dim)
        return t
