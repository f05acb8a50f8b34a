"""The block-map rule, once: the journal that turns allocator calls into a step's net
block deltas, and the map that applies them (docs/PROTOCOL.md, "Block deltas").

The engine's block manager records every call through a ``BlockJournal`` and takes
one step's deltas from it; watchers (the TUI reducer, tests, tools) fold those deltas
into a ``BlockMap``. The engine keeps a ``BlockMap`` of its own, fed the same deltas,
so the owners its snapshots report are exactly what a watcher rebuilt: a seek to a
snapshot shows what live showed.

The rule, per step: (1) every block in ``freed`` leaves the map; (2) each ``alloc``
(block, req) adds the block to req's table, and the first entry of the step that
finds the block free, cached (refcount 0) or dropped to 0 earlier in the step makes
req its owner (the claimer); a block still owned just gains a sharer; (3) ``refs``
set absolute refcounts, the last one per block winning, except that a block in ``freed``
and in no ``alloc`` entry takes none (its counts were recorded before it was freed: it
can only come back through an alloc); a block left at refcount 0 and not freed is *cached*. A request's table is dropped when it is preempted or
finishes; a freed block leaves its owner's table (a sliding window frees leading blocks).
"""

from __future__ import annotations

from typing import Iterable

__all__ = ["BlockJournal", "BlockMap"]

_OWNED = object()  # owned at the start of the step (owner not needed)


class BlockJournal:
    """Allocator calls of one step, in any order, to net (alloc, freed, refs) lists.

    ``alloc(block, req)``: the block left the free pool (or the cache) for req.
    ``share(block, req, count)``: a block already held (or cached) joins req's table.
    ``ref(block, count)``: a refcount changed without the block changing hands.
    ``free(block)``: the block is back on the free list (or evicted from the cache).
    ``drop(req)``: req's table is gone; what it was given this step is no longer news.
    ``take()`` once per step returns the lists and resets the journal.
    """

    __slots__ = ("_start", "_now", "_appends", "_refs", "_ref_logged", "_cached")

    def __init__(self) -> None:
        self._start: dict[int, object] = {}  # block -> None (free) / _OWNED, at step start
        self._now: dict[int, int | None] = {}  # block -> current owner or None
        self._appends: list[tuple[int, int]] = []  # (block, req) added to a live table, in order
        self._refs: list[tuple[int, int]] = []  # (block, refcount), in order
        self._ref_logged: set[int] = set()
        self._cached: set[int] = set()  # blocks whose last call left them cached (a count of 0)

    def alloc(self, block: int, req: int) -> None:
        if block not in self._start:
            self._start[block] = None
        self._now[block] = req
        self._cached.discard(block)
        self._appends.append((block, req))
        if block in self._ref_logged:
            self.ref(block, 1)  # supersedes an earlier count of this step

    def share(self, block: int, req: int, count: int) -> None:
        self._appends.append((block, req))
        self.ref(block, count)

    def ref(self, block: int, count: int) -> None:
        self._refs.append((block, count))
        self._ref_logged.add(block)
        if count > 0:
            self._cached.discard(block)
        else:
            self._cached.add(block)

    def free(self, block: int) -> None:
        if block not in self._start:
            self._start[block] = _OWNED
        self._now[block] = None
        self._cached.discard(block)

    def drop(self, req: int) -> None:
        if any(r == req for _, r in self._appends):
            self._appends = [(b, r) for b, r in self._appends if r != req]

    def take(self) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]:
        """(alloc, freed, refs) of the step so far; resets the journal.

        ``freed`` is in first-touch order; ``alloc`` in the order the blocks joined
        tables, so a request's new blocks appear in its block-table order.
        """
        alloc, refs = self._appends, self._refs
        # a block freed (evicted), handed to a request that ended within the step and left cached again is
        # cached at the end: not freed, so its refs entry of 0 stands
        back = self._cached.difference(b for b, _ in alloc) if self._cached else ()
        freed = [b for b, start in self._start.items() if start is not None and b not in back]
        self._start = {}
        self._now = {}
        self._appends = []
        self._refs = []
        self._ref_logged = set()
        self._cached = set()
        return alloc, freed, refs


class BlockMap:
    """Owner (-1: none), refcount and cached flag per block, and optionally block tables.

    ``limit`` caps the blocks tracked: deltas and snapshot entries for blocks at or past
    it are ignored, so a stream claiming a huge pool costs no per-block memory past it.
    """

    __slots__ = ("owner", "refcount", "cached", "tables", "limit")

    def __init__(self, n: int = 0, *, limit: int | None = None, tables: bool = True) -> None:
        self.limit = limit
        self.tables: dict[int, list[int]] | None = {} if tables else None
        self.owner: list[int] = []
        self.refcount: list[int] = []
        self.cached = bytearray()
        self.reset(n)

    def __len__(self) -> int:
        return len(self.owner)

    def _cap(self, n: int) -> int:
        return n if self.limit is None else min(n, self.limit)

    def reset(self, n: int) -> None:
        n = self._cap(max(0, n))
        self.owner = [-1] * n
        self.refcount = [0] * n
        self.cached = bytearray(n)
        if self.tables is not None:
            self.tables = {}

    def ensure(self, n: int) -> None:
        n = self._cap(n)
        if n > len(self.owner):
            k = n - len(self.owner)
            self.owner.extend([-1] * k)
            self.refcount.extend([0] * k)
            self.cached.extend(bytes(k))

    # -- the rule ------------------------------------------------------------------
    def apply(self, alloc: list[tuple[int, int]], freed: list[int], refs: list[tuple[int, int]],
              max_table: int | None = None, max_tables: int | None = None) -> None:
        """Apply one step's net deltas: ``alloc`` (block, req) and ``refs`` (block, refcount)
        pairs, ``freed`` blocks. Bounds for untrusted streams: a table grows to at most
        ``max_table`` blocks, and at most ``max_tables`` requests have one."""
        top = -1
        if freed:
            top = max(freed)
        if alloc:
            top = max(top, max(b for b, _ in alloc))
        if refs:
            top = max(top, max(b for b, _ in refs))
        if top >= len(self.owner):
            self.ensure(top + 1)
            n = len(self.owner)
            if top >= n:  # past the limit: those blocks are not tracked
                freed = [b for b in freed if b < n]
                alloc = [a for a in alloc if a[0] < n]
                refs = [r for r in refs if r[0] < n]
        owner, refc, cached = self.owner, self.refcount, self.cached
        tables = self.tables
        for b in freed:
            o = owner[b]
            if tables and o >= 0:  # a live request let go of it (a sliding window's leading blocks)
                t = tables.get(o)
                if t and b in t:
                    t.remove(b)
            owner[b] = -1
            refc[b] = 0
            cached[b] = 0
        zeroed = {b for b, c in refs if c <= 0} if refs else ()
        claimed: set[int] = set()
        for b, req in alloc:
            if b not in claimed and (owner[b] < 0 or refc[b] <= 0 or b in zeroed):
                owner[b] = req
                refc[b] = 1
                claimed.add(b)
            elif owner[b] != req:
                refc[b] += 1  # provisional; a RefChange gives the exact count
            cached[b] = 0
            if tables is not None:
                tbl = tables.get(req)
                if tbl is None:
                    if max_tables is None or len(tables) < max_tables:
                        tables[req] = [b]
                elif max_table is None or len(tbl) < max_table:
                    tbl.append(b)
        if refs and freed:  # counts of a block freed later in the step, and not handed out again, are void
            gone = set(freed).difference(b for b, _ in alloc)
            if gone:
                refs = [r for r in refs if r[0] not in gone]
        for b, v in (dict(refs).items() if refs else ()):  # the last count per block wins
            if v > 0:
                refc[b] = v
                cached[b] = 0
            else:
                refc[b] = 0
                cached[b] = 1

    def apply_step(self, step, max_table: int | None = None, max_tables: int | None = None) -> None:
        """Apply a StepEvent: its block deltas, and the tables it ends (a preempted or
        finished request's; neither gains blocks in the step it ends)."""
        tables = self.tables
        if tables:
            for pe in step.preemptions:
                tables.pop(pe.req, None)
            for f in step.finished:
                tables.pop(f.req, None)
        if step.alloc or step.freed or step.refs:
            self.apply([(a.block, a.req) for a in step.alloc], step.freed,
                       [(r.block, r.refcount) for r in step.refs], max_table, max_tables)

    def load_snapshot(self, snap, n: int = 0) -> None:
        """Start over from a SnapshotEvent (a pool of at least ``n`` blocks)."""
        n = max(n, snap.kv.total, max((bo.block + 1 for bo in snap.blocks), default=0))
        self.reset(n)
        size = len(self.owner)
        owner, refc, cached = self.owner, self.refcount, self.cached
        for bo in snap.blocks:
            b = bo.block
            if b < size:
                owner[b] = bo.req
                refc[b] = bo.refcount
                cached[b] = 1 if bo.refcount <= 0 else 0
        if self.tables is not None:
            self.tables = {int(k): list(v) for k, v in snap.block_tables.items()}

    @classmethod
    def from_snapshot(cls, snap, **kw) -> "BlockMap":
        m = cls(**kw)
        m.load_snapshot(snap)
        return m

    # -- views ---------------------------------------------------------------------
    def owners(self) -> dict[int, int]:
        """block -> owner for every owned block, and -1 for every cached one."""
        return {b: (o if c > 0 else -1) for b, (o, c) in enumerate(zip(self.owner, self.refcount))
                if c > 0 or self.cached[b]}

    def refcounts(self) -> dict[int, int]:
        """block -> refcount for every owned or cached block."""
        return {b: c for b, c in enumerate(self.refcount) if c > 0 or self.cached[b]}
