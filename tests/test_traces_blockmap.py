"""Block ownership rebuilt from deltas matches the (fake) scheduler's own table."""

from __future__ import annotations

import pytest
from _kvsynth import make_events

from kvscope.protocol import BlockAlloc, Finish, Preemption, RefChange, SnapshotEvent, StepEvent
from kvscope.protocol.deltas import BlockDeltaLog
from kvscope.traces.blockmap import apply_block_deltas, owners_from_snapshot, refcounts_from_snapshot


@pytest.mark.parametrize("seed", range(6))
def test_deltas_replay_to_the_true_block_map(seed):
    hello, events, truth = make_events(250, seed=seed, snapshot_every=25)
    owners = owners_from_snapshot(events[0])
    both = 0
    for ev in events:
        if isinstance(ev, StepEvent):
            both += bool(set(ev.freed) & {a.block for a in ev.alloc})
            apply_block_deltas(owners, ev)
            assert owners == truth[ev.step], ev.step
        elif isinstance(ev, SnapshotEvent):
            assert owners_from_snapshot(ev) == owners
    assert both > 0  # the hard cases (a block in both lists) did occur


def test_delta_log_nets_out_any_call_order():
    log = BlockDeltaLog()
    log.alloc(1, 10)
    log.free(1)  # allocated and freed within the step: nothing
    log.free(2)
    log.alloc(2, 11)  # freed and handed out again: both lists
    log.free(3)  # plain free
    log.alloc(4, 12)  # plain alloc
    log.free(5)
    log.alloc(5, 13)
    log.free(5)  # freed, re-allocated, freed: net free
    alloc, freed = log.take()
    assert alloc == [BlockAlloc(2, 11), BlockAlloc(4, 12)]
    assert freed == [2, 3, 5]
    assert log.take() == ([], [])
    owners = {2: 7, 3: 7, 5: 8}
    apply_block_deltas(owners, StepEvent(1, 0.0, 0.0, 1, alloc=alloc, freed=freed))
    assert owners == {2: 11, 4: 12}


def test_shared_blocks_keep_first_owner_and_refcounts():
    snap = SnapshotEvent(0, 0.0, blocks=[])
    owners, refs = owners_from_snapshot(snap), refcounts_from_snapshot(snap)
    apply_block_deltas(owners, StepEvent(1, 0, 0, 1, alloc=[BlockAlloc(1, 5), BlockAlloc(1, 6)],
                                         refs=[RefChange(1, 2)]), refs)
    assert owners == {1: 5} and refs == {1: 2}
    # net deltas: request 5 preempted and readmitted in one step gets block 1 back
    apply_block_deltas(owners, StepEvent(2, 0, 0, 1, alloc=[BlockAlloc(1, 5)], freed=[1],
                                         preemptions=[Preemption(5, "kv_blocks")]), refs)
    assert owners == {1: 5} and refs == {1: 1}
    apply_block_deltas(owners, StepEvent(3, 0, 0, 1, freed=[1], finished=[Finish(5, 0, 0, 1, "stop")]), refs)
    assert owners == {} and refs == {}


def test_delta_log_lists_allocations_in_the_order_they_happened():
    log = BlockDeltaLog()
    log.free(5)  # request 1 releases block 5 early in the step...
    log.alloc(9, 2)  # ...request 2 grows into block 9 first
    log.alloc(5, 2)  # ...and then into block 5
    alloc, freed = log.take()
    assert [(a.block, a.req) for a in alloc] == [(9, 2), (5, 2)]
    assert freed == [5]
