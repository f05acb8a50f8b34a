"""Test doubles for the TUI's sources: a fixed list of events, and a trace held in memory.

The product reads live events (``LiveSource``) and trace files (``TraceReader`` through
``ReplayController``); these stand in for them where a test feeds events it made.
"""

from __future__ import annotations

from typing import Iterable

from kvscope.protocol.events import HelloEvent, SnapshotEvent, StepEvent
from kvscope.tui.model.state import CONN_REPLAY


class ListSource:
    """Hands out a list of events, ``batch`` per poll (all at once by default)."""

    def __init__(self, events: Iterable, *, connection: str = CONN_REPLAY, batch: int | None = None) -> None:
        self.events = list(events)
        self.pos = 0
        self.batch = batch
        self.connection = connection

    def poll(self) -> list:
        end = len(self.events) if self.batch is None else min(len(self.events), self.pos + self.batch)
        out = self.events[self.pos:end]
        self.pos = end
        return out

    def feed(self, events: Iterable) -> None:
        self.events.extend(events)

    def close(self) -> None:
        pass


class MemoryTrace:
    """An in-memory trace with the reader's interface: ``hello``, iteration, ``seek``."""

    def __init__(self, events: Iterable) -> None:
        evs = list(events)
        if not evs or not isinstance(evs[0], HelloEvent):
            raise ValueError("a trace starts with a hello event")
        self.hello = evs[0]
        self.events = evs[1:]
        self.warnings: list[str] = []

    def __iter__(self):
        yield self.hello
        yield from self.events

    def seek(self, step: int) -> list:
        end = -1
        for k, ev in enumerate(self.events):
            if type(ev) is StepEvent:
                if ev.step <= step:
                    end = k
                else:
                    break
        start = 0
        for k in range(end, -1, -1):
            ev = self.events[k]
            if type(ev) is SnapshotEvent and ev.step <= step:
                start = k
                break
        if end < 0:
            for k, ev in enumerate(self.events):
                if type(ev) is SnapshotEvent:
                    return [ev]
            return []
        return self.events[start:end + 1]
