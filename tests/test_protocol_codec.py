"""Codec: round trips of every event type, strict validation, decoder fuzzing."""

from __future__ import annotations

import math
import subprocess
import sys

import msgpack
import msgspec
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.protocol import (
    PROTOCOL_VERSION,
    Admission,
    BatchEntry,
    BlockAlloc,
    BlockOwner,
    ByeEvent,
    Finish,
    FirstToken,
    HelloEvent,
    ItlSample,
    KvCounters,
    Preemption,
    PrefixHit,
    ProtocolError,
    RefChange,
    RejectEvent,
    RequestEvent,
    RequestState,
    SnapshotEvent,
    StepEvent,
    Swap,
    decode,
    encode,
)
from kvscope.protocol import events as E

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- strategies

u = st.integers(0, 2**63 - 1)
small_u = st.integers(0, 10_000)
i64 = st.integers(-(2**63), 2**63 - 1)
req = st.one_of(st.integers(0, 1000), i64)
fl = st.floats(allow_nan=False, allow_infinity=False)
name = st.text(max_size=30)
short_list = lambda s: st.lists(s, max_size=6)  # noqa: E731

kv = st.builds(KvCounters, *([u] * 13))
batch_entry = st.builds(BatchEntry, req, st.sampled_from([E.PREFILL, E.DECODE]), small_u, small_u)
admission = st.builds(
    Admission,
    st.sampled_from([E.VERDICT_ADMITTED, E.VERDICT_BLOCKED, E.VERDICT_IDLE]),
    st.one_of(st.none(), st.sampled_from(E.BLOCK_REASONS), name),
    st.one_of(st.none(), req),
)
json_leaf = st.one_of(st.none(), st.booleans(), i64, st.floats(), st.text(max_size=20))
json = st.recursive(
    json_leaf,
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=8), c, max_size=4)),
    max_leaves=12,
)

engine_info = st.builds(
    E.EngineInfo,
    model=name,
    backend=st.sampled_from(["model", "sim"]),
    mode=st.sampled_from(["naive", "static", "continuous", "chunked"]),
    block_size=st.integers(1, 1024),
    num_blocks=st.one_of(st.none(), small_u),
    max_num_seqs=st.one_of(st.none(), small_u),
    prefix_caching=st.booleans(),
    swap_space=st.one_of(st.none(), fl),
    sim=st.one_of(st.none(), st.builds(
        E.SimInfo,
        gpu=st.one_of(st.just(msgspec.UNSET), name),
        efficiency=st.one_of(st.just(msgspec.UNSET), st.none(), st.dictionaries(name, fl, max_size=4)),
    )),
    cpu=st.one_of(st.none(), st.builds(E.CpuInfo, threads=st.one_of(st.just(msgspec.UNSET), st.none(), small_u))),
)
hello = st.builds(HelloEvent, st.just(PROTOCOL_VERSION), engine_info, fl)
request = st.builds(RequestEvent, req, small_u, small_u, i64, fl)
reject = st.builds(RejectEvent, req, name, fl)
step = st.builds(
    StepEvent,
    i64,
    fl,
    fl,
    small_u,
    batch=short_list(batch_entry),
    padding=small_u,
    running=short_list(req),
    waiting=short_list(req),
    preempted=short_list(req),
    swapped=short_list(req),
    admission=admission,
    preemptions=short_list(st.builds(Preemption, req, name, st.sampled_from(["recompute", "swap"]))),
    alloc=short_list(st.builds(BlockAlloc, small_u, req)),
    freed=short_list(small_u),
    refs=short_list(st.builds(RefChange, small_u, small_u)),
    sampled=short_list(req),
    first_tokens=short_list(st.builds(FirstToken, req, fl)),
    finished=short_list(st.builds(Finish, req, fl, fl, small_u, name)),
    itl=short_list(st.builds(ItlSample, req, fl)),
    kv=kv,
    dropped=small_u,
    hits=short_list(st.builds(PrefixHit, req, small_u, small_u)),
    swaps=short_list(st.builds(Swap, req, st.sampled_from([E.SWAP_OUT, E.SWAP_IN]), small_u)),
)
request_state = st.builds(
    RequestState,
    req,
    st.sampled_from(E.REQUEST_STATES),
    small_u,
    small_u,
    small_u,
    small_u,
    i64,
    fl,
    st.one_of(st.none(), fl),
    small_u,
    small_u,
)
snapshot = st.builds(
    SnapshotEvent,
    i64,
    fl,
    requests=short_list(request_state),
    blocks=short_list(st.builds(BlockOwner, small_u, req, small_u)),
    block_tables=st.dictionaries(req, short_list(small_u), max_size=4),
    running=short_list(req),
    waiting=short_list(req),
    preempted=short_list(req),
    swapped=short_list(req),
    kv=kv,
)
bye = st.builds(ByeEvent, i64, fl, name)
any_event = st.one_of(hello, request, reject, step, snapshot, bye)

STRATEGIES = {"hello": hello, "request": request, "reject": reject, "step": step, "snapshot": snapshot, "bye": bye}


# ----------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("kind", sorted(STRATEGIES))
def test_round_trip_every_event_type(kind):
    @settings(max_examples=60, deadline=None)
    @given(STRATEGIES[kind])
    def check(ev):
        data = encode(ev)
        back = decode(data)
        assert type(back) is type(ev)
        assert back.type == kind
        assert back == ev
        assert encode(back) == data

    check()


def test_wire_form_is_plain_msgpack():
    ev = StepEvent(
        7, 1.5, 0.01, 512, batch=[BatchEntry(3, E.DECODE, 1, 40)], alloc=[BlockAlloc(9, 3)], kv=KvCounters(total=4)
    )
    m = msgpack.unpackb(encode(ev), raw=False, strict_map_key=True, max_ext_len=0, max_bin_len=0)
    assert m["type"] == "step"
    assert m["batch"] == [[3, "decode", 1, 40]]  # nested records are positional arrays
    assert m["alloc"] == [[9, 3]]
    assert m["admission"] == ["idle", None, None]
    assert m["kv"] == [4, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]
    assert m["hits"] == [] and m["swaps"] == []
    snap = SnapshotEvent(1, 0.0, block_tables={5: [1, 2]})
    assert msgpack.unpackb(encode(snap), raw=False)["block_tables"] == [[5, [1, 2]]]


def test_encode_accepts_int_like_scalars_and_tuples():
    class Idx:
        def __index__(self):
            return 3

    ev = StepEvent(Idx(), 0, 0.0, 1, running=(1, 2))
    back = decode(encode(ev))
    assert back.step == 3 and back.running == [1, 2] and back.t == 0.0


def test_encode_refuses_non_events_and_garbage_fields():
    with pytest.raises(ProtocolError):
        encode({"type": "step"})
    with pytest.raises(ProtocolError):
        encode(RejectEvent(1, object(), 0.0))


def test_missing_defaults_and_unknown_keys():
    # Optional fields may be left out; unknown keys (added later in v1) are ignored.
    data = msgpack.packb({"type": "step", "step": 1, "t": 0.0, "dur": 0.0, "budget": 8, "future": [1, 2]})
    ev = decode(data)
    assert ev == StepEvent(1, 0.0, 0.0, 8)
    # Nested records: missing trailing fields with defaults are filled, extra ones ignored.
    data = msgpack.packb(
        {"type": "step", "step": 1, "t": 0.0, "dur": 0.0, "budget": 8, "admission": ["blocked"],
         "preemptions": [[4, "kv_blocks"]], "kv": list(range(1, 15))}
    )
    ev = decode(data)
    assert ev.admission == Admission("blocked") and ev.preemptions == [Preemption(4, "kv_blocks", "recompute")]
    assert ev.kv == KvCounters(*range(1, 14))
    # A stream written before prefix caching and swapping: 8 counters, no hits/swaps keys.
    ev = decode(_step(kv=list(range(1, 9))))
    assert ev.kv == KvCounters(*range(1, 9)) and ev.kv.hit_tokens == 0 and ev.hits == [] and ev.swaps == []
    ev = decode(msgpack.packb({"type": "snapshot", "step": 1, "t": 0.0,
                               "requests": [[1, "swapped", 1, 1, 0, 0, 0, 0.0, None, 0]]}))
    assert ev.requests[0].cached_tokens == 0 and ev.requests[0].state == "swapped"


def _step(**over):
    m = {"type": "step", "step": 1, "t": 0.0, "dur": 0.0, "budget": 8}
    m.update(over)
    return msgpack.packb(m, use_bin_type=True)


BAD = {
    "empty": b"",
    "not msgpack": b"\xc1",
    "trailing bytes": msgpack.packb({"type": "bye", "step": 1, "t": 0.0}) + b"\x00",
    "not a map": msgpack.packb([1, 2, 3]),
    "no type": msgpack.packb({"step": 1}),
    "unknown type": msgpack.packb({"type": "nope"}),
    "type not str": msgpack.packb({"type": 5}),
    "missing field": msgpack.packb({"type": "bye", "step": 1}),
    "bool as int": _step(step=True),
    "float as int": _step(step=1.0),
    "str as float": _step(t="0"),
    "nan": _step(t=math.nan),
    "inf": _step(dur=math.inf),
    "int too big": _step(step=2**64 - 1),
    "negative count": _step(budget=-1),
    "bad kind": _step(batch=[[1, "chunk", 1, 0]]),
    "bad verdict": _step(admission=["maybe", None, None]),
    "bad swap direction": _step(swaps=[[1, "sideways", 2]]),
    "negative hit": _step(hits=[[1, -3, 1]]),
    "short record": _step(batch=[[1, "decode"]]),
    "record not array": _step(batch=[{"req": 1}]),
    "list not array": _step(running=5),
    "list item": _step(running=["a"]),
    "kv not array": _step(kv={"total": 1}),
    "long string": msgpack.packb({"type": "bye", "step": 1, "t": 0.0, "reason": "x" * 5000}),
    "bin": msgpack.packb({"type": "bye", "step": 1, "t": 0.0, "reason": b"x"}, use_bin_type=True),
    "ext": msgpack.packb({"type": "bye", "step": 1, "t": 0.0, "reason": msgpack.ExtType(1, b"x")}),
    "int map key": msgpack.packb({"type": "hello", "version": 1, "config": {1: 2}, "wall_start": 0.0}),
    "bad utf8": b"\x81\xa4type\xa2\xff\xfe",
    "wrong version": msgpack.packb({"type": "hello", "version": 2, "config": {}, "wall_start": 0.0}),
    "config not map": msgpack.packb({"type": "hello", "version": 1, "config": [], "wall_start": 0.0}),
    "config value of the wrong type": msgpack.packb(
        {"type": "hello", "version": 1, "config": {"num_blocks": "4096"}, "wall_start": 0.0}
    ),
    "config block_size 0": msgpack.packb({"type": "hello", "version": 1, "config": {"block_size": 0},
                                          "wall_start": 0.0}),
    "unknown key nested too deep": msgpack.packb(
        {"type": "hello", "version": 1, "config": {"future": [[[[[[[[[[[[[[[[1]]]]]]]]]]]]]]]]}, "wall_start": 0.0}
    ),
    "bad state": msgpack.packb(
        {"type": "snapshot", "step": 1, "t": 0.0, "requests": [[1, "zombie", 1, 1, 0, 0, 0, 0.0, None, 0]]}
    ),
    "dup block table": msgpack.packb({"type": "snapshot", "step": 1, "t": 0.0, "block_tables": [[1, []], [1, []]]}),
    "bad block table": msgpack.packb({"type": "snapshot", "step": 1, "t": 0.0, "block_tables": {"1": [2]}}),
    "huge array header": b"\x81\xa4type\xdd\xff\xff\xff\xff",
    "huge map header": b"\xdf\xff\xff\xff\xff",
    "deep nesting": b"\x91" * 100_000,
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_decoder_rejects(case):
    with pytest.raises(ProtocolError):
        decode(BAD[case])


def test_decoder_rejects_non_bytes_and_oversize():
    with pytest.raises(ProtocolError):
        decode("a string")  # type: ignore[arg-type]
    data = encode(StepEvent(1, 0.0, 0.0, 1, running=list(range(1000))))
    assert decode(data, max_size=len(data)).running[-1] == 999
    with pytest.raises(ProtocolError, match="limit"):
        decode(data, max_size=len(data) - 1)


def test_protocol_error_is_a_value_error():
    assert issubclass(ProtocolError, ValueError)


# ----------------------------------------------------------------------------- fuzzing


def _decode_or_protocol_error(data):
    try:
        ev = decode(data)
    except ProtocolError:
        return None
    assert ev.type in E.EVENT_TYPES
    encode(ev)  # whatever decodes must also encode
    return ev


@FUZZ
@given(st.binary(max_size=300))
def test_fuzz_random_bytes(data):
    _decode_or_protocol_error(data)


@FUZZ
@given(any_event, st.data())
def test_fuzz_truncated_and_bit_flipped(ev, data):
    raw = encode(ev)
    cut = data.draw(st.integers(0, len(raw)))
    _decode_or_protocol_error(raw[:cut])
    flipped = bytearray(raw)
    for _ in range(data.draw(st.integers(1, 4))):
        pos = data.draw(st.integers(0, len(raw) - 1))
        flipped[pos] ^= 1 << data.draw(st.integers(0, 7))
    _decode_or_protocol_error(bytes(flipped))


msgpack_value = st.recursive(
    st.one_of(st.none(), st.booleans(), st.integers(-(2**63), 2**64 - 1),
              st.floats(), st.text(max_size=10)),
    lambda c: st.one_of(st.lists(c, max_size=4), st.dictionaries(st.text(max_size=6), c, max_size=4)),
    max_leaves=10,
)


@FUZZ
@given(any_event, st.data())
def test_fuzz_field_replaced_with_random_value(ev, data):
    m = msgpack.unpackb(encode(ev), raw=False)
    key = data.draw(st.sampled_from(sorted(m)))
    m[key] = data.draw(msgpack_value)
    _decode_or_protocol_error(msgpack.packb(m, use_bin_type=True))


def test_protocol_imports_without_zmq_torch_textual():
    code = (
        "import sys\n"
        "for m in ('zmq', 'torch', 'textual'):\n"
        "    sys.modules[m] = None  # any import of them now fails\n"
        "import kvscope.protocol, kvscope.traces, kvscope.protocol.transport\n"
        "from kvscope.protocol import decode, encode, ByeEvent\n"
        "from kvscope.protocol.transport import check_bind_address\n"
        "check_bind_address('tcp://127.0.0.1:1', False)\n"
        "assert decode(encode(ByeEvent(1, 0.0))).step == 1\n"
        "assert 'kvscope.engine' not in sys.modules and 'kvscope.tui' not in sys.modules\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_ints_in_float_fields_become_floats_and_errors_name_the_field():
    ev = decode(_step(itl=[[1, 2], [2, 0.5]], first_tokens=[[3, 1]]))
    assert ev.itl[0].gap == 2.0 and type(ev.itl[0].gap) is float and ev.first_tokens[0].ttft == 1.0
    snap = decode(msgpack.packb({"type": "snapshot", "step": 1, "t": 0, "requests": [
        [1, "running", 1, 1, 0, 0, 0, 0.0, None, 0], [2, "waiting", 1, 1, 0, 0, 0, 1, 3, 0]]}))
    assert snap.requests[1].ttft == 3.0 and type(snap.requests[1].arrival) is float and snap.t == 0.0
    with pytest.raises(ProtocolError, match=r"step event: .* at `\$\.batch\[1\]\[2\]`"):
        decode(_step(batch=[[1, "decode", 1, 0], [2, "decode", -1, 0]]))
    with pytest.raises(ProtocolError, match=r"step event: .*\$\.running\[2\]"):
        decode(_step(running=[1, 2, None]))
