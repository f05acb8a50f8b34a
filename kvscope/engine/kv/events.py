"""What changed in the KV cache: the records of the block manager's one drained queue.

The block manager appends one record per change, in the order they happen, and the engine
takes the queue once per step (``BlockManager.take_events``, as vLLM's ``take_events`` drains
its ``kv_event_queue``). Everyone who watches the cache reads that same list:

- ``fold_block_deltas`` turns it into the step event's net block deltas (through the
  protocol's ``BlockJournal``, the one block-map rule);
- the vLLM KV-event publisher (kvscope.vllm.publish) picks ``BlockStored`` and
  ``BlockRemoved``, the prefix cache by key;
- ``BlockCopied`` records each copy-on-write, so a watcher can count and place them.

Records are small frozen msgspec Structs: cheap to build in the scheduler's hot path, and typed.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from kvscope.protocol.blockmap import BlockJournal, BlockMap

_RECORD = dict(frozen=True, gc=False, array_like=True)


class BlockAllocated(msgspec.Struct, **_RECORD):
    """A block left the free pool (or the cache, evicted) for request ``req``: refcount 1."""

    block: int
    req: int


class BlockShared(msgspec.Struct, **_RECORD):
    """A block already held, or cached, joined ``req``'s table; ``refcount`` is its new count."""

    block: int
    req: int
    refcount: int


class BlockReleased(msgspec.Struct, **_RECORD):
    """A holder let go of a block that stays referenced (``refcount`` > 0) or cached (0)."""

    block: int
    refcount: int


class BlockFreed(msgspec.Struct, **_RECORD):
    """A block is back on the free list, or was evicted from the cache."""

    block: int


class TableDropped(msgspec.Struct, **_RECORD):
    """Request ``req`` let go of its whole table (finished, preempted or aborted)."""

    req: int


class BlockStored(msgspec.Struct, **_RECORD):
    """A full block was registered in the prefix cache under ``key`` (vLLM's BlockStored)."""

    key: bytes
    parent: bytes | None  # the key of the block before it; None for a prompt's first block
    token_ids: tuple[int, ...]
    block: int


class BlockRemoved(msgspec.Struct, **_RECORD):
    """``key`` left the prefix cache: its block was evicted (vLLM's BlockRemoved)."""

    key: bytes
    block: int


class BlockCopied(msgspec.Struct, **_RECORD):
    """Copy-on-write: ``req`` writes into its own copy ``dst`` of the shared or cached ``src``."""

    src: int
    dst: int
    req: int


KvEvent = BlockAllocated | BlockShared | BlockReleased | BlockFreed | TableDropped | BlockStored | BlockRemoved | \
    BlockCopied


@dataclass(slots=True)
class BlockDeltas:
    """Net changes over one step: apply by removing `freed`, then adding `alloc`."""

    alloc: list[tuple[int, int]]  # (block, request)
    freed: list[int]
    refs: list[tuple[int, int]]  # (block, new refcount), in order, for shared / cached blocks


class BlockDeltaFold:
    """The step event's view of the queue: net deltas per step, and the block map they rebuild.

    ``view`` is the block map as a watcher rebuilds it from the deltas: the request that claimed
    each block. Snapshots report these owners, so a seek to a snapshot shows what live showed.
    """

    def __init__(self, num_blocks: int) -> None:
        self.journal = BlockJournal()
        self.view = BlockMap(num_blocks, tables=False)

    def fold(self, events: list) -> BlockDeltas:
        j = self.journal
        for ev in events:
            kind = type(ev)
            if kind is BlockAllocated:
                j.alloc(ev.block, ev.req)
            elif kind is BlockReleased:
                j.ref(ev.block, ev.refcount)
            elif kind is BlockFreed:
                j.free(ev.block)
            elif kind is BlockShared:
                j.share(ev.block, ev.req, ev.refcount)
            elif kind is TableDropped:
                j.drop(ev.req)  # its table is gone: what it was given this step is no longer news
        deltas = BlockDeltas(*j.take())
        self.view.apply(deltas.alloc, deltas.freed, deltas.refs)
        return deltas
