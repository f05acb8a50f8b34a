"""BlockManager: on-demand allocation, freeing, waste accounting, and its own consistency check."""

from __future__ import annotations

import pytest

from kvscope.engine.block_manager import BlockManager, blocks_needed
from kvscope.engine.config import EngineConfig
from kvscope.engine.request import Request
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.scheduler import Scheduler


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def test_allocates_on_demand_one_block_at_a_time():
    bm = BlockManager(num_blocks=8, block_size=16)
    assert bm.grow(0, 1) and len(bm.table(0)) == 1 and bm.num_free == 7
    for n in range(2, 17):  # the rest of the first block needs nothing new
        assert bm.new_blocks_for(0, n) == 0
        assert bm.grow(0, n) and len(bm.table(0)) == 1
    assert bm.new_blocks_for(0, 17) == 1
    assert bm.grow(0, 17) and len(bm.table(0)) == 2 and bm.num_free == 6
    assert bm.grow(0, 5) and len(bm.table(0)) == 2, "growing to fewer tokens never shrinks a table"
    assert bm.grow(1, 40) and len(bm.table(1)) == 3
    assert not set(bm.table(0)) & set(bm.table(1)), "two requests share a physical block"
    assert bm.num_used == 5 and bm.num_free == 3
    bm.check_invariants()


def test_grow_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    assert bm.grow(0, 8)
    assert not bm.can_grow(1, 12) and not bm.grow(1, 12)
    assert 1 not in bm.tables and bm.num_free == 2, "a failed grow must not keep a partial allocation"
    assert bm.can_grow(1, 8) and bm.grow(1, 8) and bm.num_free == 0
    assert not bm.grow(0, 9)
    assert len(bm.table(0)) == 2
    bm.check_invariants()


def test_free_returns_blocks_and_logs_deltas():
    bm = BlockManager(num_blocks=6, block_size=2)
    bm.grow(0, 5)
    bm.grow(1, 2)
    deltas = bm.drain_deltas()
    assert deltas.alloc == [(b, 0) for b in bm.table(0)] + [(b, 1) for b in bm.table(1)]
    owned = list(bm.table(0))
    bm.free(0)
    assert bm.num_free == 5 and bm.table(0) == []
    deltas = bm.drain_deltas()
    assert sorted(deltas.freed) == sorted(owned) and deltas.alloc == []
    assert bm.drain_deltas().freed == [], "deltas are drained once"
    bm.free(0)  # freeing an unknown request is a no-op
    assert bm.num_free == 5
    bm.free(1)
    assert bm.num_free == bm.num_blocks
    bm.check_invariants()
    # freed blocks are handed out again
    assert bm.grow(2, 12) and bm.num_free == 0
    bm.check_invariants()


def test_check_invariants_catches_a_double_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.grow(0, 8)
    bm.check_invariants()
    # a block pushed back onto the free list while its owner still holds it
    bm._free.append(bm.table(0)[0])
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_refcount_drift():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.grow(0, 4)
    bm.ref_counts[bm.table(0)[0]] = 2
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_a_leaked_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.grow(0, 4)
    bm.tables.pop(0)  # forgotten without being freed: not free, yet nobody owns it
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_freeing_a_block_twice_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    bm.grow(0, 4)
    bm.tables[1] = list(bm.table(0))  # a second owner the refcount does not know about
    bm.free(0)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(1)


def test_tail_waste_is_the_unfilled_part_of_the_last_block():
    bm = BlockManager(num_blocks=16, block_size=16)
    bm.grow(0, 17)
    bm.set_filled(0, 17)
    bm.grow(1, 32)
    bm.set_filled(1, 32)
    kv = bm.counters()
    assert (kv.total, kv.used, kv.free) == (16, 4, 12)
    assert kv.token_slots == 49
    assert kv.tail_waste == 15 and kv.reserve_waste == 0


def _drive(mode: str, prompt_lens, max_tokens: int, block_size: int = 16):
    """Run the scheduler with a fake sampler; yields the KV counters after each step."""
    config = EngineConfig(mode=mode, block_size=block_size, num_blocks=64, max_num_seqs=8)
    bm = BlockManager(64, block_size)
    sched = Scheduler(config, bm, 64 * block_size)
    for i, n in enumerate(prompt_lens):
        sched.add(Request(i, [1] * n, SamplingParams(max_tokens=max_tokens, ignore_eos=True), 0.0))
    step = 0
    while sched.has_unfinished():
        step += 1
        out = sched.schedule(float(step))
        sched.update(out, {s.req_id: 3 for s in out.seqs if s.sample}, float(step), frozenset())
        yield sched, bm.counters()


def test_static_reserves_ahead_while_continuous_only_wastes_the_tail():
    prompts, max_tokens = [5, 20, 40], 50
    static = [kv for _, kv in _drive("static", prompts, max_tokens)]

    # static: after the prefill step the reservation for prompt + max_tokens is mostly empty
    kv = static[0]
    reserved = sum(blocks_needed(n + max_tokens, 16) for n in prompts)
    assert kv.used == reserved
    filled = sum(prompts)  # KV is written for the prompts; the sampled token is not computed yet
    assert kv.token_slots == filled
    holding = sum(blocks_needed(n, 16) for n in prompts)
    assert kv.reserve_waste == (reserved - holding) * 16 > 0
    assert kv.tail_waste == holding * 16 - filled
    # the reserve shrinks as decode fills it
    reserve = [kv.reserve_waste for kv in static if kv.used]
    assert reserve == sorted(reserve, reverse=True) and reserve[-1] < reserve[0]

    # continuous: nothing is reserved ahead; each request wastes less than one block
    steps = 0
    for sched, kv in _drive("continuous", prompts, max_tokens):
        steps += 1
        assert kv.reserve_waste == 0
        assert kv.used == sum(blocks_needed(r.num_computed_tokens, 16) for r in sched.running)
        assert kv.tail_waste == sum(blocks_needed(r.num_computed_tokens, 16) * 16 - r.num_computed_tokens
                                    for r in sched.running)
        assert kv.tail_waste < 16 * max(1, len(sched.running))
    assert steps >= max_tokens
