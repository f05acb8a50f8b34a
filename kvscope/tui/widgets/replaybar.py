"""The player's bar: play state, speed, position in the trace."""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.text import Text

from kvscope.tui import fmt
from kvscope.tui.widgets.base import StateWidget

if TYPE_CHECKING:
    from kvscope.tui.model.player import Player


class ReplayBar(StateWidget):
    """One line: ▶/⏸ speed, step of total, trace time, a position bar."""

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.replay: Player | None = None

    def render(self) -> Text:
        pal = self.pal
        rp = self.replay
        width = max(10, self.size.width)
        t = Text(no_wrap=True, overflow="ellipsis")
        if rp is None:
            return t
        info = rp.status()
        if info.done:
            t.append(" ■ end ", style=f"bold {pal.warn}")
        elif info.playing:
            t.append(" ▶ play ", style=f"bold {pal.ok}")
        else:
            t.append(" ⏸ pause ", style=f"bold {pal.warn}")
        t.append(f"x{info.speed:g} ", style="bold")
        t.append(f"step {info.step}/{info.last_step} ")
        t.append(f"t {fmt.dur(info.t)}/{fmt.dur(info.end_t)} ", style=pal.dim)
        if info.indexing:  # the end is the trace's own word until the step index gets there
            t.append("indexing… ", style=pal.dim)
        room = width - len(t) - 2
        if room >= 6:
            span = max(1e-9, info.end_t - info.start_t)
            frac = min(1.0, max(0.0, (info.t - info.start_t) / span))
            pos = min(room - 1, int(frac * room))
            t.append("━" * pos, style=pal.bar)
            t.append("●", style=f"bold {pal.bar}")
            t.append("─" * (room - pos - 1), style=pal.dim)
        t.truncate(width, overflow="ellipsis")
        return t
