"""msgpack codec for protocol v1 events, on msgspec.

The schema, with its types, ranges, enums and length caps, is the Structs in
``kvscope.protocol.events``; msgspec checks all of it while decoding. This module
adds only what msgspec does not do (docs/PROTOCOL.md, "Decoding and limits"):

- the frame size cap;
- the msgpack-level limits, nesting depth first: before the typed decode, a frame is
  decoded once into a generic type that is itself only ``MAX_DEPTH`` levels deep, so
  no recursion ever goes deeper than that, and strings, arrays and maps are capped;
- the protocol version check on ``hello``;
- ``SnapshotEvent.block_tables``, a dict here and an array of ``[req, [block, ...]]``
  pairs on the wire, so that every map key on the wire is a string;
- ``HelloEvent.config``, an EngineInfo with per-backend sections here and protocol v1's
  one flat map on the wire (``kvscope.protocol.engine_info``).

No ext types, no bin, no pickle. ``decode`` raises :class:`ProtocolError` (and only
that) for anything malformed, with a one-line message of bounded length.
"""

from __future__ import annotations

import re
from functools import lru_cache
from typing import Annotated, Any, Union

import msgspec
from msgspec import Meta

from kvscope.errors import KvscopeError

from . import engine_info as EI
from . import events as E
from .events import MAX_LIST_LEN, MAX_NAME_LEN, MAX_TEXT_LEN, Count, CountList, Int

__all__ = [
    "ProtocolError",
    "UnknownEventType",
    "encode",
    "decode",
    "decode_obj",
    "unpack_limited",
    "MAX_EVENT_BYTES",
    "MAX_LIST_LEN",
    "MAX_MAP_LEN",
    "MAX_STR_LEN",
    "MAX_NAME_LEN",
    "MAX_DEPTH",
]

MAX_EVENT_BYTES = 16 << 20  # one encoded event
MAX_MAP_LEN = 1024  # any map (event maps, hello config)
MAX_STR_LEN = MAX_TEXT_LEN  # any string
MAX_DEPTH = 8  # nesting of arrays and maps, the event map itself included
MAX_ERROR_LEN = 160  # error messages never quote more than this


class ProtocolError(KvscopeError, ValueError):
    """Anything malformed: bad msgpack, wrong types, out-of-range values, oversize."""


class UnknownEventType(ProtocolError):
    """A map whose ``type`` is a string this build does not know: an event type a later v1
    writer added. Subscribers and trace readers skip it (and count it); it is not damage."""


def _trim(s: str) -> str:
    s = s.replace("\n", " ")
    return s if len(s) <= MAX_ERROR_LEN else s[: MAX_ERROR_LEN - 3] + "..."


# --------------------------------------------------------------------------- limits
@lru_cache(maxsize=8)
def _bounded_decoder(max_map_len: int, depth: int = MAX_DEPTH) -> msgspec.msgpack.Decoder:
    """A decoder into JSON-like data at most ``depth`` containers deep.

    The type is unrolled ``depth`` times, innermost scalars only: a container below
    that level is a type error found where it starts, so decoding never recurses
    deeper, whatever the input.
    """
    Str = Annotated[str, Meta(max_length=MAX_STR_LEN)]
    t: Any = Union[None, bool, int, float, Str]
    for _ in range(depth):
        t = Union[
            None,
            bool,
            int,
            float,
            Str,
            Annotated[list[t], Meta(max_length=MAX_LIST_LEN)],
            Annotated[dict[Str, t], Meta(max_length=max_map_len)],
        ]
    return msgspec.msgpack.Decoder(t)


def _check_size(data, max_size: int) -> None:
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    n = len(data)
    if n == 0:
        raise ProtocolError("empty message")
    if n > max_size:
        raise ProtocolError(f"message of {n} bytes exceeds the {max_size}-byte limit")


def _malformed(e: Exception) -> ProtocolError:
    if isinstance(e, RecursionError):
        return ProtocolError(f"malformed msgpack: nested deeper than {MAX_DEPTH} levels")
    msg = str(e)
    path = msg.rpartition(" - at `")[2]
    if ("got `array`" in msg or "got `object`" in msg) and path.count("[") + path.count(".") >= MAX_DEPTH:
        return ProtocolError(f"malformed msgpack: nested deeper than {MAX_DEPTH} levels")
    return ProtocolError(_trim(f"malformed msgpack: {msg}"))


def unpack_limited(data, max_size: int, *, max_map_len: int = MAX_MAP_LEN) -> Any:
    """Decode msgpack into plain data with strict limits; ProtocolError on anything odd.

    Limits: ``max_size`` bytes, nesting ``MAX_DEPTH``, strings ``MAX_STR_LEN`` chars,
    arrays ``MAX_LIST_LEN`` items, maps ``max_map_len`` keys, string map keys only,
    no bin, no ext, no trailing bytes.
    """
    _check_size(data, max_size)
    try:
        return _bounded_decoder(max_map_len).decode(data)
    except (msgspec.DecodeError, RecursionError) as e:  # ValidationError is a DecodeError
        raise _malformed(e) from None


# --------------------------------------------------------------------------- schema glue
# A snapshot on the wire: the same fields, block_tables as [req, blocks] pairs.
_Pairs = Annotated[list[tuple[Int, CountList]], Meta(max_length=MAX_LIST_LEN)]


def _wire_twin(cls):
    fields = []
    for f in msgspec.structs.fields(cls):
        t = _Pairs if f.name == "block_tables" else f.type
        if f.default is not msgspec.NODEFAULT:
            fields.append((f.name, t, msgspec.field(default=f.default)))
        elif f.default_factory is not msgspec.NODEFAULT:
            fields.append((f.name, t, msgspec.field(default_factory=f.default_factory)))
        else:
            fields.append((f.name, t))
    return msgspec.defstruct("SnapshotWire", fields, tag="snapshot", tag_field="type")


_SnapshotWire = _wire_twin(E.SnapshotEvent)
_SNAPSHOT_FIELDS = E.SnapshotEvent.__struct_fields__


# A hello on the wire: config is the flat map.
class _HelloWire(msgspec.Struct, tag="hello", tag_field="type"):
    version: Int
    config: EI.EngineInfoWire
    wall_start: E.Float


_EVENT_CLASSES = frozenset(E.EVENT_TYPES.values())
# The wire twins stand in for their events; every other event of the union decodes as itself.
_TWINS = {E.SnapshotEvent: _SnapshotWire, E.HelloEvent: _HelloWire}
_decoder = msgspec.msgpack.Decoder(Union[tuple(_TWINS.get(c, c) for c in E.EVENT_TYPES.values())])


def _from_wire(w) -> E.SnapshotEvent:
    tables: dict[int, list[int]] = {}
    for req, blocks in w.block_tables:
        if req in tables:
            raise ProtocolError(f"snapshot.block_tables: request {req} appears twice")
        tables[req] = blocks
    return E.SnapshotEvent(*[tables if n == "block_tables" else getattr(w, n) for n in _SNAPSHOT_FIELDS])


# --------------------------------------------------------------------------- encode
def _pack_default(obj):
    # numpy / torch scalars and other int-like or float-like objects.
    if hasattr(obj, "__index__"):
        return obj.__index__()
    if hasattr(obj, "__float__"):
        return float(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


_encoder = msgspec.msgpack.Encoder(enc_hook=_pack_default)


_UINT64_PAST_INT64 = re.compile(rb"\xcf[\x80-\xff]")


def encode(event, max_size: int = MAX_EVENT_BYTES) -> bytes:
    """Encode one event as a msgpack map. Raises ProtocolError if it can't, or if the
    result is one ``decode`` would refuse (over ``max_size``, or an array past its cap):
    nothing is ever sent or recorded that the reader on the other side cannot read."""
    cls = type(event)
    if cls not in _EVENT_CLASSES:
        raise ProtocolError(f"not a protocol event: {cls.__name__}")
    try:
        if cls is E.SnapshotEvent:
            event = msgspec.structs.replace(event, block_tables=[[k, v] for k, v in event.block_tables.items()])
        elif cls is E.HelloEvent:
            event = _HelloWire(event.version, EI.EngineInfoWire(**EI.to_wire(event.config)), event.wall_start)
        data = _encoder.encode(event)
    except Exception as e:  # TypeError, ValueError, OverflowError, AttributeError...
        raise ProtocolError(_trim(f"cannot encode {cls.type} event: {e}")) from None
    if len(data) > max_size:
        raise ProtocolError(f"{cls.type} event of {len(data)} bytes exceeds the {max_size}-byte limit")
    # Only a frame this large can hold an array past the cap; only a frame with a msgpack uint64
    # of 2^63 or more (0xcf, then a high byte; a float's bytes can look the same) can hold an int
    # past int64, which every Int and Count refuses. Those frames alone are decoded to be sure.
    if len(data) > MAX_LIST_LEN or _UINT64_PAST_INT64.search(data):
        try:
            decode(data, max_size)
        except ProtocolError as e:
            raise ProtocolError(_trim(f"cannot encode {cls.type} event: its reader would refuse it ({e})")) from None
    return data


# --------------------------------------------------------------------------- decode
def decode(data, max_size: int = MAX_EVENT_BYTES) -> E.Event:
    """Decode and validate one event. Raises ProtocolError for anything malformed."""
    m = unpack_limited(data, max_size)  # size, depth and msgpack limits before the typed decode
    try:
        ev = _decoder.decode(data)
    except msgspec.ValidationError as e:
        raise _invalid(m, e) from None
    except (msgspec.DecodeError, RecursionError) as e:  # pragma: no cover - the limits pass saw it first
        raise _malformed(e) from None
    return _finish(ev)


def decode_obj(m: Any) -> E.Event:
    """Validate an already-unpacked msgpack value (plain data) and build the event."""
    try:
        ev = msgspec.convert(m, type=_decoder.type)
    except msgspec.ValidationError as e:
        raise _invalid(m, e) from None
    except RecursionError:
        raise ProtocolError(f"nested deeper than {MAX_DEPTH} levels") from None
    return _finish(ev)


def _invalid(m: Any, e: Exception) -> ProtocolError:
    t = m.get("type") if type(m) is dict else None
    if type(m) is not dict:
        what = "event must be a map"
    elif type(t) is str and t in E.EVENT_TYPES:
        what = f"{t} event"
    elif type(t) is str:
        return UnknownEventType(_trim(f"unknown event type {t!r}"))
    else:
        what = "unknown event type"
    return ProtocolError(_trim(f"{what}: {e}"))


def _finish(ev) -> E.Event:
    cls = type(ev)
    if cls is _SnapshotWire:
        return _from_wire(ev)
    if cls is _HelloWire:
        if ev.version != E.PROTOCOL_VERSION:
            raise ProtocolError(f"unsupported protocol version {ev.version} (this build speaks {E.PROTOCOL_VERSION})")
        return E.HelloEvent(ev.version, EI.from_wire(ev.config), ev.wall_start)
    return ev
