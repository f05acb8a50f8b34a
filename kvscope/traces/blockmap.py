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
    """Apply one step's net block-map deltas in place (docs/PROTOCOL.md, "Block deltas").

    1. every block in ``freed`` leaves the map;
    2. each ``alloc`` gives its block to its request, unless the block is still owned
       (a shared block keeps its first owner);
    3. ``refs`` set absolute refcounts (when ``refcounts`` is given).

    Deltas are net over the step, so a block freed and handed out again (even to the
    same request, preempted and readmitted in one step) is in both lists, and a block
    allocated and released within the step is in neither.
    """
    for b in step.freed:
        owners.pop(b, None)
        if refcounts is not None:
            refcounts.pop(b, None)
    for a in step.alloc:
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
