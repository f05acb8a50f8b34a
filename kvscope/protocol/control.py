"""The control channel: typed requests and replies, a ROUTER server the engine polls, a REQ client.

A request is a msgpack map ``{"cmd": str, "args": map}``; each command's arguments
are a msgspec Struct below (unknown arguments refused), so checking a request is a
typed decode. Every request the server receives gets exactly one reply, a map with
``ok`` and, when false, ``error`` (docs/PROTOCOL.md, "Control channel"); bad ones are
answered here and never reach the engine. Per ``poll`` (once per engine iteration)
the server hands over at most ``max_per_poll`` requests asking for at most
``max_requests_per_poll`` injected requests in all, and at most one ``snapshot``:
further snapshot requests of that poll share its reply.
"""

from __future__ import annotations

from typing import Annotated, Any, Callable, Iterable

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from .codec import ProtocolError, _trim, unpack_limited
from .pubsub import DEFAULT_CONTROL_ADDR, OwnsSocket, bind, check_bind_address, zmq_module

__all__ = [
    "DEFAULT_CONTROL_ADDR",
    "CONTROL_COMMANDS",
    "MAX_CONTROL_BYTES",
    "MAX_CONTROL_WIRE_BYTES",
    "MAX_INJECT",
    "ControlServer",
    "ControlRequest",
    "ControlClient",
    "validate_control",
    "refused_reply",
]

MAX_CONTROL_BYTES = 64 << 10  # one control request or reply; larger ones are answered with an error
MAX_CONTROL_WIRE_BYTES = 1 << 20  # zmq drops the connection of a peer sending more than this (no reply)
MAX_INJECT = 4096  # requests one burst / add may ask for


class _Args(Struct, forbid_unknown_fields=True):
    pass


class NoArgs(_Args):
    pass


class BurstArgs(_Args):
    n: Annotated[int, Meta(ge=1, le=MAX_INJECT)] | UnsetType = UNSET


class LongArgs(_Args):
    prompt_len: Annotated[int, Meta(ge=1, le=1 << 20)] | UnsetType = UNSET


class AddArgs(_Args):
    workload: Annotated[str, Meta(min_length=1, max_length=64)]
    n: Annotated[int, Meta(ge=1, le=MAX_INJECT)]


# command -> its arguments
CONTROL_COMMANDS: dict[str, type[_Args]] = {
    "snapshot": NoArgs,
    "burst": BurstArgs,
    "long": LongArgs,
    "add": AddArgs,
    "pause": NoArgs,
    "resume": NoArgs,
    "stop": NoArgs,
}


class ControlMessage(Struct, forbid_unknown_fields=True):
    cmd: Annotated[str, Meta(max_length=64)]
    args: dict[str, Any] | None = None


class ControlReply(Struct, omit_defaults=True):
    """What the client gets back; commands add fields (kept as a dict by the client)."""

    ok: bool
    error: Annotated[str, Meta(max_length=4096)] | UnsetType = UNSET


def refused_reply(added: int, refused: int, reason: str) -> dict:
    """The reply when the engine queues only ``added`` of the requests asked for.

    ``{"ok": false, "error": "refused N requests: REASON", "added": added, "refused": refused}``
    """
    return {"ok": False, "error": f"refused {refused} requests: {reason}", "added": added, "refused": refused}


def validate_control(msg: Any, workloads: frozenset[str] | None = None) -> tuple[str, dict]:
    """Check one decoded control message; returns (cmd, args) or raises ValueError (one line)."""
    try:
        m = msgspec.convert(msg, ControlMessage)
    except msgspec.ValidationError as e:
        raise ValueError(_trim(f"request must be a map with 'cmd' and 'args': {e}")) from None
    spec = CONTROL_COMMANDS.get(m.cmd)
    if spec is None:
        raise ValueError(_trim(f"unknown command {m.cmd!r}; known: {', '.join(CONTROL_COMMANDS)}"))
    try:
        args = msgspec.convert(m.args or {}, spec)
    except msgspec.ValidationError as e:
        raise ValueError(_trim(f"{m.cmd}: {e}")) from None
    out = {k: v for k, v in msgspec.structs.asdict(args).items() if v is not UNSET}
    if m.cmd == "add" and workloads is not None and out["workload"] not in workloads:
        raise ValueError(_trim(f"add: unknown workload {out['workload']!r}; known: {', '.join(sorted(workloads))}"))
    return m.cmd, out


_reply_encoder = msgspec.msgpack.Encoder()


def _pack_reply(reply: dict) -> bytes:
    try:
        data = _reply_encoder.encode(reply)
    except Exception as e:
        data = _reply_encoder.encode({"ok": False, "error": _trim(f"unencodable reply: {e}")})
    if len(data) > MAX_CONTROL_BYTES:
        data = _reply_encoder.encode({"ok": False, "error": "reply too large"})
    return data


class ControlRequest:
    """One validated control request. Call ``reply`` exactly once (later calls are ignored)."""

    __slots__ = ("cmd", "args", "_sends", "replied")

    def __init__(self, cmd: str, args: dict, send: Callable[[bytes], None]):
        self.cmd = cmd
        self.args = args
        self._sends = [send]
        self.replied = False

    def reply(self, reply: dict | None = None, **kw) -> None:
        if self.replied:
            return
        self.replied = True
        r = dict(reply or {})
        r.update(kw)
        r.setdefault("ok", True)
        data = _pack_reply(r)
        for send in self._sends:
            send(data)

    def __repr__(self) -> str:
        return f"ControlRequest({self.cmd!r}, {self.args!r})"


def _split_envelope(frames: list[bytes]) -> tuple[list[bytes], list[bytes]]:
    """(routing envelope up to the empty delimiter, the message parts after it)."""
    for i, f in enumerate(frames):
        if not f and i > 0:
            return frames[: i + 1], frames[i + 1 :]
    return frames[:1], frames[1:]


class ControlServer(OwnsSocket):
    """ROUTER socket for control requests; ``poll()`` never blocks."""

    def __init__(
        self,
        addr: str = DEFAULT_CONTROL_ADDR,
        allow_remote: bool = False,
        *,
        workloads: Iterable[str] | None = None,
        max_per_poll: int = 64,
        max_requests_per_poll: int = MAX_INJECT,
    ):
        check_bind_address(addr, allow_remote)
        zmq = zmq_module()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_WIRE_BYTES)
        self._sock.setsockopt(zmq.SNDHWM, 1000)
        self._sock.setsockopt(zmq.RCVHWM, 1000)
        try:
            self.addr = bind(self._sock, addr)
        except Exception:
            self._sock.close(0)
            raise
        self.workloads = frozenset(workloads) if workloads is not None else None
        self.max_per_poll = max_per_poll
        self.max_requests_per_poll = max_requests_per_poll
        self.rejected = 0
        self._held: ControlRequest | None = None  # over this poll's budget: first of the next poll
        self._closed = False

    def poll(self) -> list[ControlRequest]:
        """Requests that arrived since the last call (validated, within this poll's budget)."""
        zmq = zmq_module()
        out: list[ControlRequest] = []
        snapshot: ControlRequest | None = None
        injected = 0
        for _ in range(self.max_per_poll):
            if self._held is not None:
                req, self._held = self._held, None
            else:
                try:
                    frames = self._sock.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
                req = self._accept(frames)
                if req is None:
                    continue
            if req.cmd == "snapshot":
                if snapshot is not None:
                    snapshot._sends.extend(req._sends)  # one snapshot per poll, every asker answered
                    continue
                snapshot = req
            cost = req.args.get("n", 16) if req.cmd in ("burst", "add") else 1 if req.cmd == "long" else 0
            if cost and injected + cost > self.max_requests_per_poll and injected:
                self._held = req  # over budget: it goes first next time
                break
            injected += cost
            out.append(req)
        return out

    def _accept(self, frames: list[bytes]) -> ControlRequest | None:
        envelope, parts = _split_envelope(frames)
        if not parts and len(envelope) < 2:
            self.rejected += 1
            return None  # no routing id and payload: nothing to reply to
        send = self._sender(envelope)
        try:
            if len(parts) != 1:
                raise ValueError(f"expected one message part, got {len(parts)}")
            msg = unpack_limited(parts[0], MAX_CONTROL_BYTES, max_map_len=64)
            cmd, args = validate_control(msg, self.workloads)
        except (ProtocolError, ValueError) as e:
            self.rejected += 1
            send(_pack_reply({"ok": False, "error": _trim(str(e))}))
            return None
        return ControlRequest(cmd, args, send)

    def _sender(self, envelope: list[bytes]) -> Callable[[bytes], None]:
        zmq = zmq_module()

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
        zmq = zmq_module()
        self._sock = zmq.Context.instance().socket(zmq.REQ)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_CONTROL_BYTES)
        self._sock.connect(self.addr)
        self._poller = zmq.Poller()
        self._poller.register(self._sock, zmq.POLLIN)

    def _reset(self) -> None:
        self._sock.close(0)
        self._open()

    def request(self, cmd: str, timeout_ms: int | None = None, **args) -> dict:
        zmq = zmq_module()
        if self._sock is None:
            return {"ok": False, "error": "client closed"}
        timeout = self.timeout_ms if timeout_ms is None else timeout_ms
        try:
            data = msgspec.msgpack.encode({"cmd": cmd, "args": args})
        except Exception as e:
            return {"ok": False, "error": _trim(f"cannot encode request: {e}")}
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
            msgspec.convert(reply, ControlReply)
        except (ProtocolError, zmq.ZMQError, msgspec.ValidationError) as e:
            self._reset()
            return {"ok": False, "error": _trim(f"bad reply: {e}")}
        return reply

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()
