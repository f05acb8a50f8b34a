"""Event sinks: where the engine hands its events (no zmq needed here)."""

from __future__ import annotations

from typing import Iterable, Protocol, runtime_checkable

__all__ = ["EventSink", "FanOut", "ListSink"]


@runtime_checkable
class EventSink(Protocol):
    """Anything the engine can hand events to.

    ``publish`` is called on the engine thread once per event and must return
    quickly; the event object must not be mutated by the caller afterwards (sinks
    may encode it later on another thread).
    """

    def publish(self, event) -> None: ...

    def close(self) -> None: ...


class FanOut:
    """Forwards every event to several sinks, in order.

    A sink that raises does not stop the others from getting the event; the first
    exception is re-raised after all sinks were called.
    """

    def __init__(self, sinks: Iterable[EventSink] = ()):
        self.sinks: list[EventSink] = [s for s in sinks if s is not None]

    def add(self, sink: EventSink) -> None:
        self.sinks.append(sink)

    def publish(self, event) -> None:
        err = None
        for s in self.sinks:
            try:
                s.publish(event)
            except Exception as e:
                if err is None:
                    err = e
        if err is not None:
            raise err

    def take_dropped(self) -> int:
        """Sum of ``take_dropped()`` over the sinks that count drops (the publisher)."""
        return sum(s.take_dropped() for s in self.sinks if hasattr(s, "take_dropped"))

    def close(self) -> None:
        err = None
        for s in self.sinks:
            try:
                s.close()
            except Exception as e:
                if err is None:
                    err = e
        if err is not None:
            raise err


class ListSink:
    """Keeps every event in a list: an in-process run whose events are read afterwards."""

    def __init__(self) -> None:
        self.events: list = []

    def publish(self, event) -> None:
        self.events.append(event)

    def close(self) -> None:
        pass
