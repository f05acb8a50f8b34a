"""Paged KV-cache allocator: fixed-size blocks, per-request block tables, refcounts, prefix cache.

Pure bookkeeping, no tensors. The model runner turns block tables into slot
indices; this class only decides which physical block holds which logical block.
Every allocation and free is also logged, so the engine can publish block-map deltas.

Prefix caching (``enable_caching``): once a block is full of computed tokens it is
registered under a hash of (parent block's hash, its token ids), so the hash names
the whole prefix up to the block's end. A request admitted later whose tokens start
with the same prefix shares those physical blocks (refcount + 1) instead of
computing them. A registered block whose refcount drops to 0 stays *cached*: free,
but reusable until allocation evicts it, least recently released first. A shared
or cached block is never written: if the first token to compute falls inside a hit
block, that block is copied first (copy-on-write) and the copy is written.
Protocol view (docs/PROTOCOL.md): a block going to refcount 0 and staying cached is
a RefChange to 0; a cached block leaves the cache through ``freed``.

Sliding window (``sliding_window``, set only when every layer of the model slides by
the same window w): a query at position p reads keys p-w+1..p, so once a request has
computed c tokens its leading blocks wholly before position c-w+1 are never read
again. They are released as soon as the KV is written (``set_filled``), as vLLM's
sliding-window manager does, and the request's table keeps only the blocks from the
window on: ``table()`` still returns the logical table, with 0 standing in for each
released block (attention never reads it). A released block is an ordinary release
in the deltas: freed, or with prefix caching a RefChange to 0 that keeps it cached
for a later request with the same prefix, evicted like any other cached block. Such
a request needs only the cached blocks inside the window of its first computed
token (``match_prefix``), and takes only those.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass

from kvscope.protocol.blockmap import BlockJournal, BlockMap
from kvscope.protocol.events import KvCounters


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


@dataclass(slots=True)
class BlockDeltas:
    """Net changes over one step: apply by removing `freed`, then adding `alloc`."""

    alloc: list[tuple[int, int]]  # (block, request)
    freed: list[int]
    refs: list[tuple[int, int]]  # (block, new refcount), in order, for shared / cached blocks


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    """The prefix-cache key of a full block: its parent's key and its own tokens."""
    return hash((parent, tokens))


class NullCacheEvents:
    """Where the block manager reports prefix-cache changes by key when nobody listens.

    A listener (kvscope.adapters.vllm_publisher, for vLLM's KV-event format) gets
    ``stored(key, parent_key, token_ids)`` when a full block is registered under its
    prefix key and ``removed(key)`` when the key leaves the cache.
    """

    def stored(self, key: int, parent: int | None, token_ids: tuple[int, ...]) -> None:
        pass

    def removed(self, key: int) -> None:
        pass


NO_CACHE_EVENTS = NullCacheEvents()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None) -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        self.sliding_window = sliding_window
        self._dropped: dict[int, int] = {}  # per request: leading logical blocks released (outside the window)
        self.ref_counts = [0] * num_blocks
        self._num_shared = 0  # blocks with refcount > 1, kept up to date so counters() stays O(requests)
        self._free: deque[int] = deque(range(num_blocks))  # free and holding nothing reusable
        self._evictable: OrderedDict[int, None] = OrderedDict()  # cached, refcount 0: oldest release first
        self.block_hash: list[int | None] = [None] * num_blocks  # registered prefix key, if any
        self._by_hash: dict[int, int] = {}
        self.tables: dict[int, list[int]] = {}  # per request: the blocks it holds, from its window on
        self.filled: dict[int, int] = {}  # tokens whose KV is written, per request
        self._chains: dict[int, list[int]] = {}  # per request: keys of its full blocks, in order
        self._log = BlockJournal()  # every call that changes the block map, net over the step
        # The block map as a watcher rebuilds it from the deltas (kvscope.protocol.blockmap): the
        # request that claimed each block. Snapshots report these owners so seeks equal live.
        self.view = BlockMap(num_blocks, tables=False)
        self._copies: list[tuple[int, int]] = []
        # counters() in O(1): sums over requests of (KV tokens in held blocks, blocks holding them,
        # blocks held). Every change to `tables`, `filled` or `_dropped` goes between
        # _unaccount(req) and _account(req); set_filled adjusts them inline when it can.
        self._sum_filled = 0
        self._sum_holding = 0
        self._sum_table = 0
        # prefix-cache statistics, since start
        self.hit_tokens = 0
        self.query_tokens = 0
        self.cow_copies = 0
        self.evictions = 0
        self.cache_events = NO_CACHE_EVENTS  # prefix-cache changes by key, for watchers outside the engine

    # ---- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and cached ones (evicted on use)."""
        return len(self._free) + len(self._evictable)

    @property
    def num_cached(self) -> int:
        return len(self._evictable)

    @property
    def num_prefix_keys(self) -> int:
        """Blocks registered under a prefix key (cached or in use): what vLLM's KV events count."""
        return len(self._by_hash)

    @property
    def cached_blocks(self) -> list[int]:
        """Cached blocks (refcount 0, reusable), least recently released first."""
        return list(self._evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def table(self, req_id: int) -> list[int]:
        """req_id's logical block table (block i holds positions i*bs ..), 0 for blocks released outside the window."""
        table = self.tables.get(req_id, [])
        dropped = self._dropped.get(req_id, 0)
        return [0] * dropped + table if dropped else table

    def outside_window(self, num_computed: int) -> int:
        """Leading logical blocks that no query at position >= num_computed reads (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def computed_blocks(self, req_id: int, num_computed: int) -> list[int]:
        """The held blocks with KV a later query can read (what a swap-out must keep), in logical order."""
        self._slide(req_id, num_computed)
        held = self.tables.get(req_id, [])
        return held[: max(0, blocks_needed(num_computed, self.block_size) - self._dropped.get(req_id, 0))]

    def new_blocks_for(self, req_id: int, total_tokens: int) -> int:
        """Blocks to add so that req_id's table covers total_tokens slots."""
        have = len(self.tables.get(req_id, ())) + self._dropped.get(req_id, 0)
        return max(0, blocks_needed(total_tokens, self.block_size) - have)

    def can_grow(self, req_id: int, total_tokens: int) -> bool:
        return self.new_blocks_for(req_id, total_tokens) <= self.num_free

    def match_prefix(self, token_ids: list[int]) -> list[int | None]:
        """Cached blocks holding the longest run of token_ids' leading full blocks (empty without caching).

        With a sliding window only the blocks inside the window of the first token to compute are
        read, so the run may start there (as vLLM's sliding-window manager matches): the entries
        before it are None, whether those blocks are still cached or not.
        """
        if not self.enable_caching:
            return []
        bs = self.block_size
        blocks: list[int | None] = []
        parent = None
        for i in range(len(token_ids) // bs):
            key = block_hash(parent, tuple(token_ids[i * bs : (i + 1) * bs]))
            block = self._by_hash.get(key)
            if block is None and self.sliding_window is None:
                break
            blocks.append(block)
            parent = key
        return blocks if self.sliding_window is None else self._window_hits(blocks, len(token_ids))

    def _window_hits(self, blocks: list[int | None], num_tokens: int) -> list[int | None]:
        """The longest prefix of `blocks` whose entries from the computed point's window on are cached."""
        runs, run = [], 0  # runs[i]: cached blocks in a row ending at block i
        for block in blocks:
            run = run + 1 if block is not None else 0
            runs.append(run)
        for k in range(len(blocks), 0, -1):
            computed = min(k * self.block_size, num_tokens - 1)  # the scheduler always computes the last token
            lo = self.outside_window(computed)
            if computed > 0 and runs[k - 1] >= k - lo:
                return [None] * lo + blocks[lo:k]
        return []

    def can_admit(self, hits: list[int | None], computed: int, total_tokens: int) -> bool:
        """Whether a new request with tokens [0, computed) in `hits` can get blocks covering total_tokens."""
        skip = self.outside_window(computed)  # hits before the window are not needed
        shared = hits[skip : computed // self.block_size]  # hits it shares; a last, partly used one is copied
        need = blocks_needed(total_tokens, self.block_size) - skip - len(shared)
        # reviving a cached hit takes it off the free pool; so does pinning a cached copy source
        taken = sum(1 for b in hits[skip:] if self.ref_counts[b] == 0)
        return need <= self.num_free - taken

    # ---- mutations -----------------------------------------------------------
    def _contribution(self, req_id: int) -> tuple[int, int, int]:
        """(KV tokens in its held blocks, blocks holding them, blocks held) for counters()."""
        table = self.tables.get(req_id)
        if table is None:
            return 0, 0, 0
        bs = self.block_size
        dropped = self._dropped.get(req_id, 0) * bs  # tokens whose blocks were released
        filled = max(0, min(self.filled.get(req_id, 0), dropped + len(table) * bs) - dropped)
        return filled, blocks_needed(filled, bs), len(table)

    def _unaccount(self, req_id: int) -> None:
        filled, holding, length = self._contribution(req_id)
        self._sum_filled -= filled
        self._sum_holding -= holding
        self._sum_table -= length

    def _account(self, req_id: int) -> None:
        filled, holding, length = self._contribution(req_id)
        self._sum_filled += filled
        self._sum_holding += holding
        self._sum_table += length

    def _take(self, req_id: int) -> int:
        """A block for req_id: a plain free one, else the least recently released cached one."""
        if self._free:
            block = self._free.popleft()
        else:
            block, _ = self._evictable.popitem(last=False)
            key = self.block_hash[block]
            del self._by_hash[key]
            self.block_hash[block] = None
            self.cache_events.removed(key)
            self.evictions += 1
            self._log.free(block)  # it leaves the cache
        self.ref_counts[block] = 1
        self._log.alloc(block, req_id)
        return block

    def _release(self, block: int) -> None:
        count = self.ref_counts[block] - 1
        if count < 0:
            raise AssertionError(f"block {block} freed twice")
        self.ref_counts[block] = count
        if count == 1:
            self._num_shared -= 1
        if count > 0:
            self._log.ref(block, count)
        elif self.block_hash[block] is not None:
            self._evictable[block] = None  # stays cached, most recently released last
            self._log.ref(block, 0)
        else:
            self._free.append(block)
            self._log.free(block)

    def admit(self, req_id: int, hits: list[int | None], computed: int, total_tokens: int) -> bool:
        """Give a new request the cached blocks `hits` (tokens [0, computed) are in them), then
        blocks up to total_tokens; all or nothing. A hit block that the first computed token
        would write into is copied (copy-on-write) rather than shared."""
        if not self.can_admit(hits, computed, total_tokens):
            return False
        self._unaccount(req_id)
        bs = self.block_size
        table = self.tables.setdefault(req_id, [])
        self.filled[req_id] = computed
        skip = self.outside_window(computed)
        if skip:
            self._dropped[req_id] = skip
        chain = self._chains.setdefault(req_id, [])
        # keys of a hit run that starts at block 0; otherwise set_filled rebuilds them from the tokens
        keyed = None not in hits
        for i, block in enumerate(hits):
            if keyed:
                chain.append(self.block_hash[block])
            if i < skip:
                continue  # before the window: its KV is never read, so it is not taken
            if computed < (i + 1) * bs:
                # the write at position `computed` lands in this block: copy it first
                pinned = block in self._evictable
                if pinned:
                    del self._evictable[block]
                copy = self._take(req_id)
                if pinned:
                    self._evictable[block] = None
                    self._evictable.move_to_end(block, last=False)  # keep its place: oldest first
                self._copies.append((block, copy))
                self.cow_copies += 1
                table.append(copy)
                continue
            count = self.ref_counts[block] + 1
            if count == 1:
                del self._evictable[block]
            elif count == 2:
                self._num_shared += 1
            self.ref_counts[block] = count
            self._log.share(block, req_id, count)
            table.append(block)
        grown = self._grow(req_id, total_tokens)  # can_admit checked that it fits
        self._account(req_id)
        return grown

    def grow(self, req_id: int, total_tokens: int, computed: int = 0) -> bool:
        """Make req_id's table cover total_tokens slots; all or nothing. A new table for a request
        with `computed` tokens already computed (swapped in) starts at its window."""
        self._unaccount(req_id)
        grown = self._grow(req_id, total_tokens, computed)
        self._account(req_id)
        return grown

    def _grow(self, req_id: int, total_tokens: int, computed: int = 0) -> bool:
        fresh = req_id not in self.tables
        if fresh and self.outside_window(computed):
            self._dropped[req_id] = self.outside_window(computed)
        need = self.new_blocks_for(req_id, total_tokens)
        if need > self.num_free:
            if fresh:
                self._dropped.pop(req_id, None)
            return False
        table = self.tables.setdefault(req_id, [])
        self.filled.setdefault(req_id, 0)
        for _ in range(need):
            table.append(self._take(req_id))
        return True

    def set_filled(self, req_id: int, num_tokens: int, token_ids: list[int] | None = None) -> None:
        """KV now exists for req_id's first num_tokens tokens; with caching, register its full blocks;
        with a sliding window, release the blocks that fell out of it."""
        table = self.tables.get(req_id)
        if table is None:
            return
        bs = self.block_size
        if self.sliding_window is None:  # _unaccount / _account, inline: this runs every step per request
            cap = len(table) * bs
            old = self.filled.get(req_id, 0)
            old = old if old < cap else cap
            new = num_tokens if num_tokens < cap else cap
            self._sum_filled += new - old
            self._sum_holding += (new + bs - 1) // bs - (old + bs - 1) // bs
            self.filled[req_id] = num_tokens
        else:
            self._unaccount(req_id)
            self.filled[req_id] = num_tokens
            self._account(req_id)
        if self.enable_caching and token_ids is not None and min(num_tokens, len(token_ids)) // bs > len(
                self._chains.get(req_id, ())):
            dropped = self._dropped.get(req_id, 0)
            chain = self._chains.setdefault(req_id, [])
            for i in range(len(chain), min(num_tokens, len(token_ids)) // bs):
                parent = chain[-1] if chain else None
                tokens = tuple(token_ids[i * bs : (i + 1) * bs])
                key = block_hash(parent, tokens)
                chain.append(key)
                if i < dropped:
                    continue  # released before it was registered (a swapped-in request's prefix)
                block = table[i - dropped]
                if key not in self._by_hash and self.block_hash[block] is None:
                    self._by_hash[key] = block
                    self.block_hash[block] = key
                    self.cache_events.stored(key, parent, tokens)
        if self.sliding_window is not None:
            self._slide(req_id, num_tokens)

    def _slide(self, req_id: int, num_computed: int) -> None:
        """Release req_id's leading blocks that no query from position num_computed on can read."""
        dropped = self._dropped.get(req_id, 0)
        table = self.tables.get(req_id)
        n = min(self.outside_window(num_computed) - dropped, len(table or ()))
        if n <= 0:
            return
        self._unaccount(req_id)
        for block in table[:n]:
            self._release(block)
        del table[:n]
        self._dropped[req_id] = dropped + n
        self._account(req_id)

    def add_one_filled(self, req_ids: list[int]) -> None:
        """set_filled(req, filled + 1) for each of req_ids, for a decode step without prefix caching or
        a sliding window (each was given a slot for its token)."""
        assert not self.enable_caching and self.sliding_window is None, "use set_filled"
        filled = self.filled
        bs = self.block_size
        started = 0  # tokens that start a new block: a block more holds KV
        for req_id in req_ids:
            n = filled[req_id]
            if n % bs == 0:
                started += 1
            filled[req_id] = n + 1
        self._sum_filled += len(req_ids)
        self._sum_holding += started

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.query_tokens += query_tokens
        self.hit_tokens += hit_tokens

    def free(self, req_id: int) -> None:
        """Drop req_id's references; blocks nobody references return to the pool (or stay cached)."""
        self._unaccount(req_id)
        table = self.tables.pop(req_id, None)
        self.filled.pop(req_id, None)
        self._chains.pop(req_id, None)
        self._dropped.pop(req_id, None)
        if table is None:
            return
        self._log.drop(req_id)  # its table is gone: what it was given this step is no longer news
        # Release tail first: recently used blocks are handed out last, and a request's
        # tail blocks leave the cache before the prefix blocks others are likelier to share.
        for block in reversed(table):
            self._release(block)

    def drain_deltas(self) -> BlockDeltas:
        deltas = BlockDeltas(*self._log.take())
        self.view.apply(deltas.alloc, deltas.freed, deltas.refs)
        return deltas

    def pop_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs (src, dst) made since the last call, to apply before the forward."""
        copies, self._copies = self._copies, []
        return copies

    # ---- accounting ----------------------------------------------------------
    def counters(self) -> KvCounters:
        bs = self.block_size
        tokens = self._sum_filled
        tail = self._sum_holding * bs - tokens
        reserve = (self._sum_table - self._sum_holding) * bs
        return KvCounters(
            total=self.num_blocks,
            used=self.num_used,
            free=self.num_free,
            cached=len(self._evictable),
            shared=self._num_shared,
            token_slots=tokens,
            tail_waste=tail,
            reserve_waste=reserve,
            hit_tokens=self.hit_tokens,
            query_tokens=self.query_tokens,
            cow_copies=self.cow_copies,
        )

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0

    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts, tables, the free list and the cache disagree."""
        expected = [0] * self.num_blocks
        for table in self.tables.values():
            for block in table:
                expected[block] += 1
        assert expected == self.ref_counts, "refcounts disagree with block tables"
        assert set(self._dropped) <= set(self.tables), "a released window outlives its request"
        assert self._num_shared == sum(1 for c in expected if c > 1), "shared-block count drifted"
        sums = [sum(col) for col in zip(*(self._contribution(r) for r in self.tables))] or [0, 0, 0]
        assert sums == [self._sum_filled, self._sum_holding, self._sum_table], "KV token counters drifted"
        free = set(self._free)
        assert len(free) == len(self._free), "a block is on the free list twice"
        cached = set(self._evictable)
        assert not free & cached, "a block is both free and cached"
        free |= cached
        for block in range(self.num_blocks):
            assert (block in free) == (expected[block] == 0), f"block {block} is both used and free, or neither"
        for block in self._evictable:
            assert self.block_hash[block] is not None, f"cached block {block} has no prefix key"
        for block in self._free:
            assert self.block_hash[block] is None, f"plain free block {block} still has a prefix key"
        for key, block in self._by_hash.items():
            assert self.block_hash[block] == key, f"prefix index disagrees with block {block}"
        assert sum(1 for h in self.block_hash if h is not None) == len(self._by_hash), "stray prefix keys"
