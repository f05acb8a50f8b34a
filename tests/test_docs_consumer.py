"""Every engine's stream obeys docs/PROTOCOL.md as written: a consumer built from the document alone
(tests/docs_consumer.py: plain msgpack, its own block map) rebuilds every snapshot and checks every counter.

Streams: vLLM's own scheduler watched inside vLLM's engine-core loop (``WatchedScheduler``, with and
without async scheduling), vLLM's scheduler inside kvscope's engine (``--scheduler vllm``, recorded
to a trace and read back), and kvscope's own engine, all under preemption and prefix caching. For vLLM,
``kv.used / kv.total`` is vLLM's own ``KVCacheManager.usage`` (what ``vllm:kv_cache_usage_perc``
reports) at every step.
"""

from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvscope.protocol.codec import encode
from kvscope.protocol.sinks import FanOut
from tests.docs_consumer import DocsConsumer

vllm_sched = pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM's scheduler: make vllm")

from kvscope.engine.config import EngineConfig  # noqa: E402
from kvscope.engine.llm_engine import LLMEngine  # noqa: E402
from kvscope.serve.driver import ServeOptions, Server  # noqa: E402
from kvscope.traces.reader import TraceReader  # noqa: E402
from kvscope.traces.writer import TraceWriter  # noqa: E402
from tests.fakes.vllm_core import Core, build  # noqa: E402

WATCHED = "kvscope.vllm.inproc.watched.WatchedScheduler"


class Wire:
    """The watch's publisher without a socket: the bytes a subscriber would get."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []

    def publish(self, ev) -> None:
        self.frames.append(encode(ev))

    def take_dropped(self) -> int:
        return 0

    def close(self, linger: float = 0.0) -> None:
        pass


def _arrivals(core: Core, rng: random.Random, step: int, shared_share: float, until: int) -> None:
    if step % 5 == 0 and step < until:
        system = [11] * 40
        for _ in range(rng.randint(1, 4)):
            prefix = system if rng.random() < shared_share else []
            core.add(prefix + [rng.randint(1, 999) for _ in range(rng.choice([10, 40, 90, 250]))], rng.randint(2, 90))
    if step == 30 and core.sched.running:
        core.abort(core.sched.running[-1].request_id)


def run_watched(*, seed: int, num_blocks: int, max_num_seqs: int, budget: int, prefix_caching: bool,
                async_scheduling: bool, shared_share: float = 0.4, snapshot_every: int = 9):
    """vLLM's scheduler in its engine-core loop, watched; returns the consumer and the usage mismatches."""
    from kvscope.vllm.inproc import watched as vllm_watch

    old = vllm_watch.SNAPSHOT_EVERY
    vllm_watch.SNAPSHOT_EVERY = snapshot_every  # often: every snapshot is checked against the rebuilt map
    try:
        sched = build(WATCHED, num_blocks=num_blocks, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget,
                      prefix_caching=prefix_caching, async_scheduling=async_scheduling)
        wire = Wire()
        sched._kvscope = vllm_watch.Watch(sched, wire)
        core = Core(sched, batch_queue=2 if async_scheduling else 1)
        rng = random.Random(seed)
        consumer = DocsConsumer()
        usage_off = []
        for i in range(8000):  # the longest request (380 tokens) fits the smallest pool drawn (31 blocks)
            _arrivals(core, rng, i, shared_share, until=80)
            if not core.busy():
                break
            core.step()
            sched._kvscope.flush()  # the watch's thread has assembled and published the step
            steps = consumer.steps
            for frame in wire.frames:
                consumer.feed(frame)
            wire.frames.clear()
            if consumer.steps > steps:  # a step was published: its counters against vLLM's own usage
                kv = consumer.last_kv
                if abs(kv["used"] / kv["total"] - sched.kv_cache_manager.usage) > 1e-12:
                    usage_off.append((i, kv["used"], kv["total"], sched.kv_cache_manager.usage))
        assert not core.busy() and sched._kvscope.errors == 0, sched._kvscope.last_error
        return consumer, usage_off
    finally:
        vllm_watch.SNAPSHOT_EVERY = old


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["Scheduler", "AsyncScheduler"])
def test_watched_scheduler_stream_obeys_the_docs_under_preemption_and_prefix_caching(async_scheduling):
    consumer, usage_off = run_watched(seed=1, num_blocks=40, max_num_seqs=6, budget=96, prefix_caching=True,
                                      async_scheduling=async_scheduling)
    assert not consumer.mismatches, consumer.mismatches[:5]
    assert not usage_off, usage_off[:3]
    assert consumer.steps > 100 and consumer.snapshots > 10
    assert consumer.config["null_block"] == 0 and consumer.config["num_blocks"] == 40
    assert consumer.config["engine"] == "vllm" and consumer.config["device"] == "cpu"
    assert consumer.config["vllm_version"], "the hello names vLLM's version"
    assert consumer.seen["preemptions"] and consumer.seen["hits"] and consumer.seen["shared"], consumer.seen


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(seed=st.integers(0, 10_000), num_blocks=st.integers(32, 90), max_num_seqs=st.integers(2, 8),
       budget=st.sampled_from([64, 128, 256]), prefix_caching=st.booleans(), async_scheduling=st.booleans(),
       shared_share=st.floats(0, 1))
def test_watched_scheduler_stream_obeys_the_docs_for_any_load(seed, num_blocks, max_num_seqs, budget,
                                                               prefix_caching, async_scheduling, shared_share):
    consumer, usage_off = run_watched(seed=seed, num_blocks=num_blocks, max_num_seqs=max_num_seqs, budget=budget,
                                      prefix_caching=prefix_caching, async_scheduling=async_scheduling,
                                      shared_share=shared_share)
    assert not consumer.mismatches, consumer.mismatches[:5]
    assert not usage_off, usage_off[:3]


class UsageSink:
    """An engine sink: every event encoded, and at each step vLLM's own usage beside the step's counters."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.engine = None
        self.usage_off: list = []

    def publish(self, ev) -> None:
        self.frames.append(encode(ev))
        sched = getattr(self.engine, "scheduler", None)
        vllm = getattr(sched, "vllm", None)
        if ev.type == "step" and vllm is not None:
            usage = vllm.kv_cache_manager.usage
            if abs(ev.kv.used / ev.kv.total - usage) > 1e-12:
                self.usage_off.append((ev.step, ev.kv.used, ev.kv.total, usage))

    def take_dropped(self) -> int:
        return 0


def run_engine(tmp_path, *, scheduler: str, num_blocks: int, workload: str, prefix_caching: bool = True,
               preemption: str = "recompute", n: int = 24, seed: int = 0):
    """kvscope's engine (sim backend) recorded to a trace, and the trace read back as a subscriber's frames."""
    engine = LLMEngine(EngineConfig(backend="sim", model="llama-3.1-8b", gpu="h100-sxm5", scheduler=scheduler,
                                    num_blocks=num_blocks, max_num_seqs=16, max_num_batched_tokens=256,
                                    prefix_caching=prefix_caching, preemption=preemption), snapshot_every=11)
    path = tmp_path / f"{scheduler}-{workload}-{seed}.kvtrace"
    writer = TraceWriter(path, engine.hello(), snapshot_provider=engine.snapshot, chunk_steps=16)
    sink = UsageSink()
    sink.engine = engine
    engine.attach(FanOut([writer, sink]))
    Server(engine, ServeOptions(workload=workload, num_requests=n, seed=seed, verbose_rejects=False)).run()
    engine.close()
    writer.close()
    reader = TraceReader(path)
    frames = [encode(reader.hello)] + [encode(ev) for ev in reader]
    return frames, sink


@pytest.mark.parametrize("workload", ["shared-prefix", "burst"])
def test_scheduler_vllm_trace_obeys_the_docs(tmp_path, workload):
    frames, sink = run_engine(tmp_path, scheduler="vllm", num_blocks=40, workload=workload)
    consumer = DocsConsumer()
    for frame in frames:
        consumer.feed(frame)
    assert not consumer.mismatches, consumer.mismatches[:5]
    assert not sink.usage_off, sink.usage_off[:3]
    cfg = consumer.config
    assert (cfg["engine"], cfg["scheduler"], cfg["null_block"], cfg["num_blocks"]) == ("kvscope", "vllm", 0, 40)
    assert consumer.steps > 50 and consumer.snapshots > 3
    assert consumer.seen["preemptions"] and consumer.seen["hits"], consumer.seen


@pytest.mark.parametrize("preemption", ["recompute", "swap"])
def test_kvscope_engine_trace_obeys_the_docs(tmp_path, preemption):
    frames, _ = run_engine(tmp_path, scheduler="kvscope", num_blocks=40, workload="shared-prefix",
                           preemption=preemption)
    consumer = DocsConsumer()
    for frame in frames:
        consumer.feed(frame)
    assert not consumer.mismatches, consumer.mismatches[:5]
    cfg = consumer.config
    assert cfg["engine"] == "kvscope" and "null_block" not in cfg and cfg["num_blocks"] == 40
    assert consumer.seen["preemptions"] and consumer.seen["hits"], consumer.seen


@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture,
                                                                  HealthCheck.too_slow])
@given(scheduler=st.sampled_from(["kvscope", "vllm"]), num_blocks=st.integers(24, 64),
       workload=st.sampled_from(["chat", "mixed", "burst", "shared-prefix"]), prefix_caching=st.booleans(),
       seed=st.integers(0, 1000))
def test_engine_traces_obey_the_docs_for_any_load(tmp_path, scheduler, num_blocks, workload, prefix_caching, seed):
    frames, sink = run_engine(tmp_path, scheduler=scheduler, num_blocks=num_blocks, workload=workload,
                              prefix_caching=prefix_caching, n=16, seed=seed)
    consumer = DocsConsumer()
    for frame in frames:
        consumer.feed(frame)
    assert not consumer.mismatches, consumer.mismatches[:5]
    assert not sink.usage_off, sink.usage_off[:3]


def test_the_consumer_finds_a_counter_off_by_the_null_block():
    """The rule the consumer checks is the one vLLM streams broke before: a total that counts vLLM's null
    block leaves used + free one short."""
    consumer, _ = run_watched(seed=2, num_blocks=32, max_num_seqs=4, budget=64, prefix_caching=True,
                              async_scheduling=False)
    assert not consumer.mismatches
    frames = []
    from kvscope.protocol.codec import decode

    from kvscope.vllm.inproc import watched as vllm_watch

    sched = build(WATCHED, num_blocks=32, max_num_seqs=4, max_num_batched_tokens=64)
    wire = Wire()
    sched._kvscope = vllm_watch.Watch(sched, wire)
    core = Core(sched)
    core.add(list(range(1, 60)), 4)
    while core.busy():
        core.step()
    sched._kvscope.flush()
    for frame in wire.frames:
        ev = decode(frame)
        if ev.type in ("step", "snapshot"):
            ev.kv.total += 1  # what the stream said before the rule
        frames.append(encode(ev))
    wrong = DocsConsumer()
    for frame in frames:
        wrong.feed(frame)
    assert any("used + free = total" in m for m in wrong.mismatches)
    assert any("num_blocks - (1 if null_block)" in m for m in wrong.mismatches)
