"""Paged KV-cache allocator: fixed-size blocks, per-request block tables, refcounts.

Pure bookkeeping, no tensors. The model runner turns block tables into slot
indices; this class only decides which physical block holds which logical block.
Every allocation and free is also logged, so the engine can publish block-map deltas.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from kvscope.protocol.deltas import BlockDeltaLog
from kvscope.protocol.events import KvCounters


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class BlockDeltas:
    """Net changes over one step: apply by removing `freed`, then adding `alloc`."""

    alloc: list[tuple[int, int]]  # (block, request)
    freed: list[int]
    refs: list[tuple[int, int]]  # (block, new refcount) for blocks whose count changed but stayed > 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref_counts = [0] * num_blocks
        self._free: deque[int] = deque(range(num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.filled: dict[int, int] = {}  # tokens whose KV is written, per request
        self._log = BlockDeltaLog()
        self._log_refs: list[tuple[int, int]] = []

    # ---- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def table(self, req_id: int) -> list[int]:
        return self.tables.get(req_id, [])

    def new_blocks_for(self, req_id: int, total_tokens: int) -> int:
        """Blocks to add so that req_id's table covers total_tokens slots."""
        have = len(self.tables.get(req_id, ()))
        return max(0, blocks_needed(total_tokens, self.block_size) - have)

    def can_grow(self, req_id: int, total_tokens: int) -> bool:
        return self.new_blocks_for(req_id, total_tokens) <= len(self._free)

    # ---- mutations -----------------------------------------------------------
    def grow(self, req_id: int, total_tokens: int) -> bool:
        """Make req_id's table cover total_tokens slots; all or nothing."""
        need = self.new_blocks_for(req_id, total_tokens)
        if need > len(self._free):
            return False
        table = self.tables.setdefault(req_id, [])
        self.filled.setdefault(req_id, 0)
        for _ in range(need):
            block = self._free.popleft()
            self.ref_counts[block] = 1
            table.append(block)
            self._log.alloc(block, req_id)
        return True

    def set_filled(self, req_id: int, num_tokens: int) -> None:
        if req_id in self.tables:
            self.filled[req_id] = num_tokens

    def free(self, req_id: int) -> None:
        """Drop req_id's references; blocks nobody references return to the pool."""
        table = self.tables.pop(req_id, None)
        self.filled.pop(req_id, None)
        if table is None:
            return
        # Return blocks tail first so recently used blocks are handed out last.
        for block in reversed(table):
            count = self.ref_counts[block] - 1
            if count < 0:
                raise AssertionError(f"block {block} freed twice")
            self.ref_counts[block] = count
            if count == 0:
                self._free.append(block)
                self._log.free(block)
            else:
                self._log_refs.append((block, count))

    def drain_deltas(self) -> BlockDeltas:
        alloc, freed = self._log.take()
        deltas = BlockDeltas([(a.block, a.req) for a in alloc], freed, self._log_refs)
        self._log_refs = []
        return deltas

    # ---- accounting ----------------------------------------------------------
    def counters(self) -> KvCounters:
        bs = self.block_size
        tokens = tail = reserve = 0
        for req_id, table in self.tables.items():
            filled = min(self.filled.get(req_id, 0), len(table) * bs)
            holding = blocks_needed(filled, bs)
            tokens += filled
            tail += holding * bs - filled
            reserve += (len(table) - holding) * bs
        shared = sum(1 for c in self.ref_counts if c > 1)
        return KvCounters(
            total=self.num_blocks,
            used=self.num_used,
            free=self.num_free,
            cached=0,
            shared=shared,
            token_slots=tokens,
            tail_waste=tail,
            reserve_waste=reserve,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts, tables and the free list disagree."""
        expected = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                expected[block] += 1
        assert expected == self.ref_counts, "refcounts disagree with block tables"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        for block in range(self.num_blocks):
            assert (block in free) == (expected[block] == 0), f"block {block} is both used and free, or neither"
