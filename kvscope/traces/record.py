"""Record a live engine's event stream into a trace file (`kvscope record`)."""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from .writer import TraceWriter

__all__ = ["record"]


def record(
    connect_addr: str,
    path: str | os.PathLike,
    *,
    control_addr: str | None = None,
    stop_after_s: float | None = None,
    on_event: Callable | None = None,
    stop: threading.Event | None = None,
    chunk_steps: int = 256,
    ask_every_s: float = 2.0,
) -> int:
    """Subscribe to ``connect_addr`` and write what arrives to ``path``.

    Waits for the engine's hello (the file is created then; nothing is written if
    none arrives). A trace must start from a snapshot: with ``control_addr`` the
    recorder asks the engine for one (``snapshot`` command; the engine answers by
    publishing a snapshot and a hello, in either order) when it joins late, and
    again whenever the open chunk is full. Without it, it waits for the engine's
    periodic snapshots (which the engine also follows with a hello).

    Stops on the engine's bye, a hello from a different engine run,
    ``stop_after_s`` seconds, ``stop.set()`` or KeyboardInterrupt; the trace is
    always closed properly (index written). Returns the number of events recorded.
    """
    from ..protocol.transport import ControlClient, Subscriber

    sub = Subscriber(connect_addr)
    client = ControlClient(control_addr, timeout_ms=1000) if control_addr else None
    writer: TraceWriter | None = None
    early: list = []  # a snapshot (and what followed it) seen before the hello
    t0 = time.monotonic()
    last_ask = t0  # give the subscription a moment before asking
    try:
        while True:
            now = time.monotonic()
            if stop is not None and stop.is_set():
                break
            if stop_after_s is not None and now - t0 >= stop_after_s:
                break
            if client is not None and (writer is None or writer.wants_snapshot) and now - last_ask >= (
                0.3 if last_ask == t0 else ask_every_s
            ):
                client.request("snapshot")
                last_ask = time.monotonic()
            ev = sub.recv(50)
            if ev is None or ev.type == "heartbeat":  # liveness only: never part of a trace (docs/PROTOCOL.md)
                continue
            if ev.type == "hello":
                if writer is None:
                    writer = TraceWriter(path, ev, chunk_steps=chunk_steps, max_chunk_s=None)
                    for e in early:  # the engine may send its snapshot just before hello
                        writer.publish(e)
                        if on_event is not None:
                            on_event(e)
                    early = []
                elif ev != writer.hello:
                    break  # a new engine run: this trace ends here
                continue  # a repeated hello goes with a snapshot
            if writer is None:
                if ev.type == "snapshot":
                    early = [ev]
                elif early:
                    early = early + [ev] if len(early) < 100_000 else []
                continue
            writer.publish(ev)
            if on_event is not None:
                on_event(ev)
            if ev.type == "bye":
                break
    finally:
        sub.close()
        if client is not None:
            client.close()
        if writer is not None:
            writer.close()
    return writer.events if writer is not None else 0
