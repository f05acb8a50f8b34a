"""The stat-logger plugin runs inside vLLM's frontend: no config and no stats object may take vLLM down.

Configs and stats are trees of attributes drawn by hypothesis: values of any type, ints past int64,
NaN and infinities, huge strings, objects whose every attribute, ``__str__``, ``__bool__``, ``__int__``
or ``__class__`` raises, and attributes that raise when read. The constructor and ``record()`` never
raise, and every event the plugin hands its publisher encodes (so a watcher can read it).
"""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.vllm.inproc import plugin as P
from kvscope.protocol import transport
from kvscope.protocol.codec import decode, encode
from kvscope.protocol.events import PROTOCOL_VERSION, HelloEvent, StepEvent, engine_info
from tests.fakes import vllm_stats as S


class Boom(Exception):
    pass


class Untouchable:
    """Every attribute read raises, ``__class__`` included (so even isinstance() on it raises)."""

    def __getattribute__(self, name):
        raise Boom(name)


class Sly:
    """Reads fine; anything done with it raises."""

    def _raise(self, *a, **k):
        raise Boom("sly")

    __str__ = __repr__ = __bool__ = __int__ = __index__ = __float__ = __len__ = __iter__ = _raise
    __eq__ = __lt__ = __gt__ = __le__ = __ge__ = __getitem__ = _raise
    __hash__ = None


class SlyInt(int):
    def __int__(self):
        raise Boom("int")

    __index__ = __gt__ = __lt__ = __ge__ = __le__ = __float__ = __int__


class SlyStr(str):
    def __str__(self):
        raise Boom("str")

    __getitem__ = __len__ = __str__


class BadMessage(Exception):
    def __str__(self):
        raise Boom("the message itself")


class Raises:
    """A value slot that raises when read (a property that fails)."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc


class Node:
    """A config or stats object: attributes from a dict; a Raises slot raises when read; others are missing."""

    def __init__(self, values: dict) -> None:
        object.__setattr__(self, "_values", values)

    def __getattr__(self, name):
        values = object.__getattribute__(self, "_values")
        if name not in values:
            raise AttributeError(name)
        v = values[name]
        if isinstance(v, Raises):
            raise v.exc
        return v


CONFIG_FIELDS = {
    "scheduler_config": ["max_num_seqs", "max_num_batched_tokens", "enable_chunked_prefill", "policy", "scheduler_cls"],
    "cache_config": ["num_gpu_blocks", "block_size", "gpu_memory_utilization", "enable_prefix_caching", "cache_dtype"],
    "model_config": ["served_model_name", "model", "max_model_len"],
    "parallel_config": ["tensor_parallel_size"],
    "device_config": ["device_type", "device"],
}
STATS_FIELDS = ["num_running_reqs", "num_waiting_reqs", "num_skipped_waiting_reqs", "kv_cache_usage",
                "iteration_timestamp", "num_generation_tokens", "num_prompt_tokens", "num_preempted_reqs",
                "time_to_first_tokens_iter", "inter_token_latencies_iter", "elapsed_ms", "num_ctx_tokens",
                "e2e_latency", "decode_time", "max_tokens_param", "finish_reason"]

exceptions = st.sampled_from([RuntimeError("gone"), KeyError("k"), AttributeError("a"), TypeError("t"),
                              ValueError("v"), RecursionError("r"), ZeroDivisionError("z"), BadMessage()])
leaves = st.one_of(
    st.none(), st.booleans(),
    st.integers(min_value=-(1 << 80), max_value=1 << 80),
    st.sampled_from([0, 1, 2, 16, 4096, (1 << 63) - 1, 1 << 63, 1 << 64, -1]),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40), st.just("x" * 100_000), st.binary(max_size=8),
    st.builds(Untouchable), st.builds(Sly),
    st.sampled_from([SlyInt(5), SlyStr("cuda")]),
    exceptions.map(Raises),
    st.lists(st.integers(), max_size=3), st.just(["a", "b"]), st.just(()),
    st.builds(lambda: Node({})),
)


def node(fields) -> st.SearchStrategy:
    return st.fixed_dictionaries({}, optional={f: leaves for f in fields}).map(Node)


hostile_configs = st.one_of(
    leaves,
    st.fixed_dictionaries({}, optional={section: st.one_of(leaves, node(fields))
                                        for section, fields in CONFIG_FIELDS.items()}).map(Node),
)
stats_leaf = st.one_of(leaves, st.lists(st.one_of(leaves, node(STATS_FIELDS)), max_size=4))
hostile_stats = st.one_of(
    leaves,
    st.fixed_dictionaries({}, optional={**{f: stats_leaf for f in STATS_FIELDS},
                                        "iteration_details": st.one_of(leaves, node(STATS_FIELDS)),
                                        "prompt_token_stats": st.one_of(leaves, node(["computed"])),
                                        "finished_requests": st.lists(st.one_of(leaves, node(STATS_FIELDS)),
                                                                      max_size=3)}).map(Node),
)


class EncodingPublisher:
    """ZmqPublisher's face without a socket: every event is encoded, as its thread would."""

    def __init__(self, addr, queue_size=0, allow_remote=False) -> None:
        self.addr = addr
        self.events: list = []
        self.closed = False

    def publish(self, ev) -> None:
        self.events.append(decode(encode(ev)))

    def take_dropped(self) -> int:
        return 0

    def close(self, linger=0.0) -> None:
        self.closed = True


@pytest.fixture
def no_socket(monkeypatch):
    monkeypatch.setenv(P.ENV_ADDR, "tcp://127.0.0.1:0")
    monkeypatch.setattr(transport, "ZmqPublisher", EncodingPublisher)


@settings(max_examples=300, deadline=None)
@given(hostile_configs)
def test_engine_info_of_any_config_makes_a_hello_that_encodes(cfg):
    info = P.engine_info(cfg)
    assert info["engine"] == "vllm" and info["backend"] == P.BACKEND
    hello = decode(encode(HelloEvent(PROTOCOL_VERSION, engine_info(info), 0.0)))
    c = hello.config
    if c.num_blocks is not None:
        assert c.null_block == 0 and 2 <= c.num_blocks <= P.MAX_BLOCKS
    assert all(v is None or (isinstance(v, int) and 0 < v) for v in (c.max_num_seqs, c.max_model_len))


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cfg=hostile_configs, index=leaves, stats=st.lists(st.tuples(hostile_stats, hostile_stats), max_size=4))
def test_constructor_and_record_never_raise_and_every_event_encodes(no_socket, cfg, index, stats):
    logger = P.KvscopeStatLogger(cfg, index)
    try:
        for sched, it in stats:
            assert logger.record(sched, it) is None
        assert logger.record(S.SchedulerStats(num_running_reqs=3, kv_cache_usage=0.5), S.IterationStats()) is None
        assert logger.flush()
        pub = logger.publisher
        if pub is None:  # a config that names kvscope's watched scheduler: the plugin stands down
            assert logger.maker is None
            return
        assert logger.errors == 0, logger.last_error  # a stats field that raises or is garbage reads as 0
        steps = [e for e in pub.events if isinstance(e, StepEvent)]
        assert len(steps) == logger.recorded >= 1
        for ev in steps:
            kv = ev.kv
            assert kv.used + kv.free == kv.total and all(math.isfinite(x) for x in (ev.t, ev.dur))
        assert steps[-1].kv.used == round(0.5 * steps[-1].kv.total)
    finally:
        logger.close()


def test_a_config_whose_every_read_raises_still_starts(no_socket):
    logger = P.KvscopeStatLogger(Untouchable(), Untouchable())
    try:
        assert logger.publisher is not None and logger.errors == 0
        hello = logger.maker.hello
        assert hello.config.backend == P.BACKEND and hello.config.num_blocks is None
        assert logger.maker.blocks == P.KV_SCALE, "no pool size known: usage is shown over a fixed scale"
    finally:
        logger.close()


def test_a_failure_whose_message_raises_is_still_counted(monkeypatch, no_socket):
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    try:
        monkeypatch.setattr(logger.maker, "events", lambda *a: (_ for _ in ()).throw(BadMessage()))
        logger.record(S.SchedulerStats(), S.IterationStats())
        assert logger.flush()
        assert logger.errors == 1 and logger.last_error == "BadMessage"
    finally:
        logger.close()


def test_a_publisher_that_fails_to_start_leaves_no_thread(monkeypatch):
    import threading

    class Refusing(EncodingPublisher):
        def __init__(self, *a, **k):
            raise OSError("address in use")

    monkeypatch.setenv(P.ENV_ADDR, "tcp://127.0.0.1:5557")
    monkeypatch.setattr(transport, "ZmqPublisher", Refusing)
    before = threading.active_count()
    logger = P.KvscopeStatLogger(S.VllmConfig(), 0)
    assert logger.publisher is None and logger._queue is None and threading.active_count() == before
    assert logger.errors == 1 and "address in use" in logger.last_error
    assert logger.record(S.SchedulerStats(), S.IterationStats()) is None
    logger.close()
