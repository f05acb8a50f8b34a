"""Net block-map deltas for one step (a helper for whoever emits StepEvents).

Protocol rule (docs/PROTOCOL.md): a step's block deltas are *net* over the step and
are applied as "remove every block in ``freed``, then add every block in ``alloc``".
So a block allocated and freed within the same step appears in neither list, and a
block freed and handed out again appears in both. Recording allocator calls here
in the order they happen and calling ``take()`` once per step gives lists that obey
the rule whatever the order of the calls was.
"""

from __future__ import annotations

from .events import BlockAlloc

__all__ = ["BlockDeltaLog"]

_OWNED = object()  # owned at the start of the step (owner not needed)


class BlockDeltaLog:
    """Call ``alloc(block, req)`` when a block leaves the free pool for a request,
    ``free(block)`` when it returns to the pool; ``take()`` at the end of a step."""

    __slots__ = ("_start", "_now", "_alloc_order")

    def __init__(self) -> None:
        self._start: dict[int, object] = {}  # block -> None (free) / _OWNED, at step start
        self._now: dict[int, int | None] = {}  # block -> current owner or None
        self._alloc_order: dict[int, None] = {}  # blocks in order of their latest allocation

    def alloc(self, block: int, req: int) -> None:
        if block not in self._start:
            self._start[block] = None
        self._now[block] = req
        self._alloc_order.pop(block, None)
        self._alloc_order[block] = None

    def free(self, block: int) -> None:
        if block not in self._start:
            self._start[block] = _OWNED
        self._now[block] = None

    def take(self) -> tuple[list[BlockAlloc], list[int]]:
        """(alloc, freed) for the step so far; resets the log.

        ``freed`` is in first-touch order; ``alloc`` in the order the allocations
        happened, so a request's new blocks appear in its block-table order.
        """
        freed = [b for b, start in self._start.items() if start is not None]
        alloc = [BlockAlloc(b, self._now[b]) for b in self._alloc_order if self._now[b] is not None]
        self._start.clear()
        self._now.clear()
        self._alloc_order.clear()
        return alloc, freed
