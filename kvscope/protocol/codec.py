"""msgpack codec for protocol v1 events.

Wire form (docs/PROTOCOL.md): one event is one msgpack map with a ``type`` key and
one key per dataclass field. Nested records (BatchEntry, Admission, KvCounters, ...)
are positional arrays in the dataclass field order. ``SnapshotEvent.block_tables``
is an array of ``[req, [block, ...]]`` pairs so that every map key on the wire is a
string. No ext types, no bin, no pickle.

``decode`` is the one decoder: it bounds sizes before and while unpacking, checks
every field's type, range and length, and raises :class:`ProtocolError` (and only
that) for anything malformed.
"""

from __future__ import annotations

import math
import operator
from dataclasses import MISSING, fields
from typing import Any

import msgpack

from . import events as E

__all__ = [
    "ProtocolError",
    "encode",
    "decode",
    "MAX_EVENT_BYTES",
    "MAX_LIST_LEN",
    "MAX_MAP_LEN",
    "MAX_STR_LEN",
    "MAX_NAME_LEN",
    "MAX_CONFIG_DEPTH",
]

MAX_EVENT_BYTES = 16 << 20  # one encoded event
MAX_LIST_LEN = 1 << 20  # any array (block lists of a large KV pool fit)
MAX_MAP_LEN = 1024  # any map (event maps, hello config)
MAX_STR_LEN = 64 << 10  # any string (config values such as a model path)
MAX_NAME_LEN = 1024  # reason / mode strings
MAX_CONFIG_DEPTH = 8  # nesting inside hello.config

INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1


class ProtocolError(ValueError):
    """Anything malformed: bad msgpack, wrong types, out-of-range values, oversize."""


# --------------------------------------------------------------------------- specs
# Each spec knows how to turn a Python value into a msgpack-able value (enc) and
# how to check and rebuild one from the wire (dec). Scalars encode as themselves.


_INT_ONLY = {int}
_FLOAT_ONLY = {float}
_STR_ONLY = {str}
_LIST_ONLY = {list}


class _Int:
    __slots__ = ("lo", "hi")

    def __init__(self, lo: int, hi: int = INT64_MAX):
        self.lo, self.hi = lo, hi

    def enc(self, v):
        return v

    def dec(self, v, where):
        if type(v) is not int or not (self.lo <= v <= self.hi):
            raise ProtocolError(f"{where}: expected an integer in [{self.lo}, {self.hi}], got {_show(v)}")
        return v

    def col(self, vs, where):
        """Check a whole column of values at once (bulk fast path)."""
        if not vs or (set(map(type, vs)) == _INT_ONLY and self.lo <= min(vs) and max(vs) <= self.hi):
            return vs
        return [self.dec(v, where) for v in vs]  # raises with a precise message


class _Float:
    __slots__ = ()

    def enc(self, v):
        return v

    def dec(self, v, where):
        t = type(v)
        if t is float:
            if math.isfinite(v):
                return v
        elif t is int and INT64_MIN <= v <= INT64_MAX:
            return float(v)
        raise ProtocolError(f"{where}: expected a finite number, got {_show(v)}")

    def col(self, vs, where):
        if not vs or (set(map(type, vs)) == _FLOAT_ONLY and all(map(math.isfinite, vs))):
            return vs
        return [self.dec(v, where) for v in vs]


class _Str:
    __slots__ = ("maxlen", "choices")

    def __init__(self, maxlen: int = MAX_NAME_LEN, choices: tuple[str, ...] | None = None):
        self.maxlen, self.choices = maxlen, (frozenset(choices) if choices else None)

    def enc(self, v):
        return v

    def dec(self, v, where):
        if type(v) is not str or len(v) > self.maxlen:
            raise ProtocolError(f"{where}: expected a string of at most {self.maxlen} chars, got {_show(v)}")
        if self.choices is not None and v not in self.choices:
            raise ProtocolError(f"{where}: {v!r} is not one of {sorted(self.choices)}")
        return v

    def col(self, vs, where):
        if not vs or (
            set(map(type, vs)) == _STR_ONLY
            and (self.choices.issuperset(vs) if self.choices is not None else max(map(len, vs)) <= self.maxlen)
        ):
            return vs
        return [self.dec(v, where) for v in vs]


class _Opt:
    __slots__ = ("inner",)

    def __init__(self, inner):
        self.inner = inner

    def enc(self, v):
        return None if v is None else self.inner.enc(v)

    def dec(self, v, where):
        return None if v is None else self.inner.dec(v, where)

    def col(self, vs, where):
        present = [v for v in vs if v is not None]
        if len(present) == len(vs):
            return self.inner.col(vs, where)
        if present and self.inner.col(present, where) is not present:
            return [self.dec(v, where) for v in vs]  # some ints became floats
        return vs


class _Rec:
    """A nested dataclass record, positional array in field order."""

    __slots__ = ("cls", "names", "specs", "paths", "defaults", "required", "nfields", "get", "flat")

    def __init__(self, cls, specs: dict[str, Any]):
        self.cls = cls
        flds = fields(cls)
        assert [f.name for f in flds] == list(specs), cls
        self.names = tuple(specs)
        self.specs = tuple(specs.values())
        self.paths = tuple(f"{cls.__name__}.{n}" for n in self.names)
        self.defaults = tuple(_default_of(f) for f in flds)
        self.required = sum(1 for d in self.defaults if d is MISSING)
        self.nfields = len(self.names)
        self.get = operator.attrgetter(*self.names)
        # every field encodes as itself: the record is just its values in order
        self.flat = self.nfields > 1 and all(
            isinstance(sp, (_Int, _Float, _Str)) or (isinstance(sp, _Opt) and isinstance(sp.inner, (_Int, _Float, _Str)))
            for sp in self.specs
        )

    def enc(self, obj):
        if self.flat:
            return list(self.get(obj))
        return [s.enc(getattr(obj, n)) for n, s in zip(self.names, self.specs)]

    def dec(self, v, where):
        if type(v) is not list or len(v) < self.required:
            raise ProtocolError(
                f"{where}: expected a {self.cls.__name__} array of at least {self.required} items, got {_show(v)}"
            )
        n = len(v)
        if n >= self.nfields:
            # extra trailing items (fields added by a later v1 writer) are ignored
            return self.cls(*[s.dec(x, p) for s, x, p in zip(self.specs, v, self.paths)])
        vals = [s.dec(x, p) for s, x, p in zip(self.specs, v, self.paths)]
        vals.extend(d() for d in self.defaults[n:])
        return self.cls(*vals)

    def dec_many(self, rows: list, where):
        """Decode a list of flat records column by column (bulk checks)."""
        n = self.nfields
        if rows and set(map(type, rows)) == _LIST_ONLY and set(map(len, rows)) == {n}:
            cols = [s.col(c, p) for s, c, p in zip(self.specs, zip(*rows), self.paths)]
            cls = self.cls
            return [cls(*r) for r in zip(*cols)]
        return [self.dec(r, where) for r in rows]


class _List:
    __slots__ = ("inner", "maxlen")

    def __init__(self, inner, maxlen: int = MAX_LIST_LEN):
        self.inner, self.maxlen = inner, maxlen

    def enc(self, v):
        inner = self.inner
        if isinstance(inner, _Rec):
            if inner.flat:
                get = inner.get
                return [list(get(x)) for x in v]
            return [inner.enc(x) for x in v]
        return v  # scalars: a list or tuple, packed as an array by msgpack

    def dec(self, v, where):
        if type(v) is not list or len(v) > self.maxlen:
            raise ProtocolError(f"{where}: expected an array of at most {self.maxlen} items, got {_show(v)}")
        inner = self.inner
        if isinstance(inner, _Rec):
            if inner.flat:
                return inner.dec_many(v, where)
            return [inner.dec(x, where) for x in v]
        return inner.col(v, where)


class _BlockTables:
    """dict[int, list[int]] as an array of [req, [block, ...]] pairs."""

    __slots__ = ()
    _req = _Int(INT64_MIN)
    _blocks = _List(_Int(0))

    def enc(self, d):
        return [[k, list(v)] for k, v in d.items()]

    def dec(self, v, where):
        if type(v) is not list or len(v) > MAX_LIST_LEN:
            raise ProtocolError(f"{where}: expected an array of [req, blocks] pairs, got {_show(v)}")
        out: dict[int, list[int]] = {}
        for pair in v:
            if type(pair) is not list or len(pair) != 2:
                raise ProtocolError(f"{where}: expected a [req, blocks] pair, got {_show(pair)}")
            req = self._req.dec(pair[0], where)
            if req in out:
                raise ProtocolError(f"{where}: request {req} appears twice")
            out[req] = self._blocks.dec(pair[1], where)
        return out


class _Config:
    """hello.config: JSON-like data, string keys, bounded depth."""

    __slots__ = ()

    def enc(self, v):
        return v

    def dec(self, v, where):
        if type(v) is not dict:
            raise ProtocolError(f"{where}: expected a map, got {_show(v)}")
        self._check(v, where, 0)
        return v

    def _check(self, v, where, depth):
        if depth > MAX_CONFIG_DEPTH:
            raise ProtocolError(f"{where}: nested deeper than {MAX_CONFIG_DEPTH}")
        t = type(v)
        if t is dict:
            for k, x in v.items():
                if type(k) is not str:  # strict_map_key already ensures this
                    raise ProtocolError(f"{where}: map key {_show(k)} is not a string")
                self._check(x, where, depth + 1)
        elif t is list:
            for x in v:
                self._check(x, where, depth + 1)
        elif v is None or t in (bool, int, float, str):
            pass
        else:  # pragma: no cover - msgpack cannot produce anything else with our limits
            raise ProtocolError(f"{where}: unsupported value {_show(v)}")


def _default_of(f):
    if f.default is not MISSING:
        d = f.default
        return lambda: d
    if f.default_factory is not MISSING:
        return f.default_factory
    return MISSING


def _show(v) -> str:
    r = repr(v)
    return r if len(r) <= 40 else r[:37] + "..."


# --------------------------------------------------------------------------- schema

_U = _Int(0)  # counts, lengths, block ids
_I = _Int(INT64_MIN)  # request ids, steps, priorities
_F = _Float()
_NAME = _Str()
_UL = _List(_U)
_IL = _List(_I)

_KV = _Rec(E.KvCounters, {n: _U for n in (f.name for f in fields(E.KvCounters))})

_SCHEMA: dict[type, dict[str, Any]] = {
    E.HelloEvent: {"version": _I, "config": _Config(), "wall_start": _F},
    E.RequestEvent: {"req": _I, "prompt_len": _U, "max_tokens": _U, "priority": _I, "arrival": _F,
                     "source": _Str(16)},
    E.RejectEvent: {"req": _I, "reason": _NAME, "t": _F},
    E.StepEvent: {
        "step": _I,
        "t": _F,
        "dur": _F,
        "budget": _U,
        "batch": _List(
            _Rec(E.BatchEntry, {"req": _I, "kind": _Str(16, (E.PREFILL, E.DECODE)), "tokens": _U, "start": _U})
        ),
        "padding": _U,
        "running": _IL,
        "waiting": _IL,
        "preempted": _IL,
        "swapped": _IL,
        "admission": _Rec(
            E.Admission,
            {
                "verdict": _Str(16, (E.VERDICT_ADMITTED, E.VERDICT_BLOCKED, E.VERDICT_IDLE)),
                "reason": _Opt(_NAME),
                "req": _Opt(_I),
            },
        ),
        "preemptions": _List(_Rec(E.Preemption, {"req": _I, "reason": _NAME, "mode": _NAME})),
        "alloc": _List(_Rec(E.BlockAlloc, {"block": _U, "req": _I})),
        "freed": _UL,
        "refs": _List(_Rec(E.RefChange, {"block": _U, "refcount": _U})),
        "sampled": _IL,
        "first_tokens": _List(_Rec(E.FirstToken, {"req": _I, "ttft": _F})),
        "finished": _List(
            _Rec(E.Finish, {"req": _I, "ttft": _F, "e2e": _F, "output_len": _U, "reason": _NAME})
        ),
        "itl": _List(_Rec(E.ItlSample, {"req": _I, "gap": _F})),
        "kv": _KV,
        "dropped": _U,
        "hits": _List(_Rec(E.PrefixHit, {"req": _I, "tokens": _U, "blocks": _U})),
        "swaps": _List(_Rec(E.Swap, {"req": _I, "direction": _Str(8, (E.SWAP_OUT, E.SWAP_IN)), "blocks": _U})),
    },
    E.SnapshotEvent: {
        "step": _I,
        "t": _F,
        "requests": _List(
            _Rec(
                E.RequestState,
                {
                    "req": _I,
                    "state": _Str(16, E.REQUEST_STATES),
                    "prompt_len": _U,
                    "max_tokens": _U,
                    "computed": _U,
                    "output_len": _U,
                    "priority": _I,
                    "arrival": _F,
                    "ttft": _Opt(_F),
                    "preemptions": _U,
                    "cached_tokens": _U,
                    "source": _Str(16),
                },
            )
        ),
        "blocks": _List(_Rec(E.BlockOwner, {"block": _U, "req": _I, "refcount": _U})),
        "block_tables": _BlockTables(),
        "running": _IL,
        "waiting": _IL,
        "preempted": _IL,
        "swapped": _IL,
        "kv": _KV,
    },
    E.ByeEvent: {"step": _I, "t": _F, "reason": _NAME},
}


class _EventSpec:
    __slots__ = ("cls", "type", "items", "defaults")

    def __init__(self, cls, specs):
        self.cls = cls
        self.type = _type_name(cls)
        names = [f.name for f in fields(cls) if f.name != "type"]
        assert names == list(specs), (cls, names)
        self.items = tuple((n, sp, f"{self.type}.{n}") for n, sp in specs.items())
        self.defaults = {f.name: _default_of(f) for f in fields(cls)}


def _type_name(cls) -> str:
    for name, c in E.EVENT_TYPES.items():
        if c is cls:
            return name
    raise AssertionError(cls)


_BY_CLASS: dict[type, _EventSpec] = {cls: _EventSpec(cls, s) for cls, s in _SCHEMA.items()}
_BY_TYPE: dict[str, _EventSpec] = {s.type: s for s in _BY_CLASS.values()}
assert set(_BY_TYPE) == set(E.EVENT_TYPES)


# --------------------------------------------------------------------------- encode


def _pack_default(obj):
    # numpy / torch scalars and other int-like or float-like objects.
    if hasattr(obj, "__index__"):
        return obj.__index__()
    if hasattr(obj, "__float__"):
        return float(obj)
    raise TypeError(f"cannot encode {type(obj).__name__}")


def encode(event) -> bytes:
    """Encode one event dataclass as a msgpack map. Raises ProtocolError if it can't."""
    spec = _BY_CLASS.get(type(event))
    if spec is None:
        raise ProtocolError(f"not a protocol event: {type(event).__name__}")
    try:
        m = {"type": spec.type}
        for name, s, _ in spec.items:
            m[name] = s.enc(getattr(event, name))
        return msgpack.packb(m, use_bin_type=True, default=_pack_default)
    except ProtocolError:
        raise
    except Exception as e:  # TypeError, ValueError, OverflowError, AttributeError...
        raise ProtocolError(f"cannot encode {spec.type} event: {e}") from None


# --------------------------------------------------------------------------- decode


def unpack_limited(data, max_size: int, *, max_map_len: int = MAX_MAP_LEN) -> Any:
    """msgpack.unpackb with strict limits; raises ProtocolError on anything odd."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ProtocolError(f"expected bytes, got {type(data).__name__}")
    n = len(data)
    if n == 0:
        raise ProtocolError("empty message")
    if n > max_size:
        raise ProtocolError(f"message of {n} bytes exceeds the {max_size}-byte limit")
    try:
        return msgpack.unpackb(
            data,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=min(MAX_STR_LEN, n),
            max_bin_len=0,
            max_ext_len=0,
            max_array_len=min(MAX_LIST_LEN, n),
            max_map_len=min(max_map_len, n),
        )
    except RecursionError:
        raise ProtocolError("malformed msgpack: nested too deeply") from None
    except Exception as e:  # ExtraData, FormatError, StackError, UnicodeDecodeError, ...
        raise ProtocolError(f"malformed msgpack: {type(e).__name__}: {_trim(str(e))}") from None


def _trim(s: str) -> str:
    s = s.replace("\n", " ")
    return s if len(s) <= 120 else s[:117] + "..."


def decode(data: bytes, max_size: int = MAX_EVENT_BYTES) -> E.Event:
    """Decode and validate one event. Raises ProtocolError for anything malformed."""
    m = unpack_limited(data, max_size)
    return decode_obj(m)


def decode_obj(m: Any) -> E.Event:
    """Validate an already-unpacked msgpack value and build the event."""
    if type(m) is not dict:
        raise ProtocolError(f"event must be a map, got {_show(m)}")
    t = m.get("type")
    spec = _BY_TYPE.get(t) if type(t) is str else None
    if spec is None:
        raise ProtocolError(f"unknown event type {_show(t)}")
    kwargs = {}
    for name, s, path in spec.items:
        if name in m:
            kwargs[name] = s.dec(m[name], path)
        else:
            dflt = spec.defaults[name]
            if dflt is MISSING:
                raise ProtocolError(f"{spec.type} event is missing {name!r}")
            kwargs[name] = dflt()
    # Unknown keys are ignored: later v1 writers may add optional fields.
    if spec.cls is E.HelloEvent and kwargs["version"] != E.PROTOCOL_VERSION:
        raise ProtocolError(
            f"unsupported protocol version {kwargs['version']} (this build speaks {E.PROTOCOL_VERSION})"
        )
    try:
        return spec.cls(**kwargs)
    except Exception as e:  # pragma: no cover - dataclass construction cannot fail here
        raise ProtocolError(f"cannot build {spec.type} event: {e}") from None
