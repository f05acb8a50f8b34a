"""The scheduler's abort path: an aborted request leaves at the next step, frees its blocks, says `abort`."""

from __future__ import annotations

import pytest

from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.protocol import decode, encode
from kvscope.protocol.events import FINISH_ABORT, RequestEvent, StepEvent
from kvscope.protocol.blockmap import BlockMap


class Events:
    def __init__(self) -> None:
        self.events = []

    def publish(self, event) -> None:
        self.events.append(decode(encode(event)))  # as a subscriber sees it

    def steps(self) -> list[StepEvent]:
        return [e for e in self.events if isinstance(e, StepEvent)]

    def close(self) -> None:
        pass


def _engine(**kw) -> tuple[LLMEngine, Events]:
    sink = Events()
    base = dict(num_blocks=24, max_num_batched_tokens=32, max_num_seqs=4)
    base.update(kw)
    return LLMEngine(EngineConfig(**base), sink=sink), sink


def _prompt(n: int, salt: int = 0) -> list[int]:
    return [(i * 7 + salt) % 250 for i in range(n)]


@pytest.mark.parametrize("caching", [False, True])
def test_abort_running_and_waiting_frees_everything(caching):
    engine, sink = _engine(prefix_caching=caching)
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    ids = [engine.add_request(_prompt(40, i), params) for i in range(6)]  # 4 run, 2 wait (max_num_seqs)
    for _ in range(4):
        engine.step()
    sched = engine.scheduler
    running = [r.req_id for r in sched.running]
    waiting = [r.req_id for r in sched.waiting]
    assert running and waiting, "the setup must have both running and waiting requests"
    for rid in ids:
        engine.abort_request(rid)
    assert engine.has_unfinished()
    finished = engine.step()
    assert sorted(r.req_id for r in finished) == sorted(ids)
    assert all(r.finish_reason == FINISH_ABORT for r in finished)
    assert not engine.has_unfinished()
    assert engine.block_manager.num_used == 0 and not engine.block_manager.tables
    last = sink.steps()[-1]
    assert sorted(f.req for f in last.finished) == sorted(ids)
    assert {f.reason for f in last.finished} == {FINISH_ABORT}
    assert last.running == [] and last.waiting == [] and last.batch == []
    assert last.kv.used == 0
    if caching:
        assert last.kv.cached > 0, "with prefix caching the aborted prompts' full blocks stay cached"
    # the block map a watcher rebuilds from deltas ends empty (cached blocks have refcount 0)
    owners = BlockMap.from_snapshot(next(e for e in sink.events if e.type == "snapshot"))
    for step in sink.steps():
        owners.apply_step(step)
    assert set(owners.owners()) <= set(engine.block_manager.cached_blocks)


def test_abort_is_idempotent_and_others_keep_running():
    engine, sink = _engine()
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    a = engine.add_request(_prompt(10), params)
    b = engine.add_request(_prompt(12, 3), params)
    engine.step()
    engine.abort_request(a)
    engine.abort_request(a)
    engine.abort_request(12345)  # unknown ids are ignored
    done = {r.req_id: r for r in engine.step()}
    assert list(done) == [a] and done[a].finish_reason == FINISH_ABORT
    while engine.has_unfinished():
        for r in engine.step():
            done[r.req_id] = r
    assert done[b].finish_reason == "length" and done[b].num_output_tokens == 6
    engine.abort_request(b)  # already finished: nothing happens, the engine stays idle after one step
    assert engine.step() == []
    assert not engine.has_unfinished()


def test_abort_a_swapped_request_returns_its_cpu_blocks():
    engine, sink = _engine(num_blocks=10, block_size=4, preemption="swap", swap_space=0.01)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    ids = [engine.add_request(_prompt(6, i), params) for i in range(4)]
    pool = engine.scheduler.swap_pool
    for _ in range(60):
        engine.step()
        if engine.scheduler.swapped:
            break
    swapped = engine.scheduler.swapped
    assert swapped, "the setup must swap a request out"
    assert pool.num_used > 0
    for rid in ids:
        engine.abort_request(rid)
    engine.step()
    assert pool.num_used == 0
    pool.check_invariants()
    assert not engine.has_unfinished()


def test_source_travels_in_request_events_and_snapshots():
    engine, sink = _engine()
    engine.add_request(_prompt(5), SamplingParams(max_tokens=2), source="http")
    engine.add_request(_prompt(5, 1), SamplingParams(max_tokens=2))
    reqs = [e for e in sink.events if isinstance(e, RequestEvent)]
    assert [r.source for r in reqs] == ["http", ""]
    snap = decode(encode(engine.snapshot()))
    assert {r.req: r.source for r in snap.requests} == {reqs[0].req: "http", reqs[1].req: ""}


def test_request_detail_says_a_request_came_from_http():
    from kvscope.tui.model.state import new_state, reduce_all

    engine, sink = _engine()
    http = engine.add_request(_prompt(5), SamplingParams(max_tokens=3), source="http")
    own = engine.add_request(_prompt(5, 2), SamplingParams(max_tokens=3))
    engine.step()
    state = reduce_all(new_state(), sink.events)
    assert state.requests[http].source == "http" and state.requests[own].source == ""
    late = reduce_all(new_state(), [decode(encode(engine.hello())), decode(encode(engine.snapshot()))])
    assert late.requests[http].source == "http"  # a late subscriber learns it from the snapshot
