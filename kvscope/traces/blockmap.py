"""Block ownership rebuilt from a snapshot plus step deltas (pure functions)."""

from __future__ import annotations

from ..protocol.events import SnapshotEvent, StepEvent

__all__ = ["owners_from_snapshot", "apply_block_deltas", "refcounts_from_snapshot"]


def owners_from_snapshot(snap: SnapshotEvent) -> dict[int, int]:
    """block -> owning request (the first owner for shared blocks)."""
    return {b.block: b.req for b in snap.blocks}


def refcounts_from_snapshot(snap: SnapshotEvent) -> dict[int, int]:
    return {b.block: b.refcount for b in snap.blocks}


def apply_block_deltas(owners: dict[int, int], step: StepEvent, refcounts: dict[int, int] | None = None) -> None:
    """Apply one step's block-map deltas in place (docs/PROTOCOL.md, "Block deltas").

    1. every block in ``freed`` leaves the map;
    2. each ``alloc`` gives its block to its request, unless the block is still owned
       (a shared block keeps its first owner), and unless the block is also in
       ``freed`` and the request finished or was preempted in this step: it was
       allocated and released again within the step (an allocator log in call
       order contains this; net deltas never do);
    3. ``refs`` set absolute refcounts (when ``refcounts`` is given).
    """
    freed = step.freed
    for b in freed:
        owners.pop(b, None)
        if refcounts is not None:
            refcounts.pop(b, None)
    if step.alloc:
        gone = None
        if freed and (step.finished or step.preemptions):
            freed_set = set(freed)
            gone = {f.req for f in step.finished}
            gone.update(p.req for p in step.preemptions)
        for a in step.alloc:
            if gone is not None and a.req in gone and a.block in freed_set:
                continue
            if a.block not in owners:
                owners[a.block] = a.req
                if refcounts is not None:
                    refcounts[a.block] = 1
    if refcounts is not None:
        for r in step.refs:
            if r.refcount <= 0:
                refcounts.pop(r.block, None)
            else:
                refcounts[r.block] = r.refcount
