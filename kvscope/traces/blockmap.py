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

    Prefix caching: a block whose last RefChange of the step is to 0 stays *cached*,
    listed with owner -1 and refcount 0 as a snapshot lists it; an ``alloc`` takes a
    cached block (or one that dropped to 0 during the step) for its request.
    """
    for b in step.freed:
        owners.pop(b, None)
        if refcounts is not None:
            refcounts.pop(b, None)
    zeroed = {r.block for r in step.refs if r.refcount <= 0}
    claimed: set[int] = set()
    for a in step.alloc:
        b = a.block
        if b not in claimed and (b not in owners or owners[b] < 0 or b in zeroed):
            owners[b] = a.req
            claimed.add(b)
            if refcounts is not None:
                refcounts[b] = 1
    final = {r.block: r.refcount for r in step.refs}
    for b, count in final.items():
        if count <= 0:
            owners[b] = -1
        if refcounts is not None:
            refcounts[b] = max(0, count)
