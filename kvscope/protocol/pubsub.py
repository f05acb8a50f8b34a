"""ZeroMQ pub/sub for events, and the address rules both channels share.

pyzmq is imported lazily (on first socket), so this module can be imported, and
``check_bind_address`` used, without it.

- ``ZmqPublisher``: PUB socket fed by a background thread through a bounded queue.
  ``publish`` never blocks; events lost to a full queue or a subscriber at its
  high-water mark are counted and handed back by ``take_dropped``.
- ``Subscriber``: SUB socket; ``recv(timeout_ms)`` returns a decoded event or None,
  ``recv_frame`` the raw bytes (so a reader can drop before paying for decoding).
"""

from __future__ import annotations

import ipaddress
import queue
import threading
import time
from .codec import MAX_EVENT_BYTES, ProtocolError, UnknownEventType, decode, encode
from .events import HeartbeatEvent

__all__ = [
    "DEFAULT_EVENTS_ADDR",
    "DEFAULT_CONTROL_ADDR",
    "check_bind_address",
    "ZmqPublisher",
    "Subscriber",
]

DEFAULT_EVENTS_ADDR = "tcp://127.0.0.1:5557"
DEFAULT_CONTROL_ADDR = "tcp://127.0.0.1:5558"

_zmq_mod = None


def zmq_module():
    """pyzmq, imported on first use."""
    global _zmq_mod
    if _zmq_mod is None:
        import zmq

        _zmq_mod = zmq
    return _zmq_mod


def _context():
    return zmq_module().Context.instance()


# --------------------------------------------------------------------------- addresses


def check_bind_address(addr: str, allow_remote: bool = False) -> None:
    """Refuse to bind anything but loopback unless ``allow_remote``.

    Accepts ``ipc://`` and ``inproc://`` always, ``tcp://HOST:PORT`` when HOST is
    127.0.0.0/8, ``::1`` or ``localhost`` (PORT may be ``*`` or 0 for any free
    port). Raises ValueError with a one-line message otherwise.
    """
    if not isinstance(addr, str) or "://" not in addr:
        raise ValueError(f"bad address {addr!r}: expected tcp://HOST:PORT or ipc://PATH")
    scheme, rest = addr.split("://", 1)
    if scheme in ("ipc", "inproc"):
        if not rest:
            raise ValueError(f"bad address {addr!r}: empty {scheme} path")
        return
    if scheme != "tcp":
        raise ValueError(f"unsupported transport in {addr!r}: use tcp:// or ipc://")
    host, sep, port = rest.rpartition(":")
    if not sep or not host:
        raise ValueError(f"bad address {addr!r}: expected tcp://HOST:PORT")
    if port != "*":
        if not port.isdigit() or int(port) > 65535:
            raise ValueError(f"bad port in {addr!r}")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if _is_loopback(host):
        return
    if not allow_remote:
        raise ValueError(
            f"refusing to bind {addr}: not a loopback address (use 127.0.0.1, or pass --allow-remote)"
        )


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False  # interface names, hostnames, "*"


def bind(sock, addr: str) -> str:
    """Bind; a port of 0 means 'any free port'. Returns the bound endpoint."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        addr = addr[:-2] + ":*"
    sock.bind(addr)
    ep = sock.getsockopt(zmq_module().LAST_ENDPOINT)
    return ep.decode() if isinstance(ep, bytes) else str(ep)


# --------------------------------------------------------------------------- publisher


class ZmqPublisher:
    """Publishes events on a PUB socket without ever blocking the caller.

    ``publish`` puts the event object on a bounded queue (``queue_size``); a
    background thread encodes it and sends it with NOBLOCK. With ``count_drops``
    (the default) the socket reports the high-water mark (ZMQ_XPUB_NODROP), so a
    subscriber that stops reading makes sends fail with EAGAIN and every lost event
    is counted - the message is then lost for all subscribers alike. With
    ``count_drops=False`` zmq silently drops per subscriber instead.
    """

    def __init__(
        self,
        addr: str = DEFAULT_EVENTS_ADDR,
        *,
        hwm: int = 10000,
        queue_size: int = 4096,
        allow_remote: bool = False,
        count_drops: bool = True,
        heartbeat_s: float | None = None,
        notice_joins: bool = False,
    ):
        check_bind_address(addr, allow_remote)
        zmq = zmq_module()
        # notice_joins: an XPUB socket, which hands the publisher each subscription (XPUB_VERBOSE: every one,
        # not only a topic's first), counted in `joins`, so the engine can send a newcomer a snapshot
        self._sock = _context().socket(zmq.XPUB if notice_joins else zmq.PUB)
        if notice_joins:
            self._sock.setsockopt(zmq.XPUB_VERBOSE, 1)
        self._notice_joins = notice_joins
        self.joins = 0  # subscriptions seen (the publisher's thread writes it)
        self._sock.setsockopt(zmq.SNDHWM, max(1, int(hwm)))
        self._sock.setsockopt(zmq.LINGER, 0)
        if count_drops:
            self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        try:
            self.addr = bind(self._sock, addr)
        except Exception:
            self._sock.close(0)
            raise
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, int(queue_size)))
        self._lock = threading.Lock()
        self._dropped = 0
        self.sent = 0
        self.encode_errors = 0
        self._closing = threading.Event()
        self._deadline = 0.0
        self._closed = False
        # with nothing to send for heartbeat_s, a heartbeat: an idle engine still looks alive to watchers
        self.heartbeat_s = heartbeat_s
        self._thread = threading.Thread(target=self._run, name="kvscope-publisher", daemon=True)
        self._thread.start()

    @property
    def queue_size(self) -> int:
        return self._queue.maxsize

    def publish(self, event) -> None:
        """Queue one event; never blocks. A full queue counts the event as dropped."""
        if self._closed:
            self._add_dropped(1)
            return
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self._add_dropped(1)

    def take_dropped(self) -> int:
        """Events lost since the previous call (resets the count)."""
        with self._lock:
            n, self._dropped = self._dropped, 0
        return n

    @property
    def dropped(self) -> int:
        """Events lost since the last ``take_dropped`` (does not reset)."""
        return self._dropped

    def _add_dropped(self, n: int) -> None:
        with self._lock:
            self._dropped += n

    def _run(self) -> None:
        zmq = zmq_module()
        sock = self._sock
        q = self._queue
        last_send = time.monotonic()
        while True:
            if self._closing.is_set() and (q.empty() or time.monotonic() > self._deadline):
                break
            if self._notice_joins:
                self._read_joins(sock, zmq)
            try:
                ev = q.get(timeout=0.05)
            except queue.Empty:
                if self.heartbeat_s is not None and time.monotonic() - last_send >= self.heartbeat_s:
                    last_send = time.monotonic()
                    try:
                        sock.send(encode(HeartbeatEvent(time.time())), zmq.NOBLOCK)
                    except zmq.ZMQError:
                        pass  # a subscriber too slow for a heartbeat is behind on events too
                continue
            last_send = time.monotonic()
            try:
                data = ev if isinstance(ev, (bytes, bytearray)) else encode(ev)
            except ProtocolError:
                self.encode_errors += 1
                self._add_dropped(1)
                continue
            try:
                sock.send(data, zmq.NOBLOCK)
                self.sent += 1
            except zmq.Again:
                self._add_dropped(1)
            except zmq.ZMQError:
                self._add_dropped(1)
        # Whatever is left after the deadline is lost.
        left = 0
        while True:
            try:
                q.get_nowait()
                left += 1
            except queue.Empty:
                break
        self._add_dropped(left)

    def _read_joins(self, sock, zmq) -> None:
        """Count the subscriptions the XPUB socket has handed over (a frame starting with byte 1)."""
        for _ in range(64):  # bounded: a flood of (re)subscriptions cannot hold the sender
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            if frame[:1] == b"\x01":
                self.joins += 1

    def close(self, linger: float = 0.5) -> None:
        """Stop the thread after flushing the queue for at most ``linger`` seconds."""
        if self._closed:
            return
        self._closed = True
        self._deadline = time.monotonic() + max(0.0, linger)
        self._closing.set()
        self._thread.join(timeout=max(0.0, linger) + 5.0)
        self._sock.close(linger=int(max(0.0, linger) * 1000))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


# --------------------------------------------------------------------------- subscriber


class OwnsSocket:
    """close() once, and use as a context manager; subclasses set _sock and _closed."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def redial_if_dropped(sock, monitor, addr: str) -> bool:
    """Connect `sock` to `addr` afresh if its monitor (EVENT_DISCONNECTED only) told of a disconnection.

    zmq drops a connection whose peer sent a frame over MAXMSGSIZE as a protocol error, and a connecting
    socket never reconnects after one: without this, one oversized frame leaves the socket deaf to that
    address for good. Drains every pending event; True when it reconnected. Call it only when `sock`
    has nothing left to read: the redial drops the messages zmq still holds for the address.
    """
    zmq = zmq_module()
    dropped = False
    while True:
        try:
            monitor.recv_multipart(zmq.NOBLOCK)  # [event id and value, endpoint]: only disconnections
        except zmq.Again:
            break
        dropped = True
    if dropped:
        try:
            sock.disconnect(addr)  # whatever zmq still holds for it (nothing after a protocol error)
        except zmq.ZMQError:
            pass
        sock.connect(addr)
    return dropped


class Subscriber(OwnsSocket):
    """Receives and decodes events from a publisher.

    Connecting needs no publisher yet: zmq connects and reconnects on its own, so
    a subscriber survives an engine restart. Malformed frames are counted in
    ``.malformed`` (last error text in ``.last_error``) and skipped; events of a type
    this build does not know are counted in ``.unknown`` and skipped. ``.gaps``
    counts step numbers that never arrived (events lost on the way).
    """

    def __init__(self, addr: str = DEFAULT_EVENTS_ADDR, *, rcvhwm: int = 1000, max_size: int | None = None):
        zmq = zmq_module()
        self.addr = addr
        self._sock = _context().socket(zmq.SUB)
        # zmq's queue counts messages, not bytes: keep it short, the reader drains it fast
        self._sock.setsockopt(zmq.RCVHWM, max(1, int(rcvhwm)))
        self._sock.setsockopt(zmq.LINGER, 0)
        self._max_size = max_size or MAX_EVENT_BYTES
        # Refuse oversize frames at the zmq level (the peer is disconnected).
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._max_size)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        # zmq drops a connection whose peer sent a frame over MAXMSGSIZE as a protocol error, and a
        # connecting socket never reconnects after one: one oversized frame would leave this
        # subscriber deaf to that address for good. The monitor tells of every disconnection;
        # each one is answered by connecting afresh (counted in .reconnects).
        self._monitor = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._sock.connect(addr)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self._poller.register(self._monitor, zmq.POLLIN)
        self.reconnects = 0
        self.malformed = 0
        self.unknown = 0
        self.last_error: str | None = None
        self.received = 0
        self.gaps = 0
        self._last_step: int | None = None
        self._closed = False

    def recv_frame(self, timeout_ms: int = 100) -> bytes | None:
        """The next raw frame, or None if none arrived within ``timeout_ms`` (0: don't wait)."""
        zmq = zmq_module()
        deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
        while True:
            try:
                return self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                # Nothing left to read: only now answer a disconnection. A redial drops what zmq still
                # holds for the address, which is a closing publisher's last events and its bye.
                if self._reconnect_if_dropped():
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not self._poller.poll(max(1, int(left * 1000))):
                    if time.monotonic() >= deadline:
                        return None

    def _reconnect_if_dropped(self) -> bool:
        if redial_if_dropped(self._sock, self._monitor, self.addr):
            self.reconnects += 1
            return True
        return False

    def close(self) -> None:
        if not self._closed:
            try:
                self._sock.disable_monitor()
            except Exception:  # the context may be terminating
                pass
            self._monitor.close(0)
        super().close()

    def decode_frame(self, data: bytes):
        """Decode one frame: the event, or None (counted in ``malformed``) if it is bad."""
        try:
            ev = decode(data, self._max_size)
        except UnknownEventType:
            self.unknown += 1  # a later v1 writer's event type: skipped, not damage (docs/PROTOCOL.md)
            return None
        except ProtocolError as e:
            self.malformed += 1
            self.last_error = str(e)
            return None
        self.received += 1
        if ev.type == "step":
            if self._last_step is not None and ev.step > self._last_step + 1:
                self.gaps += ev.step - self._last_step - 1
            self._last_step = ev.step
        elif ev.type == "hello":
            self._last_step = None
        return ev

    def recv(self, timeout_ms: int = 100):
        """The next good event, or None if none arrived within ``timeout_ms``."""
        deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
        while True:
            data = self.recv_frame(max(0, int((deadline - time.monotonic()) * 1000)))
            if data is None:
                return None
            ev = self.decode_frame(data)
            if ev is not None:
                return ev
