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

    __slots__ = ("_start", "_now")

    def __init__(self) -> None:
        self._start: dict[int, object] = {}  # block -> None (free) / _OWNED / req, at step start
        self._now: dict[int, int | None] = {}  # block -> current owner or None

    def alloc(self, block: int, req: int) -> None:
        if block not in self._start:
            self._start[block] = None
        self._now[block] = req

    def free(self, block: int) -> None:
        if block not in self._start:
            self._start[block] = _OWNED
        self._now[block] = None

    def take(self) -> tuple[list[BlockAlloc], list[int]]:
        """(alloc, freed) for the step so far, in first-touch order; resets the log."""
        alloc: list[BlockAlloc] = []
        freed: list[int] = []
        for block, start in self._start.items():
            now = self._now[block]
            if start is not None:
                if now is None or now != start:
                    freed.append(block)
                    if now is not None:
                        alloc.append(BlockAlloc(block, now))
            elif now is not None:
                alloc.append(BlockAlloc(block, now))
        self._start.clear()
        self._now.clear()
        return alloc, freed
