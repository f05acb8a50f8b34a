"""The live source: a ZeroMQ subscriber read on a background thread, plus the control channel
(requests run on another thread, so the UI never waits on the engine). Anything with
``poll() -> list[Event]`` and ``connection`` is a source to the app. No textual, torch or engine.
"""

from __future__ import annotations

import collections
import threading
import time
from typing import Any, Callable

from kvscope.tui.model.state import CONN_CONNECTING, CONN_DISCONNECTED, CONN_LIVE


# The live view's memory is bounded in bytes: decoded events waiting for the UI (counted
# by encoded size; decoded they take a few times that) and raw frames waiting for the decoder.
MAX_BACKLOG_BYTES = 16 << 20
MAX_RAW_BYTES = 32 << 20
RAW_PER_ROUND = 10_000  # frames taken from zmq between two decodes


# ------------------------------------------------------------------------------- live
class LiveSource:
    """Subscribes to an engine's events and talks to its control socket.

    A receiver thread takes every frame zmq holds (cheap: no decoding), keeps at most
    ``max_raw_bytes`` of them, then decodes the oldest one, and goes round again, so
    zmq's own queue stays short however fast frames come. Decoded events wait in a
    backlog of at most ``max_backlog_bytes`` (counted by their encoded size) and
    ``max_backlog`` events; ``poll`` (called by the UI timer) drains it. Whenever a
    cap is reached the OLDEST frames or events are dropped and counted in
    ``take_local_dropped`` (the state is then stale until the next snapshot). Frames
    the decoder refuses are counted in ``take_malformed``. A control thread runs
    requests from a queue; their replies come back through ``take_replies``.

    ``connection``: "live" while events arrive (or the control channel answers, for
    an idle or paused engine), "disconnected" after ``silence_s`` without either,
    "connecting" before anything was heard. After silence the control thread asks
    for a snapshot every ``silence_s``; when events come back a snapshot is asked
    for at once, so a restarted engine resyncs.
    """

    def __init__(
        self,
        events_addr: str,
        control_addr: str | None,
        *,
        silence_s: float = 2.0,
        max_backlog: int = 200_000,
        max_backlog_bytes: int = MAX_BACKLOG_BYTES,
        max_raw_bytes: int = MAX_RAW_BYTES,
        subscriber_factory: Callable[[str], Any] | None = None,
        control_factory: Callable[[str], Any] | None = None,
        clock: Callable[[], float] = time.monotonic,
        start: bool = True,
    ) -> None:
        self.events_addr = events_addr
        self.control_addr = control_addr
        self.silence_s = silence_s
        self.max_backlog = max_backlog
        self.max_backlog_bytes = max_backlog_bytes
        self.max_raw_bytes = max_raw_bytes
        self._clock = clock
        self._subscriber_factory = subscriber_factory
        self._control_factory = control_factory
        self._lock = threading.Lock()
        self._backlog: collections.deque = collections.deque()  # (event, encoded size)
        self._backlog_bytes = 0
        self._local_dropped = 0
        self._malformed = 0
        self.last_error: str | None = None  # the decoder's last refusal
        self._replies: collections.deque = collections.deque(maxlen=64)
        self._requests: collections.deque = collections.deque(maxlen=64)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._last_event: float | None = None
        self._last_ctl_ok: float | None = None
        self._last_probe = 0.0
        self._last_snapshot_req = -1e9
        self._was_silent = True
        self.received = 0
        self.error: str | None = None  # set when the subscriber cannot be created
        self.paused: bool | None = None
        self._threads: list[threading.Thread] = []
        if start:
            self.start()

    # -- threads --------------------------------------------------------------------
    def start(self) -> None:
        if self._threads:
            return
        rx = threading.Thread(target=self._recv_loop, name="kvscope-tui-recv", daemon=True)
        rx.start()
        self._threads.append(rx)
        if self.control_addr:
            tx = threading.Thread(target=self._control_loop, name="kvscope-tui-control", daemon=True)
            tx.start()
            self._threads.append(tx)

    def _make_subscriber(self):
        if self._subscriber_factory is not None:
            return self._subscriber_factory(self.events_addr)
        from kvscope.protocol.pubsub import Subscriber

        return Subscriber(self.events_addr)

    def _make_control(self):
        if self._control_factory is not None:
            return self._control_factory(self.control_addr)
        from kvscope.protocol.control import ControlClient

        return ControlClient(self.control_addr, timeout_ms=1000)

    def _recv_loop(self) -> None:
        try:
            sub = self._make_subscriber()
        except Exception as e:  # no zmq, or a malformed address
            self.error = f"cannot subscribe to {self.events_addr}: {e}"
            return
        raw: collections.deque = collections.deque()
        raw_bytes = 0
        try:
            while not self._stop.is_set():
                # 1. everything zmq holds now (bounded per round), oldest dropped past the cap
                wait = 0 if raw else 100
                for _ in range(RAW_PER_ROUND):
                    try:
                        data = sub.recv_frame(wait)
                    except Exception:  # a closed socket at shutdown, or a transport bug
                        data = None
                        if not self._stop.is_set():
                            time.sleep(0.05)
                    if data is None:
                        break
                    wait = 0
                    raw.append(data)
                    raw_bytes += len(data)
                    while raw_bytes > self.max_raw_bytes and len(raw) > 1:
                        raw_bytes -= len(raw.popleft())
                        with self._lock:
                            self._local_dropped += 1
                if not raw:
                    continue
                # 2. decode the oldest frame
                data = raw.popleft()
                raw_bytes -= len(data)
                ev = sub.decode_frame(data)
                if ev is None:
                    self._malformed += 1
                    self.last_error = sub.last_error
                    continue
                self._arrived(ev, len(data))
        finally:
            try:
                sub.close()
            except Exception:
                pass

    def _arrived(self, ev, size: int) -> None:
        self.received += 1
        now = self._clock()
        if self._was_silent:
            self._was_silent = False
            self.request_snapshot(now)
        self._last_event = now
        with self._lock:
            backlog = self._backlog
            backlog.append((ev, size))
            self._backlog_bytes += size
            while len(backlog) > 1 and (len(backlog) > self.max_backlog or self._backlog_bytes > self.max_backlog_bytes):
                _, n = backlog.popleft()
                self._backlog_bytes -= n
                self._local_dropped += 1

    def _control_loop(self) -> None:
        ctl = None
        try:
            while not self._stop.is_set():
                self._wake.wait(0.25)
                self._wake.clear()
                if self._stop.is_set():
                    break
                now = self._clock()
                if self._silent(now) and now - self._last_probe >= self.silence_s:
                    self._last_probe = now
                    self._was_silent = True
                    self._requests.append(("snapshot", {}, True))
                while self._requests and not self._stop.is_set():
                    cmd, args, quiet = self._requests.popleft()
                    if ctl is None:
                        try:
                            ctl = self._make_control()
                        except Exception as e:  # no zmq, bad address
                            self._replies.append((cmd, {"ok": False, "error": str(e)}, quiet))
                            continue
                    try:
                        reply = ctl.request(cmd, **args)
                    except Exception as e:
                        reply = {"ok": False, "error": str(e)}
                    if not isinstance(reply, dict):
                        reply = {"ok": False, "error": f"bad reply {reply!r}"}
                    if reply.get("ok"):
                        self._last_ctl_ok = self._clock()
                        if "paused" in reply:
                            self.paused = bool(reply["paused"])
                    self._replies.append((cmd, reply, quiet))
        finally:
            if ctl is not None:
                try:
                    ctl.close()
                except Exception:
                    pass

    def _silent(self, now: float) -> bool:
        return self._last_event is None or now - self._last_event > self.silence_s

    # -- the app side ---------------------------------------------------------------
    def poll(self, limit: int = 50_000) -> list:
        with self._lock:
            backlog = self._backlog
            out = [backlog.popleft() for _ in range(min(len(backlog), limit))]
            self._backlog_bytes -= sum(n for _, n in out)
        return [ev for ev, _ in out]

    def take_local_dropped(self) -> int:
        with self._lock:
            n, self._local_dropped = self._local_dropped, 0
        return n

    def take_malformed(self) -> tuple[int, str | None]:
        """(frames the decoder refused since the last call, the last refusal's message)."""
        n, self._malformed = self._malformed, 0
        return n, self.last_error

    def take_replies(self) -> list[tuple[str, dict, bool]]:
        out = []
        while self._replies:
            out.append(self._replies.popleft())
        return out

    @property
    def connection(self) -> str:
        if self.error:
            return CONN_DISCONNECTED
        now = self._clock()
        if self._last_event is not None and now - self._last_event <= self.silence_s:
            return CONN_LIVE
        if self._last_ctl_ok is not None and now - self._last_ctl_ok <= self.silence_s + 1.0:
            return CONN_LIVE  # idle or paused, but answering
        if self._last_event is None and self._last_ctl_ok is None:
            return CONN_CONNECTING
        return CONN_DISCONNECTED

    def request(self, cmd: str, quiet: bool = False, **args) -> None:
        """Queue a control request; its reply shows up in ``take_replies``."""
        if not self.control_addr:
            self._replies.append((cmd, {"ok": False, "error": "no control address"}, quiet))
            return
        self._requests.append((cmd, args, quiet))
        self._wake.set()

    def request_snapshot(self, now: float | None = None) -> bool:
        """Ask for a snapshot unless one was asked for in the last second."""
        now = self._clock() if now is None else now
        if now - self._last_snapshot_req < 1.0:
            return False
        self._last_snapshot_req = now
        self.request("snapshot", quiet=True)
        return True

    def close(self) -> None:
        self._stop.set()
        self._wake.set()
        for t in self._threads:
            t.join(timeout=2.0)
        self._threads = []


# ----------------------------------------------------------------------------- replay


__all__ = ["LiveSource"]
