"""ZeroMQ transport: event publisher/subscriber and the control channel.

pyzmq is imported lazily (on first socket), so this module can be imported, and
``check_bind_address`` used, without it.

- ``ZmqPublisher``: PUB socket fed by a background thread through a bounded queue.
  ``publish`` never blocks; events lost to a full queue or a subscriber at its
  high-water mark are counted and handed back by ``take_dropped``.
- ``Subscriber``: SUB socket, ``recv(timeout_ms)`` returns a decoded event or None.
- ``ControlServer``: ROUTER socket polled without blocking by the engine loop; it
  validates requests and answers bad ones itself.
- ``ControlClient``: REQ socket with a timeout; never hangs.
"""

from __future__ import annotations

import ipaddress
import queue
import threading
import time
from typing import Any, Callable, Iterable

import msgpack

from .codec import ProtocolError, decode, encode, unpack_limited
from .sinks import EventSink, FanOut

__all__ = [
    "DEFAULT_EVENTS_ADDR",
    "DEFAULT_CONTROL_ADDR",
    "CONTROL_COMMANDS",
    "MAX_CONTROL_BYTES",
    "check_bind_address",
    "ZmqPublisher",
    "Subscriber",
    "ControlServer",
    "ControlRequest",
    "ControlClient",
    "EventSink",
    "FanOut",
]

DEFAULT_EVENTS_ADDR = "tcp://127.0.0.1:5557"
DEFAULT_CONTROL_ADDR = "tcp://127.0.0.1:5558"

MAX_CONTROL_BYTES = 64 << 10  # one control request or reply

_zmq_mod = None


def _zmq():
    global _zmq_mod
    if _zmq_mod is None:
        import zmq

        _zmq_mod = zmq
    return _zmq_mod


def _context():
    return _zmq().Context.instance()


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


def _bind(sock, addr: str) -> str:
    """Bind; a port of 0 means 'any free port'. Returns the bound endpoint."""
    if addr.startswith("tcp://") and addr.endswith(":0"):
        addr = addr[:-2] + ":*"
    sock.bind(addr)
    ep = sock.getsockopt(_zmq().LAST_ENDPOINT)
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
    ):
        check_bind_address(addr, allow_remote)
        zmq = _zmq()
        self._sock = _context().socket(zmq.PUB)
        self._sock.setsockopt(zmq.SNDHWM, max(1, int(hwm)))
        self._sock.setsockopt(zmq.LINGER, 0)
        if count_drops:
            self._sock.setsockopt(zmq.XPUB_NODROP, 1)
        try:
            self.addr = _bind(self._sock, addr)
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
        zmq = _zmq()
        sock = self._sock
        q = self._queue
        while True:
            if self._closing.is_set() and (q.empty() or time.monotonic() > self._deadline):
                break
            try:
                ev = q.get(timeout=0.05)
            except queue.Empty:
                continue
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


class _OwnsSocket:
    """close() once, and use as a context manager; subclasses set _sock and _closed."""

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._sock.close(0)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class Subscriber(_OwnsSocket):
    """Receives and decodes events from a publisher.

    Connecting needs no publisher yet: zmq connects and reconnects on its own, so
    a subscriber survives an engine restart. Malformed frames are counted in
    ``.malformed`` (last error text in ``.last_error``) and skipped. ``.gaps``
    counts step numbers that never arrived (events lost on the way).
    """

    def __init__(self, addr: str = DEFAULT_EVENTS_ADDR, *, rcvhwm: int = 100000, max_size: int | None = None):
        zmq = _zmq()
        self.addr = addr
        self._sock = _context().socket(zmq.SUB)
        self._sock.setsockopt(zmq.RCVHWM, max(1, int(rcvhwm)))
        self._sock.setsockopt(zmq.LINGER, 0)
        from .codec import MAX_EVENT_BYTES

        self._max_size = max_size or MAX_EVENT_BYTES
        # Refuse oversize frames at the zmq level (the peer is disconnected).
        self._sock.setsockopt(zmq.MAXMSGSIZE, self._max_size)
        self._sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._sock.connect(addr)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)
        self.malformed = 0
        self.last_error: str | None = None
        self.received = 0
        self.gaps = 0
        self._last_step: int | None = None
        self._closed = False

    def recv(self, timeout_ms: int = 100):
        """The next event, or None if none arrived within ``timeout_ms``."""
        zmq = _zmq()
        deadline = time.monotonic() + max(0, timeout_ms) / 1000.0
        while True:
            try:
                data = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                left = deadline - time.monotonic()
                if left <= 0:
                    return None
                if not self._poller.poll(max(1, int(left * 1000))):
                    if time.monotonic() >= deadline:
                        return None
                continue
            try:
                ev = decode(data, self._max_size)
            except ProtocolError as e:
                self.malformed += 1
                self.last_error = str(e)
                continue
            self.received += 1
            if ev.type == "step":
                if self._last_step is not None and ev.step > self._last_step + 1:
                    self.gaps += ev.step - self._last_step - 1
                self._last_step = ev.step
            elif ev.type == "hello":
                self._last_step = None
            return ev



# --------------------------------------------------------------------------- control


def _int_arg(lo: int, hi: int) -> Callable[[Any], str | None]:
    def check(v):
        if type(v) is not int or not (lo <= v <= hi):
            return f"must be an integer in [{lo}, {hi}]"
        return None

    return check


def _name_arg(v) -> str | None:
    if type(v) is not str or not (1 <= len(v) <= 64):
        return "must be a non-empty string of at most 64 chars"
    return None


# command -> (required args, optional args); each arg maps to a checker.
CONTROL_COMMANDS: dict[str, tuple[dict[str, Callable], dict[str, Callable]]] = {
    "snapshot": ({}, {}),
    "burst": ({}, {"n": _int_arg(1, 4096)}),
    "long": ({}, {"prompt_len": _int_arg(1, 1 << 20)}),
    "add": ({"workload": _name_arg, "n": _int_arg(1, 4096)}, {}),
    "pause": ({}, {}),
    "resume": ({}, {}),
    "stop": ({}, {}),
}


def validate_control(msg: Any, workloads: frozenset[str] | None = None) -> tuple[str, dict]:
    """Check one decoded control message; returns (cmd, args) or raises ValueError."""
    if type(msg) is not dict:
        raise ValueError("request must be a map with 'cmd' and 'args'")
    extra = set(msg) - {"cmd", "args"}
    if extra:
        raise ValueError(f"unexpected keys {sorted(extra)}")
    cmd = msg.get("cmd")
    if type(cmd) is not str or cmd not in CONTROL_COMMANDS:
        raise ValueError(f"unknown command {cmd!r}; known: {', '.join(CONTROL_COMMANDS)}")
    args = msg.get("args", {})
    if args is None:
        args = {}
    if type(args) is not dict:
        raise ValueError("'args' must be a map")
    required, optional = CONTROL_COMMANDS[cmd]
    for k in required:
        if k not in args:
            raise ValueError(f"{cmd}: missing argument {k!r}")
    for k, v in args.items():
        check = required.get(k) or optional.get(k)
        if check is None:
            raise ValueError(f"{cmd}: unknown argument {k!r}")
        err = check(v)
        if err:
            raise ValueError(f"{cmd}: {k} {err}")
    if cmd == "add" and workloads is not None and args["workload"] not in workloads:
        raise ValueError(f"add: unknown workload {args['workload']!r}; known: {', '.join(sorted(workloads))}")
    return cmd, dict(args)


def _pack_reply(reply: dict) -> bytes:
    try:
        data = msgpack.packb(reply, use_bin_type=True)
    except Exception as e:
        data = msgpack.packb({"ok": False, "error": f"unencodable reply: {e}"})
    if len(data) > MAX_CONTROL_BYTES:
        data = msgpack.packb({"ok": False, "error": "reply too large"})
    return data


class ControlRequest:
    """One validated control request. Call ``reply`` exactly once (later calls are ignored)."""

    __slots__ = ("cmd", "args", "_send", "replied")

    def __init__(self, cmd: str, args: dict, send: Callable[[bytes], None]):
        self.cmd = cmd
        self.args = args
        self._send = send
        self.replied = False

    def reply(self, reply: dict | None = None, **kw) -> None:
        if self.replied:
            return
        self.replied = True
        r = dict(reply or {})
        r.update(kw)
        r.setdefault("ok", True)
        self._send(_pack_reply(r))

    def __repr__(self) -> str:
        return f"ControlRequest({self.cmd!r}, {self.args!r})"


class ControlServer(_OwnsSocket):
    """ROUTER socket for control requests; ``poll()`` never blocks.

    Requests are msgpack maps ``{"cmd": str, "args": map}``. Unknown commands, bad
    arguments, oversize or undecodable messages are answered here with
    ``{"ok": False, "error": ...}`` and never reach the engine. Pass ``workloads``
    to also reject unknown workload names for ``add``.
    """

    def __init__(
        self,
        addr: str = DEFAULT_CONTROL_ADDR,
        allow_remote: bool = False,
        *,
        workloads: Iterable[str] | None = None,
        max_per_poll: int = 64,
    ):
        check_bind_address(addr, allow_remote)
        zmq = _zmq()
        self._sock = _context().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        try:
            self.addr = _bind(self._sock, addr)
        except Exception:
            self._sock.close(0)
            raise
        self.workloads = frozenset(workloads) if workloads is not None else None
        self.max_per_poll = max_per_poll
        self.rejected = 0
        self._closed = False

    def poll(self) -> list[ControlRequest]:
        """Requests that arrived since the last call (already validated)."""
        zmq = _zmq()
        out: list[ControlRequest] = []
        for _ in range(self.max_per_poll):
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                break
            if len(frames) < 2 or len(frames) > 8:
                self.rejected += 1
                continue  # not a well-formed envelope: nothing to reply to
            envelope, payload = frames[:-1], frames[-1]
            send = self._sender(envelope)
            try:
                msg = unpack_limited(payload, MAX_CONTROL_BYTES, max_map_len=64)
                cmd, args = validate_control(msg, self.workloads)
            except (ProtocolError, ValueError) as e:
                self.rejected += 1
                send(_pack_reply({"ok": False, "error": str(e)}))
                continue
            out.append(ControlRequest(cmd, args, send))
        return out

    def _sender(self, envelope: list[bytes]) -> Callable[[bytes], None]:
        zmq = _zmq()

        def send(data: bytes) -> None:
            if self._closed:
                return
            try:
                self._sock.send_multipart([*envelope, data], zmq.NOBLOCK)
            except zmq.ZMQError:
                pass  # client gone or HWM reached: the client times out

        return send



class ControlClient:
    """REQ client; ``request`` returns the reply map, or ``{"ok": False, "error": "timeout"}``."""

    def __init__(self, addr: str = DEFAULT_CONTROL_ADDR, timeout_ms: int = 2000):
        self.addr = addr
        self.timeout_ms = timeout_ms
        self._sock = None
        self._poller = None
        self._open()

    def _open(self) -> None:
        zmq = _zmq()
        self._sock = _context().socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._sock.connect(self.addr)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def _reset(self) -> None:
        self._sock.close(0)
        self._open()

    def request(self, cmd: str, timeout_ms: int | None = None, **args) -> dict:
        zmq = _zmq()
        if self._sock is None:
            return {"ok": False, "error": "client closed"}
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        try:
            data = msgpack.packb({"cmd": cmd, "args": args}, use_bin_type=True)
        except Exception as e:
            return {"ok": False, "error": f"cannot encode request: {e}"}
        try:
            self._sock.send(data, zmq.NOBLOCK)
        except zmq.ZMQError as e:
            self._reset()
            return {"ok": False, "error": f"send failed: {e}"}
        if not self._poller.poll(max(0, int(timeout))):
            self._reset()  # a REQ socket is stuck after an unanswered request
            return {"ok": False, "error": "timeout"}
        try:
            reply = unpack_limited(self._sock.recv(zmq.NOBLOCK), MAX_CONTROL_BYTES, max_map_len=256)
        except (ProtocolError, zmq.ZMQError) as e:
            self._reset()
            return {"ok": False, "error": f"bad reply: {e}"}
        if type(reply) is not dict:
            return {"ok": False, "error": "bad reply: not a map"}
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
