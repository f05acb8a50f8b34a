"""The physical blocks: free list, refcounts, and the cached blocks that allocation may evict.

A block is free (on the free list, holding nothing reusable), held (refcount > 0), or
cached: refcount 0 but still registered under a prefix key, so a later request can revive
it; allocation takes plain free blocks first, then evicts the least recently released cached
one. Every change is appended to the block manager's one event queue (kvscope.engine.kv.events).
"""

from __future__ import annotations

from collections import OrderedDict, deque

from kvscope.engine.kv.events import BlockAllocated, BlockFreed, BlockReleased, BlockRemoved, BlockShared
from kvscope.engine.kv.prefix_cache import PrefixCache


class BlockPool:
    def __init__(self, num_blocks: int, events: list, cache: PrefixCache | None) -> None:
        self.num_blocks = num_blocks
        self.ref_counts = [0] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # free and holding nothing reusable
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0: oldest release first
        self.num_shared = 0  # blocks with refcount > 1
        self.num_refs = 0  # sum of refcounts: blocks held, counted once per holder
        self.evictions = 0
        self._events = events
        self._cache = cache

    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and cached ones (evicted on use)."""
        return len(self.free) + len(self.evictable)

    def take(self, req_id: int, keep: int | None = None) -> int:
        """A block for req_id: a plain free one, else the least recently released cached one. `keep`,
        a cached block about to be copied, is never the one evicted; it then counts as the oldest."""
        evictable = self.evictable
        pinned = keep is not None and keep in evictable
        if pinned:
            del evictable[keep]
        if self.free:
            block = self.free.popleft()
        else:
            block, _ = evictable.popitem(last=False)
            key = self._cache.forget(block)
            self.evictions += 1
            self._events.append(BlockRemoved(key, block))
            self._events.append(BlockFreed(block))  # it leaves the cache
        self.ref_counts[block] = 1
        self.num_refs += 1
        self._events.append(BlockAllocated(block, req_id))
        if pinned:
            evictable[keep] = None
            evictable.move_to_end(keep, last=False)
        return block

    def share(self, block: int, req_id: int) -> None:
        """A held or cached block joins req_id's table."""
        count = self.ref_counts[block] + 1
        if count == 1:
            del self.evictable[block]  # revived from the cache
        elif count == 2:
            self.num_shared += 1
        self.ref_counts[block] = count
        self.num_refs += 1
        self._events.append(BlockShared(block, req_id, count))

    def release(self, block: int) -> None:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise AssertionError(f"block {block} freed twice")
        self.ref_counts[block] = count
        self.num_refs -= 1
        if count == 1:
            self.num_shared -= 1
        if count > 0:
            self._events.append(BlockReleased(block, count))
        elif self._cache is not None and self._cache.is_registered(block):
            self.evictable[block] = None  # stays cached, most recently released last
            self._events.append(BlockReleased(block, 0))
        else:
            self.free.append(block)
            self._events.append(BlockFreed(block))

    def check_invariants(self, expected: list[int]) -> None:
        """expected[b]: how many block tables hold block b."""
        assert expected == self.ref_counts, "refcounts disagree with block tables"
        assert self.num_shared == sum(1 for c in expected if c > 1), "shared-block count drifted"
        assert self.num_refs == sum(expected), "held-block count drifted"
        free = set(self.free)
        assert len(free) == len(self.free), "a block is on the free list twice"
        cached = set(self.evictable)
        assert not free & cached, "a block is both free and cached"
        free |= cached
        for block in range(self.num_blocks):
            assert (block in free) == (expected[block] == 0), f"block {block} is both used and free, or neither"
        registered = self._cache.is_registered if self._cache is not None else (lambda b: False)
        for block in self.evictable:
            assert registered(block), f"cached block {block} has no prefix key"
        for block in self.free:
            assert not registered(block), f"plain free block {block} still has a prefix key"
