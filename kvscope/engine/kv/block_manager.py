"""Paged KV-cache bookkeeping for requests: their block tables, the prefix cache, the sliding window.

Pure bookkeeping, no tensors. Each request owns its block table (``Request.block_table``:
logical block i holds positions i*bs ..); the model runner turns tables into slots. The
pieces, one concept each:

- ``BlockPool`` (block_pool.py): free list, refcounts, cached blocks and their eviction;
- ``PrefixCache`` (prefix_cache.py): sha256-chained keys, key -> block, verified hits;
- the sliding window (``outside_window`` / ``_slide`` here);
- ``KvUsage``: the running sums behind ``counters()``, so a step reads them in O(1);
- one event queue (kv_events.py) that every change is appended to and the engine drains
  once per step for the step event's block deltas and the vLLM KV-event publisher.

Prefix caching (``enable_caching``): once a block is full of computed tokens it is registered
under its key, which names the whole prefix up to the block's end. A request admitted later
whose tokens start with the same prefix shares those physical blocks (refcount + 1) instead of
computing them. A registered block whose refcount drops to 0 stays *cached*: free, but reusable
until allocation evicts it, least recently released first. A shared or cached block is never
written: if the first token to compute falls inside a hit block, that block is copied first
(copy-on-write) and the copy is written.

Sliding window (``sliding_window``, set only when every layer of the model slides by the same
window w): a query at position p reads keys p-w+1..p, so once a request has computed c tokens
its leading blocks wholly before position c-w+1 are never read again. They are released as soon
as the KV is written (``commit``), as vLLM's sliding-window manager does; the request's table
keeps their positions with ``null_block`` standing in. The null block is one block past the pool
(the runner's cache has a row for it): never allocated, never in a delta, and attention never
reads it (its positions are outside every window). A released block is an ordinary release in
the deltas: freed, or with prefix caching a RefChange to 0 that keeps it cached for a later
request with the same prefix. Such a request needs only the cached blocks inside the window of
its first computed token (``match_prefix``), and takes only those.
"""

from __future__ import annotations

from kvscope.engine.kv.block_pool import BlockPool
from kvscope.engine.kv.events import BlockCopied, BlockStored, TableDropped
from kvscope.engine.kv.prefix_cache import PrefixCache
from kvscope.engine.request import Request
from kvscope.protocol.events import KvCounters


def blocks_needed(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size)


class KvUsage:
    """Sums over the requests holding blocks, kept as they change, and prefix-cache statistics.

    tokens: computed tokens whose KV sits in held blocks; holding: held blocks with KV in them.
    (Blocks held at all are the pool's ``num_refs``.)"""

    __slots__ = ("tokens", "holding", "hit_tokens", "query_tokens", "cow_copies")

    def __init__(self) -> None:
        self.tokens = 0
        self.holding = 0
        self.hit_tokens = 0
        self.query_tokens = 0
        self.cow_copies = 0


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = False,
                 sliding_window: int | None = None, salt: bytes = b"") -> None:
        if num_blocks < 1 or block_size < 1:
            raise ValueError("num_blocks and block_size must be >= 1")
        if sliding_window is not None and sliding_window < 1:
            raise ValueError("sliding_window must be >= 1")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.null_block = num_blocks  # stands in for released blocks; not in the pool
        self.events: list = []  # what changed since take_events(): kv_events records, in order
        self.cache = PrefixCache(num_blocks, block_size, salt) if enable_caching else None
        self.pool = BlockPool(num_blocks, self.events, self.cache)
        self.usage = KvUsage()
        self.holders: dict[int, Request] = {}  # the requests holding a block table, by id
        self._copies: list[tuple[int, int]] = []  # copy-on-write work for the runner, this step

    # ---- queries -------------------------------------------------------------
    @property
    def num_free(self) -> int:
        """Blocks an allocation can take: plain free ones and cached ones (evicted on use)."""
        return self.pool.num_free

    @property
    def num_cached(self) -> int:
        return len(self.pool.evictable)

    @property
    def num_prefix_keys(self) -> int:
        """Blocks registered under a prefix key (cached or in use): what vLLM's KV events count."""
        return len(self.cache) if self.cache is not None else 0

    @property
    def cached_blocks(self) -> list[int]:
        """Cached blocks (refcount 0, reusable), least recently released first."""
        return list(self.pool.evictable)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.pool.num_free

    @property
    def capacity_tokens(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def ref_counts(self) -> list[int]:
        return self.pool.ref_counts

    @property
    def evictions(self) -> int:
        return self.pool.evictions

    @property
    def hit_tokens(self) -> int:
        return self.usage.hit_tokens

    @property
    def query_tokens(self) -> int:
        return self.usage.query_tokens

    @property
    def cow_copies(self) -> int:
        return self.usage.cow_copies

    @property
    def hit_rate(self) -> float:
        u = self.usage
        return u.hit_tokens / u.query_tokens if u.query_tokens else 0.0

    def prefix_key(self, block: int) -> bytes | None:
        """The key block is registered under, if any."""
        return self.cache.key_of(block) if self.cache is not None else None

    def held(self, req: Request) -> list[int]:
        """The blocks req holds: its table from the window on."""
        return req.block_table[req.num_released_blocks:]

    @property
    def tables(self) -> dict[int, list[int]]:
        """A view: request id -> the blocks it holds (built on each call; for snapshots and tests)."""
        return {rid: self.held(r) for rid, r in self.holders.items()}

    def table(self, req_id: int) -> list[int]:
        """A view: req_id's logical block table ([] if it holds none)."""
        req = self.holders.get(req_id)
        return req.block_table if req is not None else []

    def outside_window(self, num_computed: int) -> int:
        """Leading logical blocks that no query at position >= num_computed reads (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, num_computed - self.sliding_window + 1) // self.block_size

    def computed_blocks(self, req: Request) -> list[int]:
        """The held blocks with KV a later query can read (what a swap-out must keep), in logical order."""
        self._slide(req)
        n = blocks_needed(req.num_computed_tokens, self.block_size) - req.num_released_blocks
        return self.held(req)[: max(0, n)]

    def new_blocks_for(self, req: Request, total_tokens: int) -> int:
        """Blocks to add so that req's table covers total_tokens slots."""
        return max(0, blocks_needed(total_tokens, self.block_size) - len(req.block_table))

    def can_grow(self, req: Request, total_tokens: int) -> bool:
        return self.new_blocks_for(req, total_tokens) <= self.pool.num_free

    def match_prefix(self, token_ids: list[int]) -> list[int | None]:
        """Cached blocks holding the longest run of token_ids' leading full blocks (empty without caching).

        With a sliding window only the blocks inside the window of the first token to compute are
        read, so the run may start there (as vLLM's sliding-window manager matches): the entries
        before it are None, whether those blocks are still cached or not.
        """
        cache = self.cache
        if cache is None:
            return []
        bs = self.block_size
        blocks: list[int | None] = []
        keys: list[bytes] = []
        for i in range(len(token_ids) // bs):
            cache.keys_for(token_ids, keys, i + 1)
            tokens = token_ids[i * bs : (i + 1) * bs]
            block = cache.lookup(keys[i], cache.parent_of(keys, i), tokens)
            if block is None and self.sliding_window is None:
                break
            blocks.append(block)
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
        refs = self.pool.ref_counts
        taken = sum(1 for b in hits[skip:] if refs[b] == 0)
        return need <= self.pool.num_free - taken

    # ---- mutations -----------------------------------------------------------
    def _hold(self, req: Request, released: int) -> None:
        """req starts holding a table whose first `released` blocks are outside its window."""
        self.holders[req.req_id] = req
        req.num_released_blocks = released
        req.block_table = [self.null_block] * released
        c = req.num_computed_tokens
        self.usage.tokens += c - released * self.block_size
        self.usage.holding += blocks_needed(c, self.block_size) - released

    def admit(self, req: Request, hits: list[int | None], computed: int, total_tokens: int) -> bool:
        """Give a new request the cached blocks `hits` (tokens [0, computed) are in them; they become
        its computed tokens), then blocks up to total_tokens; all or nothing. A hit block that the
        first computed token would write into is copied (copy-on-write) rather than shared."""
        if not self.can_admit(hits, computed, total_tokens):
            return False
        bs = self.block_size
        req.num_computed_tokens = computed
        skip = self.outside_window(computed)
        self._hold(req, skip)
        if self.cache is not None and None not in hits:  # keys of a hit run from block 0; commit() adds the rest
            keys = [self.cache.key_of(b) for b in hits]  # (a fork's last, partly filled hit has none)
            req.block_hashes = keys[: keys.index(None)] if None in keys else keys
        table = req.block_table
        pool = self.pool
        for i, block in enumerate(hits):
            if i < skip:
                continue  # before the window: its KV is never read, so it is not taken
            if computed < (i + 1) * bs:
                # the write at position `computed` lands in this block: copy it first
                copy = pool.take(req.req_id, keep=block)
                self._copies.append((block, copy))
                self.events.append(BlockCopied(block, copy, req.req_id))
                self.usage.cow_copies += 1
                table.append(copy)
                continue
            pool.share(block, req.req_id)
            table.append(block)
        return self._grow(req, total_tokens)  # can_admit checked that it fits

    def adopt(self, heir: Request, source: Request) -> None:
        """heir, a request with source's tokens, takes a reference to every block source holds, and with
        them source's computed tokens (source is freed next: heir then owns the table alone)."""
        heir.num_computed_tokens = source.num_computed_tokens
        self._hold(heir, source.num_released_blocks)
        heir.block_hashes = list(source.block_hashes)
        share, table, rid = self.pool.share, heir.block_table, heir.req_id
        for block in self.held(source):
            share(block, rid)
            table.append(block)

    def trim(self, req: Request, num_tokens: int) -> None:
        """Keep only the blocks holding req's first num_tokens computed tokens (num_tokens <= its computed
        tokens; the blocks it released from a sliding window end before them); the rest are released,
        tail first."""
        bs = self.block_size
        table, keep = req.block_table, blocks_needed(num_tokens, bs)
        old = req.num_computed_tokens
        req.num_computed_tokens = num_tokens
        del req.block_hashes[num_tokens // bs:]
        if req.req_id in self.holders:
            self.usage.tokens -= old - num_tokens
            self.usage.holding -= blocks_needed(old, bs) - keep
        release = self.pool.release
        for i in range(len(table) - 1, max(keep, req.num_released_blocks) - 1, -1):
            release(table[i])
        del table[keep:]

    def grow(self, req: Request, total_tokens: int) -> bool:
        """Make req's table cover total_tokens slots; all or nothing. A new table for a request that
        has computed tokens already (swapped in) starts at its window."""
        if req.req_id not in self.holders:
            need = blocks_needed(total_tokens, self.block_size) - self.outside_window(req.num_computed_tokens)
            if need > self.pool.num_free:
                return False
            self._hold(req, self.outside_window(req.num_computed_tokens))
        return self._grow(req, total_tokens)

    def _grow(self, req: Request, total_tokens: int) -> bool:
        table = req.block_table
        need = blocks_needed(total_tokens, self.block_size) - len(table)
        if need > self.pool.num_free:
            return False
        take, rid = self.pool.take, req.req_id
        for _ in range(need):
            table.append(take(rid))
        return True

    def commit(self, req: Request, num_computed: int) -> None:
        """KV now exists for req's first num_computed tokens (req.num_computed_tokens becomes it); with
        caching, its full blocks are registered; with a sliding window, blocks that left it are released."""
        old = req.num_computed_tokens
        req.num_computed_tokens = num_computed
        if req.req_id not in self.holders:
            return
        bs = self.block_size
        u = self.usage
        u.tokens += num_computed - old
        u.holding += (num_computed + bs - 1) // bs - (old + bs - 1) // bs
        if self.cache is not None:
            self._register(req)
        if self.sliding_window is not None:
            self._slide(req)

    def commit_decodes(self, reqs: list[Request]) -> None:
        """commit(req, computed + 1) for each decoding request of a step (each was given a slot)."""
        if self.cache is not None or self.sliding_window is not None:
            for req in reqs:
                self.commit(req, req.num_computed_tokens + 1)
            return
        bs = self.block_size
        started = 0  # tokens that start a new block: a block more holds KV
        for req in reqs:
            n = req.num_computed_tokens
            if n % bs == 0:
                started += 1
            req.num_computed_tokens = n + 1
        self.usage.tokens += len(reqs)
        self.usage.holding += started

    def _register(self, req: Request) -> None:
        """Register req's full computed blocks under their keys (those not registered already)."""
        bs = self.block_size
        tokens = req.token_ids
        full = min(req.num_computed_tokens, len(tokens)) // bs
        keys = req.block_hashes
        if full <= len(keys):
            return
        cache = self.cache
        start = len(keys)
        cache.keys_for(tokens, keys, full)
        released = req.num_released_blocks
        table = req.block_table
        for i in range(start, full):
            if i < released:
                continue  # released before it was registered (a swapped-in request's prefix)
            block = table[i]
            parent = cache.parent_of(keys, i)
            block_tokens = tuple(tokens[i * bs : (i + 1) * bs])
            if cache.register(block, keys[i], parent, block_tokens):
                self.events.append(BlockStored(keys[i], None if i == 0 else parent, block_tokens, block))

    def _slide(self, req: Request) -> None:
        """Release req's leading blocks that no query from its computed point on can read."""
        released = req.num_released_blocks
        table = req.block_table
        n = min(self.outside_window(req.num_computed_tokens), len(table)) - released
        if n <= 0:
            return
        null, release = self.null_block, self.pool.release
        for i in range(released, released + n):
            release(table[i])
            table[i] = null
        req.num_released_blocks = released + n
        self.usage.tokens -= n * self.block_size
        self.usage.holding -= n

    def record_lookup(self, query_tokens: int, hit_tokens: int) -> None:
        self.usage.query_tokens += query_tokens
        self.usage.hit_tokens += hit_tokens

    def free(self, req: Request) -> None:
        """Drop req's references; blocks nobody references return to the pool (or stay cached)."""
        table, released = req.block_table, req.num_released_blocks
        req.block_table, req.num_released_blocks, req.block_hashes = [], 0, []
        if self.holders.pop(req.req_id, None) is None:
            return
        c = req.num_computed_tokens
        self.usage.tokens -= c - released * self.block_size
        self.usage.holding -= blocks_needed(c, self.block_size) - released
        self.events.append(TableDropped(req.req_id))
        # Release tail first: recently used blocks are handed out last, and a request's
        # tail blocks leave the cache before the prefix blocks others are likelier to share.
        release = self.pool.release
        for i in range(len(table) - 1, released - 1, -1):
            release(table[i])

    def take_events(self) -> list:
        """What changed since the last call (kv_events records, in order); the queue starts empty again."""
        events = self.events[:]
        self.events.clear()  # the pool appends to this same list
        return events

    def pop_copies(self) -> list[tuple[int, int]]:
        """Copy-on-write pairs (src, dst) made since the last call, to apply before the forward."""
        copies, self._copies = self._copies, []
        return copies

    # ---- accounting ----------------------------------------------------------
    def counters(self) -> KvCounters:
        bs = self.block_size
        u = self.usage
        tokens = u.tokens
        return KvCounters(
            total=self.num_blocks,
            used=self.num_used,
            free=self.num_free,
            cached=len(self.pool.evictable),
            shared=self.pool.num_shared,
            token_slots=tokens,
            tail_waste=u.holding * bs - tokens,
            reserve_waste=(self.pool.num_refs - u.holding) * bs,
            hit_tokens=u.hit_tokens,
            query_tokens=u.query_tokens,
            cow_copies=u.cow_copies,
        )

    def check_invariants(self) -> None:
        """Raise AssertionError if refcounts, tables, the free list, the cache or the sums disagree."""
        bs = self.block_size
        expected = [0] * self.num_blocks
        tokens = holding = 0
        for req in self.holders.values():
            released = req.num_released_blocks
            assert req.block_table[:released] == [self.null_block] * released, "a released entry is not null"
            assert released == 0 or self.sliding_window is not None, "a block released without a window"
            for block in self.held(req):
                assert 0 <= block < self.num_blocks, f"held block {block} is outside the pool"
                expected[block] += 1
            c = req.num_computed_tokens
            assert released * bs <= c <= len(req.block_table) * bs, f"request {req.req_id}: KV outside its table"
            tokens += c - released * bs
            holding += blocks_needed(c, bs) - released
        self.pool.check_invariants(expected)
        assert (tokens, holding) == (self.usage.tokens, self.usage.holding), "KV token counters drifted"
        if self.cache is not None:
            self.cache.check_invariants()
