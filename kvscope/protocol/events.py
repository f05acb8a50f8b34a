"""Event schema, version 1: the only contract between the engine and its watchers.

Every event is a msgspec Struct here, and these declarations are the schema: the
codec (``kvscope.protocol.codec``) decodes straight into them, so every type, range,
enum and length below is checked on the way in. On the wire a top-level event is a
msgpack map tagged by ``type``; nested records are positional arrays
(``array_like``) in the field order declared below (docs/PROTOCOL.md). Times are
seconds on the engine's clock (0 at engine start) unless a field says ``wall``.
"""

from enum import StrEnum
from typing import Annotated, ClassVar, Literal, Union

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

PROTOCOL_VERSION = 1

# Request states as they appear in snapshots.
WAITING, RUNNING, PREEMPTED, SWAPPED, FINISHED = "waiting", "running", "preempted", "swapped", "finished"
REQUEST_STATES = (WAITING, RUNNING, PREEMPTED, SWAPPED, FINISHED)

# Why the head of WAITING was not admitted this step.
BLOCKED_KV = "kv_blocks"
BLOCKED_BUDGET = "token_budget"
BLOCKED_SEQS = "max_num_seqs"
BLOCKED_STATIC = "static_batch_running"  # static mode admits only between batches
BLOCK_REASONS = (BLOCKED_KV, BLOCKED_BUDGET, BLOCKED_SEQS, BLOCKED_STATIC)

VERDICT_ADMITTED, VERDICT_BLOCKED, VERDICT_IDLE = "admitted", "blocked", "idle"

PREFILL, DECODE = "prefill", "decode"
SWAP_OUT, SWAP_IN = "out", "in"

# Why a request finished (Finish.reason). "abort" was added within v1: the request was
# ended early (its HTTP client disconnected); older streams never carry it. "error" was
# added within v1 too: building its inputs, running the model or sampling failed for this
# request, which ended alone while the others went on.
FINISH_STOP, FINISH_LENGTH, FINISH_MAX_MODEL_LEN, FINISH_ABORT = "stop", "length", "max_model_len", "abort"
FINISH_ERROR = "error"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_MAX_MODEL_LEN, FINISH_ABORT, FINISH_ERROR)


class Mode(StrEnum):
    """The scheduler's four modes (hello.config.mode): settings of one scheduler, see engine/scheduler.py."""

    NAIVE = "naive"
    STATIC = "static"
    CONTINUOUS = "continuous"
    CHUNKED = "chunked"


MODES = tuple(Mode)

# What a preempted request loses (Preemption.mode): its KV is recomputed later, or swapped to CPU and back.
PREEMPT_RECOMPUTE, PREEMPT_SWAP = "recompute", "swap"
PREEMPTION_MODES = (PREEMPT_RECOMPUTE, PREEMPT_SWAP)

# Where a request came from (RequestEvent.source, RequestState.source; added within v1).
SOURCE_ENGINE, SOURCE_HTTP = "", "http"  # "": the engine's own workload or control injections

# ----------------------------------------------------------------------------- limits
MAX_LIST_LEN = 1 << 20  # any array (block lists of a large KV pool fit)
MAX_NAME_LEN = 1024  # reason / mode / name strings
MAX_TEXT_LEN = 64 << 10  # free text (a model path)
INT64_MIN, INT64_MAX = -(1 << 63), (1 << 63) - 1
_FLOAT_MAX = 1.7976931348623157e308

# Field types: the constraints are part of the schema.
Int = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]  # request ids, steps, priorities
Count = Annotated[int, Meta(ge=0, le=INT64_MAX)]  # counts, lengths, block ids
Float = Annotated[float, Meta(ge=-_FLOAT_MAX, le=_FLOAT_MAX)]  # finite (NaN fails both bounds)
Name = Annotated[str, Meta(max_length=MAX_NAME_LEN)]
Text = Annotated[str, Meta(max_length=MAX_TEXT_LEN)]
IntList = Annotated[list[Int], Meta(max_length=MAX_LIST_LEN)]
CountList = Annotated[list[Count], Meta(max_length=MAX_LIST_LEN)]
Kind = Literal["prefill", "decode"]
Verdict = Literal["admitted", "blocked", "idle"]
State = Literal["waiting", "running", "preempted", "swapped", "finished"]
Direction = Literal["out", "in"]
Source = Annotated[str, Meta(max_length=16)]


def _list(t):
    return Annotated[list[t], Meta(max_length=MAX_LIST_LEN)]


# ------------------------------------------------------------------- nested records
class BatchEntry(Struct, array_like=True, gc=False):
    req: Int
    kind: Kind  # PREFILL or DECODE
    tokens: Count  # tokens computed for this request this step
    start: Count  # position of the first of them


class Admission(Struct, array_like=True, gc=False):
    verdict: Verdict
    reason: Name | None = None  # one of BLOCK_REASONS when blocked
    req: Int | None = None  # the head of WAITING the verdict is about


class Preemption(Struct, array_like=True, gc=False):
    req: Int
    reason: Name  # "kv_blocks" or "priority"
    mode: Name = PREEMPT_RECOMPUTE  # or PREEMPT_SWAP


class BlockAlloc(Struct, array_like=True, gc=False):
    block: Count
    req: Int


class RefChange(Struct, array_like=True, gc=False):
    block: Count
    refcount: Count


class FirstToken(Struct, array_like=True, gc=False):
    req: Int
    ttft: Float


class Finish(Struct, array_like=True, gc=False):
    req: Int
    ttft: Float
    e2e: Float
    output_len: Count
    reason: Name  # one of FINISH_REASONS (a later v1 writer may add more)


class ItlSample(Struct, array_like=True, gc=False):
    req: Int
    gap: Float


class PrefixHit(Struct, array_like=True, gc=False):
    req: Int
    tokens: Count  # prompt tokens found in the prefix cache at admission (not computed)
    blocks: Count  # cached blocks the request now shares or revived


class Swap(Struct, array_like=True, gc=False):
    req: Int
    direction: Direction  # SWAP_OUT (KV copied to CPU, request SWAPPED) or SWAP_IN (copied back, RUNNING)
    blocks: Count  # blocks copied


class KvCounters(Struct, array_like=True, gc=False):
    total: Count = 0  # blocks in the pool
    used: Count = 0  # blocks referenced by a live request
    free: Count = 0  # blocks on the free list (cached ones included)
    cached: Count = 0  # free blocks still holding a reusable prefix
    shared: Count = 0  # blocks referenced by more than one request
    token_slots: Count = 0  # slots holding a computed token
    tail_waste: Count = 0  # empty slots in partly filled last blocks
    reserve_waste: Count = 0  # empty slots in whole blocks reserved ahead (static/naive reservation)
    # added with prefix caching and swapping (older streams decode them as 0)
    swap_total: Count = 0  # blocks in the CPU swap pool (preemption mode "swap")
    swap_used: Count = 0  # CPU swap blocks holding a swapped-out request's KV
    hit_tokens: Count = 0  # prompt tokens served from the prefix cache, since start
    query_tokens: Count = 0  # prompt tokens looked up in the prefix cache, since start
    cow_copies: Count = 0  # shared blocks copied before a write (copy-on-write), since start


class RequestState(Struct, array_like=True, gc=False):
    req: Int
    state: State  # one of REQUEST_STATES
    prompt_len: Count
    max_tokens: Count
    computed: Count  # tokens whose KV is in the cache
    output_len: Count
    priority: Int
    arrival: Float
    ttft: Float | None
    preemptions: Count
    cached_tokens: Count = 0  # prompt tokens served from the prefix cache (added with prefix caching)
    source: Source = SOURCE_ENGINE  # as in RequestEvent (added with the HTTP API)


class BlockOwner(Struct, array_like=True, gc=False):
    block: Count
    req: Int  # the request whose table holds it (first owner for shared blocks)
    refcount: Count


# ------------------------------------------------------------------------ engine info
class EngineInfo(Struct, kw_only=True):
    """``hello.config``: what the engine runs, as typed fields (a map on the wire).

    Fields a stream leaves out decode to their defaults ("" / None: not reported);
    unknown keys are ignored. Fields whose default is UNSET are sent only by the
    backends they concern (the sim's, a GPU's name) and are left out of the map when
    unset, so an engine's hello encodes exactly the keys it sets, in this order.
    """

    model: Text = ""
    device: Name = ""
    dtype: Name = ""
    backend: Name = ""  # "model" or "sim"
    mode: Name = ""  # naive, static, continuous, chunked
    policy: Text = ""
    block_size: Annotated[int, Meta(ge=1, le=INT64_MAX)] = 16
    num_blocks: Count | None = None
    max_num_seqs: Count | None = None
    max_num_batched_tokens: Count | None = None
    max_model_len: Count | None = None
    seed: Int | None = None
    prefix_caching: bool = False
    preemption: Name = ""  # "recompute" or "swap"
    swap_space: Float | None = None  # GiB of CPU memory for swapped-out KV
    kv_cache_space: Float | None | UnsetType = UNSET  # CPU: GiB asked for the KV cache (None: sized from memory)
    cpu_threads: Count | None = None
    enforce_eager: bool = False
    gpu_memory_utilization: Float | None = None
    gpu: Name | UnsetType = UNSET  # sim: catalog GPU
    tp: Count | UnsetType = UNSET  # sim: tensor-parallel degree
    kv_cache_dtype: Name | UnsetType = UNSET
    sim_efficiency: Annotated[dict[Name, Float], Meta(max_length=64)] | None | UnsetType = UNSET
    sim_pace: Float | None | UnsetType = UNSET
    kv_cache_bytes: Count | UnsetType = UNSET  # the KV cache's size as chosen at start-up
    attention: Name = ""  # the attention implementation
    preemption_mode: Name = ""
    sim_model: Name | UnsetType = UNSET  # sim: catalog model shape
    weight_dtype: Name | UnsetType = UNSET
    device_name: Text | UnsetType = UNSET  # CUDA: the GPU's name
    max_waiting: Count | None | UnsetType = UNSET  # cap of queued requests
    vllm_url: Text | UnsetType = UNSET  # a recorded vLLM (backend "vllm"): what was watched
    vllm_kv_events: Text | UnsetType = UNSET
    vllm_kv_replay: Text | UnsetType = UNSET
    vllm_interval: Float | UnsetType = UNSET  # seconds between scrapes

    def as_dict(self) -> dict:
        """The fields that are set, as a plain dict (for display and tools)."""
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not UNSET}


def engine_info(config: dict | EngineInfo) -> EngineInfo:
    """An EngineInfo from an engine's config dict (keys it does not know are dropped)."""
    if isinstance(config, EngineInfo):
        return config
    known = EngineInfo.__struct_fields__
    return EngineInfo(**{k: v for k, v in config.items() if k in known})


# ---------------------------------------------------------------------------- events
class HelloEvent(Struct, tag="hello", tag_field="type"):
    type: ClassVar[str] = "hello"
    version: Int
    config: EngineInfo
    wall_start: Float

    def __post_init__(self) -> None:
        if type(self.config) is not EngineInfo:  # built by hand from a dict
            self.config = engine_info(self.config)


class RequestEvent(Struct, tag="request", tag_field="type"):
    type: ClassVar[str] = "request"
    req: Int
    prompt_len: Count
    max_tokens: Count
    priority: Int
    arrival: Float
    source: Source = SOURCE_ENGINE  # SOURCE_HTTP for a request sent to the HTTP API (optional: older streams omit it)


class RejectEvent(Struct, tag="reject", tag_field="type"):
    type: ClassVar[str] = "reject"
    req: Int
    reason: Name
    t: Float


class StepEvent(Struct, tag="step", tag_field="type"):
    type: ClassVar[str] = "step"
    step: Int
    t: Float
    dur: Float
    budget: Count
    batch: _list(BatchEntry) = []
    padding: Count = 0  # padded tokens computed for nothing (static mode)
    running: IntList = []
    waiting: IntList = []
    preempted: IntList = []
    swapped: IntList = []
    admission: Admission = msgspec.field(default_factory=lambda: Admission(VERDICT_IDLE))
    preemptions: _list(Preemption) = []
    alloc: _list(BlockAlloc) = []
    freed: CountList = []
    refs: _list(RefChange) = []
    sampled: IntList = []  # requests that got an output token
    first_tokens: _list(FirstToken) = []
    finished: _list(Finish) = []
    itl: _list(ItlSample) = []
    kv: KvCounters = msgspec.field(default_factory=KvCounters)
    dropped: Count = 0  # events lost by the publisher since the previous step
    # added with prefix caching and swapping (optional: older streams omit them)
    hits: _list(PrefixHit) = []  # prefix-cache hits of requests admitted this step
    swaps: _list(Swap) = []  # swaps out (with a "swap" preemption) and in


class SnapshotEvent(Struct, tag="snapshot", tag_field="type"):
    type: ClassVar[str] = "snapshot"
    step: Int
    t: Float
    requests: _list(RequestState) = []
    blocks: _list(BlockOwner) = []
    # {req: [block, ...]} here; an array of [req, [block, ...]] pairs on the wire (the codec)
    block_tables: dict[Int, CountList] = {}
    running: IntList = []
    waiting: IntList = []
    preempted: IntList = []
    swapped: IntList = []
    kv: KvCounters = msgspec.field(default_factory=KvCounters)


class ByeEvent(Struct, tag="bye", tag_field="type"):
    type: ClassVar[str] = "bye"
    step: Int
    t: Float
    reason: Name = "drained"


# ------------------------------------------------- a watched vLLM (added within v1)
# `kvscope record --vllm` stores what it saw of a vLLM engine in a trace whose hello has
# config.backend "vllm": parsed metric scrapes, normalized KV-event batches, and the
# snapshots that open chunks. Each scrape or batch is one tick of the trace's `step`
# counter, so chunks, seek and the index work as for an engine's trace.
BlockHash = Union[Int, Name]  # vLLM's int hash when it fits int64, else a hex string (bytes: no bin on the wire)
BucketBound = Annotated[float, Meta(ge=-_FLOAT_MAX)]  # +Inf allowed (the last bucket), NaN and -Inf not
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


class VllmMetricsEvent(Struct, tag="vllm_metrics", tag_field="type"):
    """One /metrics scrape, parsed: only `vllm:` families, summed over engines (prefix dropped)."""

    type: ClassVar[str] = "vllm_metrics"
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


class VllmKvEvent(Struct, tag="vllm_kv", tag_field="type"):
    """One KV-event batch as received (or replayed), in one shape whatever vLLM's encoding."""

    type: ClassVar[str] = "vllm_kv"
    step: Int
    t: Float
    seq: Int
    ts: Float  # vLLM's own batch timestamp
    dp_rank: Int | None = None
    events: _list(VllmBlockEvent) = []
    unknown: Count = 0  # events of a type the recorder did not know
    replayed: bool = False
    kv: VllmKvCounters = msgspec.field(default_factory=VllmKvCounters)  # the subscriber's tallies after it


class VllmSnapshotEvent(Struct, tag="vllm_snapshot", tag_field="type"):
    """The cache population as the recorder's view holds it, in store order: what opens a chunk."""

    type: ClassVar[str] = "vllm_snapshot"
    step: Int
    t: Float
    blocks: _list(VllmCachedBlock) = []
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


Event = Union[HelloEvent, RequestEvent, RejectEvent, StepEvent, SnapshotEvent, ByeEvent,
              VllmMetricsEvent, VllmKvEvent, VllmSnapshotEvent]

EVENT_TYPES: dict[str, type] = {
    "hello": HelloEvent,
    "request": RequestEvent,
    "reject": RejectEvent,
    "step": StepEvent,
    "snapshot": SnapshotEvent,
    "bye": ByeEvent,
    "vllm_metrics": VllmMetricsEvent,
    "vllm_kv": VllmKvEvent,
    "vllm_snapshot": VllmSnapshotEvent,
}

# The roles a trace gives events: a chunk opens with a snapshot; ticks advance `step`.
SNAPSHOT_TYPES = (SnapshotEvent, VllmSnapshotEvent)
TICK_TYPES = (StepEvent, VllmMetricsEvent, VllmKvEvent)
BACKEND_VLLM = "vllm"  # hello.config.backend of a recorded vLLM
