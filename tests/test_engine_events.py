"""The engine's event stream tells the truth: block maps, queues and records match the engine itself."""

from __future__ import annotations

import random

import pytest

from kvscope.engine import LLMEngine, SamplingParams
from kvscope.engine.config import EngineConfig
from kvscope.engine.request import RequestStatus
from kvscope.protocol import decode, encode
from kvscope.protocol.events import HelloEvent, SnapshotEvent, StepEvent
from kvscope.protocol.blockmap import BlockMap


class CheckingSink:
    """Rebuilds the block map from deltas and compares it with the engine after every step."""

    def __init__(self) -> None:
        self.engine: LLMEngine | None = None
        self.owners: BlockMap | None = None
        self.events: list = []
        self.checked_steps = 0
        self.checked_snapshots = 0

    def publish(self, event) -> None:
        event = decode(encode(event))  # what a subscriber would see
        self.events.append(event)
        if isinstance(event, SnapshotEvent):
            owners = BlockMap.from_snapshot(event)
            if self.owners is not None:
                assert owners.owners() == self.owners.owners(), f"snapshot at step {event.step} disagrees"
                self.checked_snapshots += 1
            self.owners = owners
        elif isinstance(event, StepEvent) and self.owners is not None:
            self.owners.apply_step(event)
            assert self.owners.owners() == self._engine_owners(), f"block map diverged at step {event.step}"
            sched = self.engine.scheduler
            assert event.running == [r.req_id for r in sched.running]
            assert event.preempted == [r.req_id for r in sched.waiting if r.status is RequestStatus.PREEMPTED]
            assert event.kv.used == self.engine.block_manager.num_used
            self.checked_steps += 1

    def _engine_owners(self) -> dict[int, int]:
        return {b: req for req, table in self.engine.block_manager.tables.items() for b in table}

    def close(self) -> None:
        pass


def _run(mode: str, num_blocks: int, seed: int = 0) -> tuple[CheckingSink, LLMEngine]:
    sink = CheckingSink()
    engine = LLMEngine(EngineConfig(mode=mode, num_blocks=num_blocks, max_num_batched_tokens=48,
                                    max_num_seqs=8), snapshot_every=7)
    sink.engine = engine
    engine.attach(sink)
    rng = random.Random(seed)
    pending = [([rng.randrange(250) for _ in range(rng.randint(1, 90))], rng.randint(1, 40)) for _ in range(30)]
    while pending or engine.has_unfinished():
        for _ in range(rng.randint(0, 3)):
            if pending:
                prompt, max_tokens = pending.pop()
                engine.add_request(prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
        engine.step()
    engine.close()
    return sink, engine


@pytest.mark.parametrize("mode", ["chunked", "continuous", "static"])
def test_block_map_from_deltas_matches_engine_every_step(mode):
    sink, engine = _run(mode, num_blocks=24)
    assert sink.checked_steps == engine.scheduler.step_count
    assert sink.checked_snapshots >= 3
    if mode != "static":
        assert engine.num_preemptions > 0, "the run should exercise preemption"
    assert sink.owners.owners() == {}  # everything returned at the end
    assert isinstance(sink.events[0], HelloEvent)
    assert sink.events[-1].type == "bye"


def test_step_records_match_request_metrics():
    sink, engine = _run("chunked", num_blocks=24, seed=3)
    steps = [e for e in sink.events if isinstance(e, StepEvent)]
    finished = {f.req: f for s in steps for f in s.finished}
    first = {f.req: f.ttft for s in steps for f in s.first_tokens}
    requests = {e.req: e for e in sink.events if e.type == "request"}
    assert set(finished) == set(requests) == set(first)
    sampled_counts: dict[int, int] = {}
    for s in steps:
        for r in s.sampled:
            sampled_counts[r] = sampled_counts.get(r, 0) + 1
        assert sum(b.tokens for b in s.batch) <= s.budget
    for req, fin in finished.items():
        assert fin.output_len == requests[req].max_tokens == sampled_counts[req]
        assert fin.ttft == pytest.approx(first[req])
        assert fin.reason == "length"
    preempted = {p.req for s in steps for p in s.preemptions}
    assert preempted, "expected preemptions in this run"


def test_admission_verdicts_name_a_reason():
    sink, _ = _run("chunked", num_blocks=24, seed=5)
    blocked = [s.admission for s in sink.events if isinstance(s, StepEvent) and s.admission.verdict == "blocked"]
    assert blocked
    assert {a.reason for a in blocked} <= {"kv_blocks", "token_budget", "max_num_seqs"}
    assert all(a.req is not None for a in blocked)


def test_rejected_request_is_published_and_others_continue():
    sink = CheckingSink()
    engine = LLMEngine(EngineConfig(num_blocks=8, max_num_batched_tokens=64))
    sink.engine = engine
    engine.attach(sink)
    from kvscope.engine.errors import RequestRejected

    with pytest.raises(RequestRejected, match="does not fit in the KV cache"):
        engine.add_request(list(range(200)), SamplingParams(max_tokens=4))
    engine.add_request([1, 2, 3], SamplingParams(max_tokens=4, ignore_eos=True))
    while engine.has_unfinished():
        engine.step()
    rejects = [e for e in sink.events if e.type == "reject"]
    assert len(rejects) == 1 and "\n" not in rejects[0].reason
    assert any(f.req == 1 for e in sink.events if isinstance(e, StepEvent) for f in e.finished)


def test_event_overhead_bench_records_a_readable_trace():
    from kvscope.bench.events import measure_event_overhead
    from kvscope.bench.harness import bench_workload

    config = EngineConfig(mode="chunked", num_blocks=256)
    items = bench_workload(config, "chat", 4, 260, frozenset({256}), max_prompt_len=2048)
    result = measure_event_overhead(config, items, rounds=1)
    assert result["bytes_per_step"] > 0  # steps were read back from the recorded trace
    assert result["trace_bytes_per_1000_steps"] > 0
    assert result["tok_per_s_on"] > 0 and result["tok_per_s_off"] > 0
