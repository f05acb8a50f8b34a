"""A live kvscope engine: its events over ZeroMQ (sources.LiveSource) and its control channel.

Health by construction: every pump counts the frames this view dropped or could not
decode, takes the control replies (so the paused flag follows the engine), and asks for
a snapshot while the picture is stale. The dashboard, the overview's rows and an engine
opened from the overview all get this, because they all watch a LiveFeed.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

from kvscope.tui.feeds.base import EngineControls, EventFeed, Notice
from kvscope.tui.model.state import CONN_LIVE, note_local_drop, note_malformed


@runtime_checkable
class LiveSourceLike(Protocol):
    """sources.LiveSource's face (tests give fakes of it, or wrap it)."""

    connection: str
    error: str | None

    def poll(self) -> list: ...

    def take_local_dropped(self) -> int: ...

    def take_malformed(self) -> tuple[int, str | None]: ...

    def take_replies(self) -> list[tuple[str, dict, bool]]: ...

    def request(self, cmd: str, quiet: bool = False, **args) -> None: ...

    def request_snapshot(self) -> bool: ...

    def close(self) -> None: ...


class EngineStarting(Protocol):
    """An engine this view started and is waiting for (`kvscope demo`): a progress line until its first
    step, and its one-line error if it exits first."""

    def line(self) -> str: ...

    def error(self) -> str | None: ...


class LiveFeed(EventFeed):
    def __init__(self, source: LiveSourceLike, *, name: str = "", address: str = "",
                 starting: EngineStarting | None = None, **kw) -> None:
        super().__init__(source, name=name or address, address=address, **kw)
        self._paused = False
        self._error_shown: str | None = None
        self.starting = starting
        self.loading: str | None = starting.line() if starting is not None else None  # the header's progress line
        self.fatal: str | None = None  # the engine we started died before its first step: the App exits

    @property
    def version(self) -> tuple:
        return (id(self.state), self.state.version, self._paused, self.loading, self.fatal)

    @property
    def controls(self) -> EngineControls:
        return self

    @property
    def paused(self) -> bool:
        """The engine's own answer to the last pause/resume (its control replies carry it)."""
        return self._paused

    def request(self, cmd: str) -> None:
        self.source.request(cmd)

    def request_snapshot(self) -> bool:
        return self.source.request_snapshot()

    def toggle_pause(self) -> None:
        self.request("resume" if self._paused else "pause")

    def _after_fold(self, st) -> None:
        src = self.source
        note_local_drop(st, src.take_local_dropped())
        n, last = src.take_malformed()
        note_malformed(st, n, last)
        for cmd, reply, quiet in src.take_replies():
            self._on_reply(cmd, reply, quiet)
        if src.error and src.error != self._error_shown:
            self._error_shown = src.error
            self._notices.append(Notice(src.error, "error", 15))
        if st.stale and self._connection() == CONN_LIVE:
            src.request_snapshot()
        if self.starting is not None:
            self._follow_start(st)

    def _follow_start(self, st) -> None:
        if st.steps_seen:  # the engine is serving: the progress line has done its job
            self.starting = self.loading = None
            return
        err = self.starting.error()
        if err is not None:
            self.fatal, self.starting, self.loading = err, None, None
            self._notices.append(Notice(err, "error", 15))
        else:
            self.loading = self.starting.line()

    def _on_reply(self, cmd: str, reply: dict, quiet: bool) -> None:
        if "paused" in reply:
            self._paused = bool(reply["paused"])
        if quiet:
            return
        if reply.get("ok"):
            extra = ", ".join(f"{k} {v}" for k, v in reply.items() if k not in ("ok", "config"))
            self._notices.append(Notice(f"{cmd}: ok{' (' + extra + ')' if extra else ''}", timeout=1.5, key="control"))
        else:
            self._notices.append(Notice(f"{cmd}: {reply.get('error', 'failed')}", "warning", 3, key="control"))
