"""A watched vLLM in a trace: the view's inputs as protocol events, and back.

`kvscope record --vllm` turns each parsed scrape into a ``vllm_metrics`` event and each
decoded KV batch into a ``vllm_kv`` event; a ``vllm_snapshot`` holds the cache view
itself (every block with its parent, medium, depth and children, plus the tallies), so
a chunk opened by one rebuilds the view exactly. Replaying applies the same objects to a
fresh VllmState: the screen cannot tell a replay from the live run.

The protocol has no bin type, so a bytes hash is stored as its hex string, and an int
hash outside int64 as ``hex(h)``; equal hashes stay equal, which is all the view uses.
"""

from __future__ import annotations

import hashlib
import math
from collections import Counter, OrderedDict

from kvscope.vllm.watch.cache import CacheView, Node
from kvscope.vllm.watch.metrics import MetricsView, Scrape
from kvscope.vllm.watch.wire import Batch, Cleared, KvEvent, Removed, Stored
from kvscope.protocol.events import (
    INT64_MAX,
    INT64_MIN,
    MAX_LIST_LEN,
    MAX_NAME_LEN,
    VllmBlockEvent,
    VllmCachedBlock,
    VllmKvCounters,
    VllmKvEvent,
    VllmMetricsEvent,
    VllmSnapshotEvent,
)

MAX_KEYS = 1024  # map keys per event (the codec's map cap)
MAX_BUCKETS = 4096
_HEX_BYTES = (MAX_NAME_LEN - 2) // 2  # longest bytes hash kept as plain hex


def wire_hash(h) -> int | str:
    """A vLLM block hash (int or bytes) as the protocol stores it (a stored one is returned as it is)."""
    if isinstance(h, str):
        return h
    if isinstance(h, bool):
        return int(h)
    if isinstance(h, int):
        return h if INT64_MIN <= h <= INT64_MAX else hex(h)
    b = bytes(h)
    if len(b) <= _HEX_BYTES:
        return b.hex()
    return "b2:" + hashlib.blake2b(b, digest_size=32).hexdigest()  # still one name per hash


def _opt_hash(h):
    return None if h is None else wire_hash(h)


# ---- scrapes -----------------------------------------------------------------------------
# What the protocol refuses is never written: values must be finite (a bucket bound may be
# +Inf), maps are capped, names cut to the protocol's length. What is dropped is counted.
def _capped(d: dict, skipped: list[int], finite: bool = True) -> dict:
    out = {}
    for k, v in d.items():
        if len(out) >= MAX_KEYS or (finite and not _finite(v)):
            skipped[0] += 1
            continue
        out[str(k)[:MAX_NAME_LEN]] = v
    return out


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def metrics_event(step: int, t: float, scrape: Scrape) -> VllmMetricsEvent:
    skipped = [scrape.skipped]
    by_label = {k: _capped(v, skipped) for k, v in _capped(scrape.by_label, skipped, finite=False).items()}
    buckets = {}
    for name, pairs in _capped(scrape.buckets, skipped, finite=False).items():
        kept = [(float(le), float(c)) for le, c in pairs if (_finite(le) or le == math.inf) and _finite(c)]
        skipped[0] += len(pairs) - len(kept)
        if len(kept) > MAX_BUCKETS:
            skipped[0] += len(kept) - MAX_BUCKETS
            kept = kept[:MAX_BUCKETS]
        buckets[name] = kept
    return VllmMetricsEvent(step, _time(t), gauges=_capped(scrape.gauges, skipped), by_label=by_label,
                            counters=_capped(scrape.counters, skipped), buckets=buckets, skipped=skipped[0],
                            model=scrape.model)


def _time(t: float) -> float:
    return float(t) if _finite(t) else 0.0


def _int64(v, default):
    return v if isinstance(v, int) and INT64_MIN <= v <= INT64_MAX else default


def failed_scrape_event(step: int, t: float, message: str) -> VllmMetricsEvent:
    return VllmMetricsEvent(step, t, error=message[:1000])


def scrape_from(ev: VllmMetricsEvent, wall_start: float) -> Scrape:
    return Scrape(wall_start + ev.t, gauges=dict(ev.gauges), by_label={k: dict(v) for k, v in ev.by_label.items()},
                  counters=dict(ev.counters), buckets={k: [(le, c) for le, c in v] for k, v in ev.buckets.items()},
                  skipped=ev.skipped, model=ev.model)


# ---- KV batches --------------------------------------------------------------------------
def _block_event(ev: KvEvent) -> VllmBlockEvent:
    if type(ev) is Stored:
        size = ev.block_size if isinstance(ev.block_size, int) and 0 <= ev.block_size <= INT64_MAX else 0
        return VllmBlockEvent("stored", [wire_hash(h) for h in ev.block_hashes], _opt_hash(ev.parent),
                              ev.num_tokens, size, ev.medium[:MAX_NAME_LEN])
    if type(ev) is Removed:
        return VllmBlockEvent("removed", [wire_hash(h) for h in ev.block_hashes], medium=ev.medium[:MAX_NAME_LEN])
    return VllmBlockEvent("cleared")


def kv_counters(kv) -> VllmKvCounters:
    """The subscriber's tallies (adapters.vllm_source.KvStats) as recorded."""
    return VllmKvCounters(kv.received, kv.replayed, kv.malformed, kv.gaps, kv.missed, kv.last_seq)


def kv_event(step: int, t: float, seq: int, batch: Batch, *, replayed: bool, kv) -> VllmKvEvent:
    events = [_block_event(e) for e in batch.events[:MAX_LIST_LEN]]
    return VllmKvEvent(step, _time(t), seq, _time(batch.ts), _int64(batch.dp_rank, None), events, batch.unknown,
                       replayed, kv_counters(kv))


def batch_from(ev: VllmKvEvent) -> Batch:
    events: list[KvEvent] = []
    for e in ev.events:
        if e.kind == "stored":
            events.append(Stored(list(e.hashes), e.parent, e.tokens, e.block_size, e.medium))
        elif e.kind == "removed":
            events.append(Removed(list(e.hashes), e.medium))
        else:
            events.append(Cleared())
    return Batch(ev.ts, events, ev.dp_rank, ev.unknown)


def restore_kv(kv, c: VllmKvCounters) -> None:
    kv.received, kv.replayed, kv.malformed = c.received, c.replayed, c.malformed
    kv.gaps, kv.missed, kv.last_seq = c.gaps, c.missed, c.last_seq


# ---- the cache view itself ---------------------------------------------------------------
def snapshot_event(step: int, t: float, cache: CacheView, kv, metrics: MetricsView,
                   wall_start: float) -> VllmSnapshotEvent:
    blocks = [VllmCachedBlock(wire_hash(h), _opt_hash(n.parent), n.medium[:MAX_NAME_LEN], n.depth, max(0, n.children))
              for h, n in cache.blocks.items()]
    window = list(metrics.scrapes)
    ends = window[:1] + window[1:][-1:]
    scrapes = [metrics_event(step, s.t - wall_start, s) for s in ends]
    return VllmSnapshotEvent(step, t, blocks, max(0, cache.roots), cache.max_depth, cache.block_size,
                             cache.stored_total, cache.removed_total, cache.cleared, cache.forgotten,
                             cache.unknown_removed, cache.unknown_events, cache.batches, kv_counters(kv),
                             metrics.errors, scrapes)


def metrics_from(snap: VllmSnapshotEvent, wall_start: float, window_s: float) -> MetricsView:
    """The metrics window as far as a snapshot keeps it: its first and last scrape."""
    view = MetricsView(window_s=window_s)
    for ev in snap.scrapes:
        view.add(scrape_from(ev, wall_start))
    view.errors = snap.metrics_errors
    return view


def cache_from(snap: VllmSnapshotEvent) -> CacheView:
    """The view the snapshot was taken of: same blocks in the same order, same tallies."""
    view = CacheView()
    blocks: OrderedDict = OrderedDict()
    media: Counter = Counter()
    for b in snap.blocks:
        blocks[b.hash] = Node(b.parent, b.medium, b.depth, b.children)
        media[b.medium] += 1
    view.blocks, view.per_medium = blocks, media
    view.roots, view.max_depth, view.block_size = snap.roots, snap.max_depth, snap.block_size
    view.stored_total, view.removed_total, view.cleared = snap.stored_total, snap.removed_total, snap.cleared
    view.forgotten, view.unknown_removed = snap.forgotten, snap.unknown_removed
    view.unknown_events, view.batches = snap.unknown_events, snap.batches
    return view
