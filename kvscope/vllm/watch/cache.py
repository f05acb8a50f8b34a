"""The cached-block population of a vLLM engine, rebuilt from its KV events.

vLLM's events name blocks by hash, never by physical slot, and say nothing about
requests: this view counts blocks per medium, the rates at which they are stored and
removed (churn), and the shape of the prefix tree the parent hashes draw (roots, depth,
the prefixes most continuations branch from). Memory is bounded: past MAX_BLOCKS the
oldest-stored blocks are forgotten and counted.
"""

from __future__ import annotations

import copy
from collections import Counter, OrderedDict, deque
from dataclasses import dataclass, field

from kvscope.vllm.watch.wire import Batch, Cleared, Removed, Stored

MAX_BLOCKS = 1_000_000
RATE_WINDOW_S = 10.0
TOP_PREFIXES = 5


@dataclass(slots=True)
class Node:
    parent: object
    medium: str
    depth: int
    children: int = 0


@dataclass
class CacheView:
    blocks: OrderedDict = field(default_factory=OrderedDict)  # hash -> Node, in store order
    per_medium: Counter = field(default_factory=Counter)
    roots: int = 0
    stored_total: int = 0
    removed_total: int = 0
    cleared: int = 0
    forgotten: int = 0  # blocks dropped to stay under MAX_BLOCKS
    unknown_removed: int = 0  # removals of hashes never seen stored (e.g. before the view started)
    unknown_events: int = 0
    batches: int = 0
    max_depth: int = 0
    block_size: int = 0
    _recent: deque = field(default_factory=deque)  # (ts, stored, removed) per batch

    def apply(self, batch: Batch) -> None:
        self.batches += 1
        self.unknown_events += batch.unknown
        stored = removed = 0
        for ev in batch.events:
            if type(ev) is Stored:
                stored += self._store(ev)
            elif type(ev) is Removed:
                removed += self._remove(ev)
            elif type(ev) is Cleared:
                self.clear()
        self._recent.append((batch.ts, stored, removed))
        while self._recent and self._recent[0][0] < batch.ts - RATE_WINDOW_S:
            self._recent.popleft()

    def _store(self, ev: Stored) -> int:
        if ev.block_size:
            self.block_size = ev.block_size
        parent = ev.parent
        n = 0
        for h in ev.block_hashes:
            key = _key(h)
            up = self.blocks.get(parent) if parent is not None else None
            if key in self.blocks:  # stored again (another medium, or a resend): re-parent only
                parent = key
                continue
            depth = up.depth + 1 if up is not None else 1
            if up is not None:
                up.children += 1
            else:
                self.roots += 1
            self.blocks[key] = Node(parent, ev.medium, depth)
            self.per_medium[ev.medium] += 1
            self.max_depth = max(self.max_depth, depth)
            n += 1
            parent = key
        self.stored_total += n
        while len(self.blocks) > MAX_BLOCKS:
            key, node = self.blocks.popitem(last=False)
            self._forget(key, node)
            self.forgotten += 1
        return n

    def _forget(self, key, node: Node) -> None:
        self.per_medium[node.medium] -= 1
        up = self.blocks.get(node.parent) if node.parent is not None else None
        if up is not None:
            up.children -= 1
        else:
            self.roots -= 1

    def _remove(self, ev: Removed) -> int:
        n = 0
        for h in ev.block_hashes:
            key = _key(h)
            node = self.blocks.pop(key, None)
            if node is None:
                self.unknown_removed += 1
                continue
            self._forget(key, node)
            n += 1
        self.removed_total += n
        return n

    def clear(self) -> None:
        self.cleared += 1
        self.blocks.clear()
        self.per_medium.clear()
        self.roots = 0
        self.max_depth = 0

    def copy(self) -> "CacheView":
        """The counters, rates and tallies as they are now (the block index itself is shared, not copied)."""
        view = copy.copy(self)
        view.per_medium = Counter(self.per_medium)
        view._recent = deque(self._recent)
        return view

    # -- what the screen shows ------------------------------------------------------
    @property
    def cached_blocks(self) -> int:
        return len(self.blocks)

    def rates(self) -> tuple[float, float]:
        """(stored, removed) blocks per second over the last RATE_WINDOW_S of event time."""
        if len(self._recent) < 2:
            return 0.0, 0.0
        span = self._recent[-1][0] - self._recent[0][0]
        if span <= 0:
            return 0.0, 0.0
        return (sum(s for _, s, _ in self._recent) / span, sum(r for _, _, r in self._recent) / span)

    def churn(self) -> float:
        """Removed per stored over the window: 0 while the cache fills, near 1 when it turns over."""
        stored = sum(s for _, s, _ in self._recent)
        removed = sum(r for _, _, r in self._recent)
        return removed / stored if stored else 0.0

    def top_prefixes(self, k: int = TOP_PREFIXES) -> list[tuple[object, int, int]]:
        """(hash, depth, continuations) of the blocks most continuations branch from."""
        best = sorted(((n.children, -n.depth, h) for h, n in self.blocks.items() if n.children > 1), reverse=True)
        return [(h, -d, c) for c, d, h in best[:k]]


def _key(h) -> object:
    return bytes(h) if isinstance(h, (bytes, bytearray, memoryview)) else h
