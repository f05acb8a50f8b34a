"""The event builder over vLLM's own scheduler, driven directly (no kvscope engine).

A watcher folding the built events with the protocol's block-map rule must hold vLLM's own block
tables, refcounts and cached blocks at every step, and the batch must be vLLM's num_scheduled_tokens.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm.v1.core.sched.scheduler", reason="vLLM is installed by `make vllm`")

from kvscope.vllm.inproc.core import VllmSchedulerSettings  # noqa: E402
from kvscope.protocol import codec  # noqa: E402
from kvscope.protocol.blockmap import BlockMap  # noqa: E402
from tests.vllm_drive import Arrival, drive  # noqa: E402


def _workload(seed: int, n: int, shared: int) -> list[Arrival]:
    rng = random.Random(seed)
    system = [rng.randrange(1, 250) for _ in range(shared)]
    return [Arrival(f"r{i}", system + [rng.randrange(1, 250) for _ in range(rng.randrange(3, 70))],
                    rng.randrange(2, 40), step=i // 2) for i in range(n)]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_events_rebuild_vllm_block_state_every_step(prefix_caching):
    settings = VllmSchedulerSettings(num_blocks=14, max_num_seqs=6, max_num_batched_tokens=64,
                                     enable_prefix_caching=prefix_caching)
    steps, _ = drive(settings, _workload(1, 14, 40), events=True)
    watcher = BlockMap(settings.num_blocks)
    seen_preemption = seen_hit = False
    for d in steps:
        event = codec.decode(codec.encode(d.event))  # what a subscriber receives
        watcher.apply_step(event)
        ids = d.ids.__getitem__
        name = {f.req for f in event.finished}
        live = {ids(r): t for r, t in d.tables.items()}
        assert {r: t for r, t in watcher.tables.items() if t} == live, f"step {event.step}"
        held = {b: watcher.refcount[b] for b in range(settings.num_blocks) if watcher.owner[b] >= 0
                and watcher.refcount[b] > 0}
        assert held == d.refcounts, f"step {event.step}"
        assert {b for b in range(settings.num_blocks) if watcher.cached[b]} == d.cached
        assert {e.req: e.tokens for e in event.batch} == {ids(r): n for r, n in d.scheduled.items()}
        assert sorted(p.req for p in event.preemptions) == sorted(ids(r) for r in d.preempted)
        assert not name & set(event.running)
        seen_preemption |= bool(event.preemptions)
        seen_hit |= bool(event.hits)
    assert seen_preemption, "the pool is small enough to preempt"
    assert seen_hit == prefix_caching
    assert sum(len(d.event.finished) for d in steps) == 14


def test_blocks_handed_out_and_given_back_within_one_step_are_counted_cached():
    """Requests of one output token finish in the step that admits them: their full blocks go straight back
    to the pool with their prefix cached, never seen held between two steps; the builder still counts them."""
    rng = random.Random(5)
    system = [rng.randrange(1, 250) for _ in range(40)]
    arrivals = [Arrival(f"r{i}", system + [rng.randrange(1, 250) for _ in range(rng.randrange(20, 60))],
                        1 if i % 2 else rng.randrange(2, 12), step=i) for i in range(16)]
    settings = VllmSchedulerSettings(num_blocks=24, max_num_seqs=4, max_num_batched_tokens=256,
                                     enable_prefix_caching=True)
    steps, _ = drive(settings, arrivals, events=True)
    watcher = BlockMap(settings.num_blocks)
    grew_in_one_step = 0
    for before, d in zip([None, *steps], steps):
        event = codec.decode(codec.encode(d.event))
        watcher.apply_step(event)
        assert {b for b in range(settings.num_blocks) if watcher.cached[b]} == d.cached, f"step {event.step}"
        assert event.kv.cached == len(d.cached)
        if before is not None and any(f.output_len == 1 for f in event.finished):
            grew_in_one_step += bool(d.cached - before.cached - set(before.refcounts))
    assert grew_in_one_step, "some step cached blocks that were never held between two steps"


def test_admission_names_why_the_head_waits():
    settings = VllmSchedulerSettings(num_blocks=64, max_num_seqs=2, max_num_batched_tokens=256)
    steps = drive(settings, [Arrival(f"r{i}", list(range(1, 20)), 8) for i in range(4)], events=True)[0]
    first = steps[0].event
    assert first.admission.verdict == "blocked" and first.admission.reason == "max_num_seqs"
    assert first.admission.req == first.waiting[0]
    budget = drive(VllmSchedulerSettings(num_blocks=64, max_num_seqs=8, max_num_batched_tokens=32),
                   [Arrival(f"r{i}", list(range(1, 40)), 4) for i in range(2)], events=True)[0]
    assert budget[0].event.admission.reason == "token_budget"
    kv = drive(VllmSchedulerSettings(num_blocks=5, max_num_seqs=8, max_num_batched_tokens=256,
                                     enable_prefix_caching=False),
               [Arrival(f"r{i}", list(range(1, 40)), 4) for i in range(2)], events=True)[0]
    assert kv[0].event.admission.reason == "kv_blocks"


def test_ids_and_first_tokens():
    settings = VllmSchedulerSettings(num_blocks=32, max_num_seqs=4, max_num_batched_tokens=128)
    steps = drive(settings, [Arrival("a", [1, 2, 3], 1), Arrival("b", list(range(1, 30)), 3)],
                  events=True)[0]
    events = [d.event for d in steps]
    finished = {f.req: f for e in events for f in e.finished}
    assert sorted(finished) == [0, 1]  # sequential protocol ids in order of first sight
    assert finished[0].output_len == 1 and finished[0].reason == "length"  # finished in its first update
    assert finished[1].output_len == 3
    assert sorted(ft.req for e in events for ft in e.first_tokens) == [0, 1]
    assert all(b.kind == "prefill" for b in events[0].batch)
    assert any(b.kind == "decode" for e in events[1:] for b in e.batch)
