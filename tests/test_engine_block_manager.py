"""BlockManager: on-demand allocation, freeing, waste accounting, and its own consistency check."""

from __future__ import annotations

import pytest

from kvscope.engine.kv.block_manager import BlockManager, blocks_needed
from kvscope.engine.config import EngineConfig
from kvscope.engine.kv.events import BlockAllocated, BlockDeltaFold, BlockFreed, TableDropped
from kvscope.engine.request import Request
from kvscope.engine.sampling_params import SamplingParams
from kvscope.engine.sched.scheduler import Scheduler


def test_blocks_needed():
    assert [blocks_needed(n, 16) for n in (0, 1, 15, 16, 17, 32, 33)] == [0, 1, 1, 1, 2, 2, 3]


def _reqs(n: int) -> list[Request]:
    return [Request(i, [1], SamplingParams(max_tokens=1), 0.0) for i in range(n)]


def test_allocates_on_demand_one_block_at_a_time():
    bm = BlockManager(num_blocks=8, block_size=16)
    a, b = _reqs(2)
    assert bm.grow(a, 1) and len(a.block_table) == 1 and bm.num_free == 7
    for n in range(2, 17):  # the rest of the first block needs nothing new
        assert bm.new_blocks_for(a, n) == 0
        assert bm.grow(a, n) and len(a.block_table) == 1
    assert bm.new_blocks_for(a, 17) == 1
    assert bm.grow(a, 17) and len(a.block_table) == 2 and bm.num_free == 6
    assert bm.grow(a, 5) and len(a.block_table) == 2, "growing to fewer tokens never shrinks a table"
    assert bm.grow(b, 40) and len(b.block_table) == 3
    assert not set(a.block_table) & set(b.block_table), "two requests share a physical block"
    assert bm.num_used == 5 and bm.num_free == 3
    assert bm.table(0) is a.block_table, "the block table lives on the request"
    bm.check_invariants()


def test_grow_is_all_or_nothing():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = _reqs(2)
    assert bm.grow(a, 8)
    assert not bm.can_grow(b, 12) and not bm.grow(b, 12)
    assert b.block_table == [] and 1 not in bm.tables and bm.num_free == 2, \
        "a failed grow must not keep a partial allocation"
    assert bm.can_grow(b, 8) and bm.grow(b, 8) and bm.num_free == 0
    assert not bm.grow(a, 9)
    assert len(a.block_table) == 2
    bm.check_invariants()


def _deltas(bm: BlockManager, fold: BlockDeltaFold):
    return fold.fold(bm.take_events())


def test_free_returns_blocks_and_logs_deltas():
    bm = BlockManager(num_blocks=6, block_size=2)
    fold = BlockDeltaFold(bm.num_blocks)
    a, b, c = _reqs(3)
    bm.grow(a, 5)
    bm.grow(b, 2)
    deltas = _deltas(bm, fold)
    assert deltas.alloc == [(x, 0) for x in a.block_table] + [(x, 1) for x in b.block_table]
    owned = list(a.block_table)
    bm.free(a)
    assert bm.num_free == 5 and a.block_table == [] and bm.table(0) == []
    deltas = _deltas(bm, fold)
    assert sorted(deltas.freed) == sorted(owned) and deltas.alloc == []
    assert bm.take_events() == [] and _deltas(bm, fold).freed == [], "the queue is drained once"
    bm.free(a)  # freeing a request that holds nothing is a no-op
    assert bm.num_free == 5 and bm.take_events() == []
    bm.free(b)
    assert bm.num_free == bm.num_blocks
    bm.check_invariants()
    # freed blocks are handed out again
    assert bm.grow(c, 12) and bm.num_free == 0
    bm.check_invariants()


def test_the_queue_records_every_change_in_order():
    bm = BlockManager(num_blocks=4, block_size=2)
    a, b = _reqs(2)
    bm.grow(a, 3)
    bm.free(a)
    assert bm.take_events() == [BlockAllocated(0, 0), BlockAllocated(1, 0), TableDropped(0), BlockFreed(1),
                                BlockFreed(0)]
    bm.grow(b, 1)
    assert bm.take_events() == [BlockAllocated(2, 1)]


def test_check_invariants_catches_a_double_free():
    bm = BlockManager(num_blocks=4, block_size=4)
    (a,) = _reqs(1)
    bm.grow(a, 8)
    bm.check_invariants()
    # a block pushed back onto the free list while its owner still holds it
    bm.pool.free.append(a.block_table[0])
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_refcount_drift():
    bm = BlockManager(num_blocks=4, block_size=4)
    (a,) = _reqs(1)
    bm.grow(a, 4)
    bm.ref_counts[a.block_table[0]] = 2
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_check_invariants_catches_a_leaked_block():
    bm = BlockManager(num_blocks=4, block_size=4)
    (a,) = _reqs(1)
    bm.grow(a, 4)
    bm.holders.pop(0)  # forgotten without being freed: not free, yet nobody owns it
    with pytest.raises(AssertionError):
        bm.check_invariants()


def test_freeing_a_block_twice_raises():
    bm = BlockManager(num_blocks=4, block_size=4)
    a, b = _reqs(2)
    bm.grow(a, 4)
    bm.grow(b, 0)  # b holds an empty table...
    b.block_table = list(a.block_table)  # ...then a second owner the refcount does not know about
    bm.free(a)
    with pytest.raises(AssertionError, match="freed twice"):
        bm.free(b)


def test_tail_waste_is_the_unfilled_part_of_the_last_block():
    bm = BlockManager(num_blocks=16, block_size=16)
    a, b = _reqs(2)
    bm.grow(a, 17)
    bm.commit(a, 17)
    bm.grow(b, 32)
    bm.commit(b, 32)
    assert a.num_computed_tokens == 17, "committing KV is what advances a request's computed tokens"
    kv = bm.counters()
    assert (kv.total, kv.used, kv.free) == (16, 4, 12)
    assert kv.token_slots == 49
    assert kv.tail_waste == 15 and kv.reserve_waste == 0
    bm.check_invariants()


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


@pytest.mark.parametrize("caching", [False, True])
def test_adopt_shares_every_held_block_and_trim_keeps_only_the_leading_ones(caching):
    """Parallel sampling's held prompts: an heir adopts a request's table (by refcount, with its computed
    tokens); an ended sample keeps only the blocks of its prompt but the last token."""
    bm = BlockManager(num_blocks=8, block_size=4, enable_caching=caching)
    tokens = list(range(1, 15))  # 14 tokens: 4 blocks, the last one half full
    src, heir = Request(0, tokens, SamplingParams(), 0.0), Request(1, tokens, SamplingParams(), 0.0)
    assert bm.grow(src, 14)
    bm.commit(src, 10)
    bm.adopt(heir, src)
    assert heir.block_table == src.block_table and heir.num_computed_tokens == 10
    assert [bm.ref_counts[b] for b in src.block_table] == [2] * 4
    assert heir.block_hashes == src.block_hashes and len(heir.block_hashes) == (2 if caching else 0)
    bm.check_invariants()
    bm.free(src)
    assert [bm.ref_counts[b] for b in heir.block_table] == [1] * 4 and bm.num_free == 4
    bm.check_invariants()
    bm.commit(heir, 14)
    table = list(heir.block_table)
    bm.trim(heir, 9)  # positions 0..8: the first three blocks
    assert heir.block_table == table[:3] and heir.num_computed_tokens == 9 and bm.num_free == 5
    assert len(heir.block_hashes) == (2 if caching else 0)
    bm.check_invariants()
    bm.free(heir)
    assert bm.num_free == 8
    bm.check_invariants()
