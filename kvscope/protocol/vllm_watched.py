"""A watched vLLM in a trace (added within protocol v1): the events `kvscope record --vllm` writes.

`kvscope record --vllm` stores what it saw of a vLLM engine in a trace whose hello has
config.backend "vllm": parsed metric scrapes, normalized KV-event batches, and the
snapshots that open chunks. Each scrape or batch is one tick of the trace's `step`
counter, so chunks, seek and the index work as for an engine's trace.

These are protocol events like the engine's (the one decoder's union holds them, see
``kvscope.protocol.events``), kept in a module of their own because only a recorded vLLM
carries them; ``kvscope.vllm.watch.trace`` converts them to and from the adapter's
view, and the adapter's one fold (``adapters.vllm_source.apply_batch`` over a
``VllmState``) applies them live and in replay (docs/ARCHITECTURE.md says why that
fold is not the engine's reducer).
"""

from typing import Annotated, Literal, Union

import msgspec
from msgspec import Meta, Struct

from .types import FLOAT_MAX, MAX_LIST_LEN, Count, Float, Int, Name, ProtocolEvent, Text, list_of

BlockHash = Union[Int, Name]  # vLLM's int hash when it fits int64, else a hex string (bytes: no bin on the wire)
BucketBound = Annotated[float, Meta(ge=-FLOAT_MAX)]  # +Inf allowed (the last bucket), NaN and -Inf not
NameMap = Annotated[dict[Name, Float], Meta(max_length=1024)]


class VllmBlockEvent(Struct, array_like=True, gc=False):
    kind: Literal["stored", "removed", "cleared"]
    hashes: Annotated[list[BlockHash], Meta(max_length=MAX_LIST_LEN)] = []
    parent: BlockHash | None = None  # stored: the block the first of them continues
    tokens: Count = 0  # stored: tokens in the blocks
    block_size: Count = 0
    medium: Name = "GPU"


class VllmCachedBlock(Struct, array_like=True, gc=False):
    hash: BlockHash
    parent: BlockHash | None
    medium: Name
    depth: Count
    children: Count


class VllmKvCounters(Struct, array_like=True, gc=False):
    received: Count = 0
    replayed: Count = 0
    malformed: Count = 0
    gaps: Count = 0
    missed: Count = 0
    last_seq: Int = -1


class VllmMetricsEvent(ProtocolEvent, tag="vllm_metrics"):
    """One /metrics scrape, parsed: only `vllm:` families, summed over engines (prefix dropped)."""

    step: Int
    t: Float  # seconds since the recording started
    gauges: NameMap = {}
    by_label: Annotated[dict[Name, NameMap], Meta(max_length=1024)] = {}  # gauge -> reason -> value
    counters: NameMap = {}  # name without _total
    buckets: Annotated[dict[Name, Annotated[list[tuple[BucketBound, Float]], Meta(max_length=4096)]],
                       Meta(max_length=1024)] = {}  # cumulative (le, count)
    skipped: Count = 0
    model: Text | None = None  # the model_name label, when the scrape has one
    error: Text | None = None  # the scrape failed: nothing else is set


class VllmKvEvent(ProtocolEvent, tag="vllm_kv"):
    """One KV-event batch as received (or replayed), in one shape whatever vLLM's encoding."""

    step: Int
    t: Float
    seq: Int
    ts: Float  # vLLM's own batch timestamp
    dp_rank: Int | None = None
    events: list_of(VllmBlockEvent) = []
    unknown: Count = 0  # events of a type the recorder did not know
    replayed: bool = False
    kv: VllmKvCounters = msgspec.field(default_factory=VllmKvCounters)  # the subscriber's tallies after it


class VllmSnapshotEvent(ProtocolEvent, tag="vllm_snapshot"):
    """The cache population as the recorder's view holds it, in store order: what opens a chunk."""

    step: Int
    t: Float
    blocks: list_of(VllmCachedBlock) = []
    roots: Count = 0
    max_depth: Count = 0
    block_size: Count = 0
    stored_total: Count = 0
    removed_total: Count = 0
    cleared: Count = 0
    forgotten: Count = 0
    unknown_removed: Count = 0
    unknown_events: Count = 0
    batches: Count = 0
    kv: VllmKvCounters = msgspec.field(default_factory=VllmKvCounters)
    metrics_errors: Count = 0
    # the oldest and the newest scrape of the metrics window, so rates and bucket deltas
    # show at once after a seek
    scrapes: Annotated[list[VllmMetricsEvent], Meta(max_length=2)] = []
