"""The watched scheduler against vLLM's real classes, in-process on this CPU.

vLLM's Scheduler and AsyncScheduler are built as vLLM's engine core builds them, from a VllmConfig
naming ``kvscope.vllm.inproc.watched.WatchedScheduler`` in ``scheduler_cls``
(tests/fakes/vllm_core.py), and driven through the engine core's loop with ModelRunnerOutputs. A
consumer written from docs/PROTOCOL.md (the codec's bytes, BlockMap's rule, the step's queues)
must rebuild vLLM's own block tables and queues after every step.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM's scheduler is not installed (make vllm)")

from kvscope.protocol.blockmap import BlockMap  # noqa: E402
from kvscope.protocol.codec import decode, encode  # noqa: E402
from kvscope.protocol.events import HelloEvent, RequestEvent, SnapshotEvent, StepEvent  # noqa: E402
from tests.fakes.vllm_core import Core, build  # noqa: E402

WATCHED = "kvscope.vllm.inproc.watched.WatchedScheduler"


class WirePublisher:
    """What ZmqPublisher does with an event, minus the socket: encode it (the bytes a watcher gets)."""

    def __init__(self) -> None:
        self.frames: list[bytes] = []
        self.dropped = 0

    def publish(self, ev) -> None:
        self.frames.append(encode(ev))

    def take_dropped(self) -> int:
        n, self.dropped = self.dropped, 0
        return n

    def close(self, linger: float = 0.0) -> None:
        pass


class Consumer:
    """A watcher per docs/PROTOCOL.md: decode each frame; a snapshot replaces the state, a step applies its
    deltas (kvscope.protocol.blockmap, the one block-map rule) and carries the queues."""

    def __init__(self) -> None:
        self.map: BlockMap | None = None
        self.queues: tuple[list[int], list[int], list[int]] | None = None
        self.hello: HelloEvent | None = None
        self.steps: list[StepEvent] = []
        self.requests: dict[int, RequestEvent] = {}
        self.snapshots = 0
        self.events: list = []

    def feed(self, frames: list[bytes]) -> None:
        for data in frames:
            ev = decode(data)
            self.events.append(ev)
            if isinstance(ev, SnapshotEvent):
                self.map = BlockMap.from_snapshot(ev)
                self.queues = (list(ev.running), list(ev.waiting), list(ev.preempted))
                self.snapshots += 1
            elif isinstance(ev, StepEvent):
                assert self.map is not None, "a step before any snapshot"
                self.map.apply_step(ev)
                self.queues = (list(ev.running), list(ev.waiting), list(ev.preempted))
                self.steps.append(ev)
            elif isinstance(ev, HelloEvent):
                self.hello = ev
            elif isinstance(ev, RequestEvent):
                self.requests[ev.req] = ev
        frames.clear()

    def tables(self) -> dict[int, list[int]]:
        return {r: t for r, t in (self.map.tables or {}).items() if t}


def vllm_truth(sched, ids) -> tuple[dict[int, list[int]], tuple[list[int], list[int], list[int]]]:
    """vLLM's own block tables (physical ids) and queues, under the protocol's ids."""
    mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
    tables = {}
    for vid, blocks in mgr.req_to_blocks.items():
        got = [b.block_id for b in blocks if not b.is_null]
        if got:
            tables[ids(vid)] = got
    waiting = [*getattr(sched, "kv_holding_waiting", ()), *sched.waiting]
    return tables, ([ids(r.request_id) for r in sched.running],
                    [ids(r.request_id) for r in waiting if r.status.name != "PREEMPTED"],
                    [ids(r.request_id) for r in waiting if r.status.name == "PREEMPTED"])


def vllm_blocks(sched) -> tuple[dict[int, int], set[int]]:
    """vLLM's refcount of every held block, and its free blocks that still hold a cached prefix."""
    refs, cached = {}, set()
    for blk in sched.kv_cache_manager.block_pool.blocks:
        if blk.is_null:
            continue
        if blk.ref_cnt > 0:
            refs[blk.block_id] = blk.ref_cnt
        elif blk.block_hash is not None:
            cached.add(blk.block_id)
    return refs, cached


def watched(**kw):
    """A watched scheduler built by vLLM's path, with its watch publishing to a WirePublisher."""
    from kvscope.vllm.inproc.watched import Watch

    sched = build(WATCHED, **kw)
    pub = WirePublisher()
    sched._kvscope = Watch(sched, pub)
    return sched, pub


def workload(core: Core, rng: random.Random, step: int) -> None:
    """Arrivals in bursts, a shared system prompt on a third of them, long prompts now and then, an abort."""
    if step % 7 == 0 and step < 120:
        for _ in range(rng.randint(1, 4)):
            shared = [11] * 48 if rng.random() < 0.35 else []
            n = rng.choice([20, 60, 150, 400]) if rng.random() < 0.9 else 500
            core.add(shared + [rng.randint(1, 999) for _ in range(n)], rng.randint(4, 40))
    if step == 40 and core.sched.running:
        core.abort(core.sched.running[-1].request_id)


def drive(sched, pub, *, batch_queue: int, check_every_step: bool = True, steps: int = 3000, seed: int = 0):
    core = Core(sched, batch_queue=batch_queue)
    rng = random.Random(seed)
    consumer = Consumer()
    checked = 0
    for i in range(steps):
        workload(core, rng, i)
        if not core.busy():
            break
        core.step()
        sched._kvscope.flush()  # the watch's thread has assembled and published the step
        published = len(consumer.steps)
        consumer.feed(pub.frames)
        # (with async scheduling the first iteration only schedules: no step is published, vLLM is mid-step)
        if check_every_step and len(consumer.steps) > published:
            tables, queues = vllm_truth(sched, sched._kvscope.builder.ids)
            assert consumer.tables() == tables, f"step {i}: block tables differ"
            assert consumer.queues == queues, f"step {i}: queues differ"
            refs, cached = vllm_blocks(sched)
            m = consumer.map
            assert {b: c for b, c in enumerate(m.refcount) if c > 0} == refs, f"step {i}: refcounts differ"
            assert {b for b, c in enumerate(m.cached) if c} == cached, f"step {i}: cached blocks differ"
            checked += 1
    return core, consumer, checked


@pytest.mark.parametrize("async_scheduling", [False, True, None], ids=["Scheduler", "AsyncScheduler", "vLLM-default"])
def test_vllm_config_names_the_watched_class_and_vllm_builds_it(async_scheduling):
    """vLLM's default (async_scheduling None) is resolved by VllmConfig to on, unless something forbids it; the
    engine core then runs two batches in flight, and the watched class is an AsyncScheduler, as vLLM's own."""
    from vllm.v1.core.sched.async_scheduler import AsyncScheduler
    from vllm.v1.core.sched.scheduler import Scheduler

    from kvscope.vllm.inproc.watched import WatchedAsyncScheduler, WatchedScheduler

    sched = build(WATCHED, async_scheduling=async_scheduling)
    on = sched.vllm_config.scheduler_config.async_scheduling
    assert on == (async_scheduling is not False)
    assert (sched.vllm_config.max_concurrent_batches == 2) == on
    assert isinstance(sched, WatchedScheduler)
    assert isinstance(sched, AsyncScheduler) == on, "the same choice vLLM makes for its own class"
    assert (type(sched) is WatchedAsyncScheduler) == on
    assert type(build(None, async_scheduling=async_scheduling)) is (AsyncScheduler if on else Scheduler)
    assert sched._kvscope is None, "without KVSCOPE_VLLM_PUBLISH nothing is built"
    explicit = build("kvscope.vllm.inproc.watched.WatchedAsyncScheduler", async_scheduling=True)
    assert type(explicit) is WatchedAsyncScheduler


@pytest.mark.parametrize("batch_queue,async_scheduling", [(1, False), (2, True)], ids=["Scheduler", "AsyncScheduler"])
def test_events_rebuild_vllms_block_tables_and_queues_at_every_step(batch_queue, async_scheduling):
    """Small pool (preemptions), small budget (chunked prefills), shared prefixes (hits), an abort."""
    sched, pub = watched(num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128,
                         async_scheduling=async_scheduling)
    core, consumer, checked = drive(sched, pub, batch_queue=batch_queue)
    assert checked > 100 and not core.busy()
    assert sched._kvscope.errors == 0
    steps = consumer.steps
    assert any(s.preemptions for s in steps), "the pool is small enough to preempt"
    assert any(s.hits for s in steps), "shared prompts hit vLLM's prefix cache"
    assert any(e.kind == "prefill" and e.start > 0 for s in steps for e in s.batch), "chunked prefills"
    assert any(s.admission.verdict == "blocked" for s in steps)
    finished = [f for s in steps for f in s.finished]
    assert len(finished) == len(consumer.requests) and any(f.reason == "abort" for f in finished)
    assert all(f.e2e >= f.ttft >= 0 for f in finished)
    assert consumer.hello.config.backend == "vllm-scheduler" and consumer.hello.config.max_num_seqs == 6
    assert consumer.tables() == {} and sched.kv_cache_manager.block_pool.get_num_free_blocks() == 47


def test_the_watch_changes_no_decision():
    """The same requests through vLLM's own Scheduler and the watched one: every step's scheduled tokens,
    preemptions and block tables are the same."""
    def trace(sched):
        core = Core(sched)
        rng = random.Random(3)
        seen = []
        mgr = sched.kv_cache_manager.coordinator.single_type_managers[0]
        for i in range(3000):
            workload(core, rng, i)
            if not core.busy():
                break
            core.step()
            seen.append((sorted(core.inflight[0][0].num_scheduled_tokens.items()) if core.inflight else None,
                         sorted((k, [b.block_id for b in v]) for k, v in mgr.req_to_blocks.items())))
        return seen, core.finished

    kw = dict(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=128)
    plain = trace(build(None, **kw))
    sched, _ = watched(**kw)
    assert trace(sched) == plain


class RaisingPublisher(WirePublisher):
    def publish(self, ev) -> None:
        raise RuntimeError("the socket is gone")


def test_a_publisher_that_raises_never_reaches_vllm():
    from kvscope.vllm.inproc.watched import Watch

    sched = build(WATCHED, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128)
    sched._kvscope = Watch(sched, RaisingPublisher())
    core, _, _ = drive(sched, WirePublisher(), batch_queue=1, check_every_step=False)
    assert not core.busy() and len(core.finished) > 20
    assert sched._kvscope.errors > 0 and "socket is gone" in sched._kvscope.last_error


class DroppingPublisher(WirePublisher):
    """Loses every event from the 30th to the 60th, and says so, as ZmqPublisher does on a full queue."""

    def __init__(self) -> None:
        super().__init__()
        self.n = 0

    def publish(self, ev) -> None:
        self.n += 1
        if 30 <= self.n < 60:
            self.dropped += 1
            return
        super().publish(ev)


def test_dropped_events_are_counted_and_a_snapshot_resyncs_the_watcher():
    from kvscope.vllm.inproc.watched import Watch

    sched = build(WATCHED, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128)
    pub = DroppingPublisher()
    sched._kvscope = Watch(sched, pub)
    core = Core(sched)
    rng = random.Random(1)
    consumer = Consumer()
    after_drop = None
    for i in range(3000):
        workload(core, rng, i)
        if not core.busy():
            break
        core.step()
        sched._kvscope.flush()
        before = consumer.snapshots
        consumer.feed(pub.frames)
        if after_drop is None and consumer.steps and consumer.steps[-1].dropped:
            after_drop = i
            assert consumer.snapshots > before, "the step that reports the drop comes after a fresh snapshot"
        if after_drop is not None:
            tables, queues = vllm_truth(sched, sched._kvscope.builder.ids)
            assert consumer.tables() == tables and consumer.queues == queues
    # a step that carried a count can itself be lost: the watch's total has them all
    assert after_drop is not None and 0 < sum(s.dropped for s in consumer.steps) <= 30
    assert sched._kvscope.dropped == 30


def test_over_zmq_from_the_variable_as_record_and_tui_connect(monkeypatch):
    """KVSCOPE_VLLM_PUBLISH binds a PUB socket; a kvscope Subscriber (what `record --connect` and
    `tui --connect` use) gets the hello, a snapshot and the steps. The stat-logger plugin stands down."""
    import socket
    import time

    from kvscope.vllm.inproc.plugin import KvscopeStatLogger
    from kvscope.protocol.pubsub import Subscriber

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    addr = f"tcp://127.0.0.1:{port}"
    monkeypatch.setenv("KVSCOPE_VLLM_PUBLISH", addr)
    sched = build(WATCHED, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128)
    assert sched._kvscope is not None
    plugin = KvscopeStatLogger(sched.vllm_config)
    assert plugin.publisher is None, "the scheduler publishes; the plugin must not bind the same address"
    sub = Subscriber(addr)
    try:
        time.sleep(0.3)  # the slow-joiner: let the subscription reach the publisher
        core = Core(sched)
        rng = random.Random(2)
        got = []

        def drain(wait_ms: int = 0) -> None:  # read as a watcher does, while vLLM runs
            while (ev := sub.recv(timeout_ms=wait_ms)) is not None:
                got.append(ev)

        for i in range(3000):
            workload(core, rng, i)
            if not core.busy():
                break
            core.step()
            time.sleep(0.002)  # an engine step takes a while
            drain()
        sched.shutdown()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not (got and got[-1].type == "bye"):
            drain(200)
        kinds = {e.type for e in got}
        assert sub.malformed == 0, sub.last_error
        assert {"hello", "snapshot", "step", "request", "bye"} <= kinds
        assert sum(e.type == "step" for e in got) > 50
    finally:
        sub.close()


def test_a_recording_of_the_watched_scheduler_replays_and_diagnoses(tmp_path):
    """The events written by kvscope's TraceWriter (what `record --connect` does) read back, and diagnose
    answers in vLLM's flags."""
    from kvscope.analysis.diagnose import diagnose_trace
    from kvscope.traces.reader import TraceReader
    from kvscope.traces.writer import TraceWriter

    sched, pub = watched(num_blocks=40, max_num_seqs=6, max_num_batched_tokens=128)
    _, consumer, _ = drive(sched, pub, batch_queue=1, check_every_step=False)
    frames = consumer.events
    hello = next(e for e in frames if isinstance(e, HelloEvent))
    path = tmp_path / "watched.kvtrace"
    w = TraceWriter(path, hello)
    for ev in frames:
        if not isinstance(ev, HelloEvent):
            w.publish(ev)
    w.close()
    steps = [e for e in TraceReader(path) if isinstance(e, StepEvent)]
    assert len(steps) == sum(isinstance(e, StepEvent) for e in frames)
    import vllm

    from kvscope.traces.info import trace_info

    info = trace_info(path)  # the engine, its scheduler, vLLM's version and the device vLLM ran on
    assert f"engine:     vLLM {vllm.__version__} (its scheduler watched from inside) on cpu" in info, info
    assert "null_block=0" in info and "num_blocks=40" in info
    d = diagnose_trace(str(path), what_if=False)
    assert d.bottleneck == "kv_capacity", d.bottleneck
    assert d.knobs and not any(k.flag.startswith(("--mode", "--num-blocks")) for k in d.knobs)


def test_the_dashboard_replays_the_watched_scheduler_block_by_block():
    """The TUI's replay of the watched scheduler's events: at a step mid-run its state (queues with vLLM's
    requests, the block map's tables) is what vLLM's scheduler held when that step was published."""
    import asyncio

    from tests.fakes.sources import MemoryTrace
    from kvscope.tui.app import KvscopeApp
    from kvscope.tui.feeds import ReplayFeed
    from kvscope.tui.model.player import Player
    from kvscope.tui.sources.replay import ReplayController
    from kvscope.tui.widgets import BlockMap as BlockMapWidget

    sched, pub = watched(num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128)
    core = Core(sched)
    rng = random.Random(5)
    consumer = Consumer()
    truth = {}
    for i in range(3000):
        workload(core, rng, i)
        if not core.busy():
            break
        core.step()
        sched._kvscope.flush()
        consumer.feed(pub.frames)
        if consumer.steps:
            truth[consumer.steps[-1].step] = vllm_truth(sched, sched._kvscope.builder.ids)
    mid = sorted(s for s, (tables, q) in truth.items() if len(tables) >= 3 and q[1])[0]

    async def run():
        clock = lambda: 100.0  # noqa: E731 - a frozen clock: the test moves the player
        rc = ReplayController(MemoryTrace(consumer.events), playing=False, clock=clock)
        app = KvscopeApp([ReplayFeed(rc)], Player([rc], playing=False, clock=clock), auto_tick=False)
        async with app.run_test(size=(100, 30)) as pilot:
            await pilot.pause()
            app.player.seek(mid)
            app.pump()
            await pilot.pause()
            st = app.state
            assert st.config.backend == "vllm-scheduler" and st.step == mid
            tables, (running, waiting, preempted) = truth[mid]
            assert (st.running, st.waiting, st.preempted) == (running, waiting, preempted)
            assert {r: t for r, t in st.blocks.tables.items() if t} == tables
            assert app.query_one(BlockMapWidget).render()
            from kvscope.tui.widgets.header import HeaderBar

            import vllm

            top = str(app.screen.query_one(HeaderBar).render()).splitlines()[0]
            assert f"cpu · vLLM {vllm.__version__}" in top and f"vLLM {vllm.__version__} scheduler" in top, top
            assert st.kv.total == 47 and st.kv.used + st.kv.free == 47, "the pool less vLLM's null block"

    asyncio.run(run())


@pytest.mark.parametrize("batch_queue,async_scheduling", [(1, False), (2, True)], ids=["Scheduler", "AsyncScheduler"])
def test_a_watcher_that_follows_every_delta_holds_each_later_snapshot(batch_queue, async_scheduling, monkeypatch):
    """docs/PROTOCOL.md: a snapshot with step S is the state after step S, so the map rebuilt from the deltas
    before it equals it, block for block (a snapshot taken mid-step would hold the next step's changes)."""
    from kvscope.vllm.inproc import watched as vllm_watch

    monkeypatch.setattr(vllm_watch, "SNAPSHOT_EVERY", 16)
    sched, pub = watched(num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128, async_scheduling=async_scheduling)
    _, consumer, _ = drive(sched, pub, batch_queue=batch_queue, check_every_step=False)
    follower, checked = None, 0
    for ev in consumer.events:
        if isinstance(ev, SnapshotEvent):
            if follower is None:
                follower = BlockMap.from_snapshot(ev)
                continue
            want = BlockMap.from_snapshot(ev)
            assert {r: t for r, t in follower.tables.items() if t} == {r: t for r, t in want.tables.items() if t}, \
                f"snapshot after step {ev.step}"
            assert follower.refcount[:len(want.refcount)] == want.refcount and follower.cached[:len(want.cached)] == \
                want.cached, f"snapshot after step {ev.step}"
            checked += 1
        elif isinstance(ev, StepEvent):
            follower.apply_step(ev)
    assert checked > 10


def test_a_watcher_that_joins_late_gets_a_snapshot_after_the_next_step(monkeypatch):
    """`record --connect` or `tui --connect` against a vLLM serving for a while: the publisher notices the
    subscription and the next step is followed by a snapshot, so the watcher starts at once (not after up
    to 256 steps)."""
    import time

    from kvscope.protocol.pubsub import Subscriber
    from tests._helpers import free_port, wait_for

    addr = f"tcp://127.0.0.1:{free_port()}"
    monkeypatch.setenv("KVSCOPE_VLLM_PUBLISH", addr)
    sched = build(WATCHED, num_blocks=48, max_num_seqs=6, max_num_batched_tokens=128)
    watch = sched._kvscope
    core = Core(sched)
    for _ in range(3):
        core.add(list(range(1, 40)), 200)
    for _ in range(20):  # serving, nobody watching
        core.step()
    assert watch.flush()
    sub = Subscriber(addr)
    try:
        assert wait_for(lambda: watch.publisher.joins > 0), "the publisher saw the subscription"
        core.step()
        got = []

        def snapshot_seen() -> bool:
            ev = sub.recv(50)
            if ev is not None:
                got.append(ev)
            return any(e.type == "snapshot" for e in got)

        assert wait_for(snapshot_seen, timeout=30), "a snapshot came after the next step"
        snap = next(e for e in got if e.type == "snapshot")
        assert snap.step == watch.builder.step_count == 21 and len(snap.running) == 3
    finally:
        sub.close()
        sched.shutdown()
