"""A kvscope trace: a cursor (sources.ReplayController) the player moves, folded like live events.

A compare gives one ReplayFeed per run, each with its ``run`` (summary, labels); a run
that could not be read has no cursor, keeps its column and never changes.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvscope.tui.feeds.base import EventFeed
from kvscope.tui.model.state import CONN_REPLAY

if TYPE_CHECKING:
    from kvscope.tui.sources.runs import Run
    from kvscope.tui.sources.replay import ReplayController


class ReplayFeed(EventFeed):
    def __init__(self, cursor: "ReplayController | None", *, name: str = "", run: "Run | None" = None,
                 **kw) -> None:
        self.run = run
        super().__init__(cursor, name=name, **kw)

    @property
    def cursor(self) -> "ReplayController | None":
        return self.source

    def _connection(self) -> str:
        return CONN_REPLAY

    def _poll(self) -> list:
        return self.source.poll() if self.source is not None else []

    def close(self) -> None:
        if self.source is not None:
            self.source.close()
