"""The one block-map rule (kvscope.protocol.blockmap): the journal nets allocator calls, the map applies them."""

from __future__ import annotations

import pytest
from fakes.streams import sim_events

from kvscope.protocol import BlockAlloc, BlockOwner, Finish, KvCounters, Preemption, RefChange, SnapshotEvent, StepEvent
from kvscope.protocol.blockmap import BlockJournal, BlockMap


@pytest.mark.parametrize("seed,caching", [(0, False), (1, False), (2, True), (3, True)])
def test_deltas_replay_to_the_engines_block_map(seed, caching):
    hello, events, truth = sim_events(160, seed=seed, prefix_caching=caching, snapshot_every=25)
    live = BlockMap.from_snapshot(events[0])
    both = snapshots = 0
    for ev in events:
        if isinstance(ev, StepEvent):
            both += bool(set(ev.freed) & {a.block for a in ev.alloc})
            live.apply_step(ev)
            assert {b: o for b, o in live.owners().items() if o >= 0} == truth[ev.step], ev.step
        elif isinstance(ev, SnapshotEvent) and ev.step > 0:
            seek = BlockMap.from_snapshot(ev, tables=True)
            assert (seek.owner, seek.refcount, seek.cached) == (live.owner, live.refcount, live.cached)
            assert {r: t for r, t in seek.tables.items() if t} == {r: t for r, t in live.tables.items() if t}
            snapshots += 1
    assert both > 0 and snapshots >= 5  # the hard cases (a block in both lists) did occur


def test_journal_nets_out_any_call_order():
    log = BlockJournal()
    log.alloc(1, 10)
    log.free(1)  # allocated and freed within the step: in neither list
    log.drop(10)
    log.free(2)
    log.alloc(2, 11)  # freed and handed out again: both lists
    log.free(3)  # plain free
    log.alloc(4, 12)  # plain alloc
    log.free(5)
    log.alloc(5, 13)
    log.free(5)  # freed, re-allocated, freed: net free
    log.drop(13)
    alloc, freed, refs = log.take()
    assert alloc == [(2, 11), (4, 12)]
    assert freed == [2, 3, 5] and refs == []
    assert log.take() == ([], [], [])
    m = BlockMap(8)
    m.apply([(2, 7), (3, 7), (5, 8)], [], [])
    m.apply(alloc, freed, refs)
    assert m.owners() == {2: 11, 4: 12} and m.tables[11] == [2]


def test_journal_lists_table_additions_in_order_and_refs_supersede():
    log = BlockJournal()
    log.free(5)  # request 1 releases block 5 early in the step...
    log.alloc(9, 2)  # ...request 2 grows into block 9 first
    log.alloc(5, 2)  # ...and then into block 5
    log.share(9, 3, 2)  # request 3 shares block 9
    log.ref(9, 1)  # request 2 lets go of it
    alloc, freed, refs = log.take()
    assert alloc == [(9, 2), (5, 2), (9, 3)] and freed == [5] and refs == [(9, 2), (9, 1)]
    log.ref(4, 0)  # block 4 cached...
    log.free(4)  # ...evicted...
    log.alloc(4, 6)  # ...and reused: its count is 1 again
    assert log.take() == ([(4, 6)], [4], [(4, 0), (4, 1)])
    log.ref(7, 0)  # block 7 cached, evicted, handed to request 4, which finishes and frees it, all in one step
    log.free(7)
    log.alloc(7, 4)
    log.ref(7, 1)
    log.drop(4)
    log.free(7)
    alloc, freed, refs = log.take()
    assert alloc == [] and freed == [7] and refs[-1] == (7, 1)  # the wire keeps the count; the rule voids it
    m = BlockMap(8)
    m.apply([(7, 10)], [], [])
    m.apply(alloc, freed, refs)
    assert m.refcounts() == {} and m.owners() == {}  # free: neither held nor cached


def test_shared_blocks_keep_first_owner_cached_blocks_stay():
    m = BlockMap(4)
    m.apply_step(StepEvent(1, 0, 0, 1, alloc=[BlockAlloc(1, 5), BlockAlloc(1, 6)], refs=[RefChange(1, 2)]))
    assert m.owners() == {1: 5} and m.refcounts() == {1: 2} and m.tables == {5: [1], 6: [1]}
    # request 5 preempted and readmitted in one step gets block 1 back
    m.apply_step(StepEvent(2, 0, 0, 1, alloc=[BlockAlloc(1, 5)], freed=[1], preemptions=[Preemption(5, "kv_blocks")]))
    assert m.owners() == {1: 5} and m.refcounts() == {1: 1}
    m.apply_step(StepEvent(3, 0, 0, 1, refs=[RefChange(1, 0)], finished=[Finish(5, 0, 0, 1, "stop")]))
    assert m.owners() == {1: -1} and m.cached[1] == 1 and m.owner[1] == 5  # cached: the claimer is kept
    m.apply_step(StepEvent(4, 0, 0, 1, alloc=[BlockAlloc(1, 8)], refs=[RefChange(1, 1)]))  # a prefix hit
    assert m.owners() == {1: 8} and not m.cached[1]


def test_limit_ignores_blocks_past_it():
    m = BlockMap(limit=16)
    m.apply([(3, 1), (10**8, 2)], [10**9], [(10**8 + 1, 3)])
    assert len(m) == 16 and m.owners() == {3: 1} and m.tables == {1: [3]}
    m.load_snapshot(SnapshotEvent(1, 0.0, blocks=[BlockOwner(10**7, 4, 1)], kv=KvCounters(total=10**8)))
    assert len(m) == 16 and m.owners() == {}
