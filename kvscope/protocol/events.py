"""Event schema, version 1: the only contract between the engine and its watchers.

Every event is a dataclass here. On the wire a top-level event is a msgpack map
with a ``type`` key; nested records are encoded as positional arrays in the field
order declared below (see docs/PROTOCOL.md). Times are seconds on the engine's
clock (0 at engine start) unless a field says ``wall``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Union

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

# Why a request finished (Finish.reason). "abort" was added within v1: the request was
# ended early (its HTTP client disconnected); older streams never carry it.
FINISH_STOP, FINISH_LENGTH, FINISH_MAX_MODEL_LEN, FINISH_ABORT = "stop", "length", "max_model_len", "abort"
FINISH_REASONS = (FINISH_STOP, FINISH_LENGTH, FINISH_MAX_MODEL_LEN, FINISH_ABORT)

# Where a request came from (RequestEvent.source, RequestState.source; added within v1).
SOURCE_ENGINE, SOURCE_HTTP = "", "http"  # "": the engine's own workload or control injections


@dataclass(slots=True)
class BatchEntry:
    req: int
    kind: str  # PREFILL or DECODE
    tokens: int  # tokens computed for this request this step
    start: int  # position of the first of them


@dataclass(slots=True)
class Admission:
    verdict: str  # VERDICT_*
    reason: str | None = None  # one of BLOCK_REASONS when blocked
    req: int | None = None  # the head of WAITING the verdict is about


@dataclass(slots=True)
class Preemption:
    req: int
    reason: str  # e.g. "kv_blocks"
    mode: str = "recompute"  # or "swap"


@dataclass(slots=True)
class BlockAlloc:
    block: int
    req: int


@dataclass(slots=True)
class RefChange:
    block: int
    refcount: int


@dataclass(slots=True)
class FirstToken:
    req: int
    ttft: float


@dataclass(slots=True)
class Finish:
    req: int
    ttft: float
    e2e: float
    output_len: int
    reason: str  # one of FINISH_REASONS


@dataclass(slots=True)
class ItlSample:
    req: int
    gap: float


@dataclass(slots=True)
class PrefixHit:
    req: int
    tokens: int  # prompt tokens found in the prefix cache at admission (not computed)
    blocks: int  # cached blocks the request now shares or revived


@dataclass(slots=True)
class Swap:
    req: int
    direction: str  # SWAP_OUT (KV copied to CPU, request SWAPPED) or SWAP_IN (copied back, RUNNING)
    blocks: int  # blocks copied


SWAP_OUT, SWAP_IN = "out", "in"


@dataclass(slots=True)
class KvCounters:
    total: int = 0  # blocks in the pool
    used: int = 0  # blocks referenced by a live request
    free: int = 0  # blocks on the free list (cached ones included)
    cached: int = 0  # free blocks still holding a reusable prefix
    shared: int = 0  # blocks referenced by more than one request
    token_slots: int = 0  # slots holding a computed token
    tail_waste: int = 0  # empty slots in partly filled last blocks
    reserve_waste: int = 0  # empty slots in whole blocks reserved ahead (static/naive reservation)
    # added with prefix caching and swapping (older streams decode them as 0)
    swap_total: int = 0  # blocks in the CPU swap pool (preemption mode "swap")
    swap_used: int = 0  # CPU swap blocks holding a swapped-out request's KV
    hit_tokens: int = 0  # prompt tokens served from the prefix cache, since start
    query_tokens: int = 0  # prompt tokens looked up in the prefix cache, since start
    cow_copies: int = 0  # shared blocks copied before a write (copy-on-write), since start


@dataclass(slots=True)
class HelloEvent:
    version: int
    config: dict[str, Any]
    wall_start: float
    type: str = "hello"


@dataclass(slots=True)
class RequestEvent:
    req: int
    prompt_len: int
    max_tokens: int
    priority: int
    arrival: float
    source: str = SOURCE_ENGINE  # SOURCE_HTTP for a request sent to the HTTP API (optional: older streams omit it)
    type: str = "request"


@dataclass(slots=True)
class RejectEvent:
    req: int
    reason: str
    t: float
    type: str = "reject"


@dataclass(slots=True)
class StepEvent:
    step: int
    t: float
    dur: float
    budget: int
    batch: list[BatchEntry] = field(default_factory=list)
    padding: int = 0  # padded tokens computed for nothing (static mode)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    admission: Admission = field(default_factory=lambda: Admission(VERDICT_IDLE))
    preemptions: list[Preemption] = field(default_factory=list)
    alloc: list[BlockAlloc] = field(default_factory=list)
    freed: list[int] = field(default_factory=list)
    refs: list[RefChange] = field(default_factory=list)
    sampled: list[int] = field(default_factory=list)  # requests that got an output token
    first_tokens: list[FirstToken] = field(default_factory=list)
    finished: list[Finish] = field(default_factory=list)
    itl: list[ItlSample] = field(default_factory=list)
    kv: KvCounters = field(default_factory=KvCounters)
    dropped: int = 0  # events lost by the publisher since the previous step
    # added with prefix caching and swapping (optional: older streams omit them)
    hits: list[PrefixHit] = field(default_factory=list)  # prefix-cache hits of requests admitted this step
    swaps: list[Swap] = field(default_factory=list)  # swaps out (with a "swap" preemption) and in
    type: str = "step"


@dataclass(slots=True)
class RequestState:
    req: int
    state: str  # one of REQUEST_STATES
    prompt_len: int
    max_tokens: int
    computed: int  # tokens whose KV is in the cache
    output_len: int
    priority: int
    arrival: float
    ttft: float | None
    preemptions: int
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (added with prefix caching)
    source: str = SOURCE_ENGINE  # as in RequestEvent (added with the HTTP API)


@dataclass(slots=True)
class BlockOwner:
    block: int
    req: int  # the request whose table holds it (first owner for shared blocks)
    refcount: int


@dataclass(slots=True)
class SnapshotEvent:
    step: int
    t: float
    requests: list[RequestState] = field(default_factory=list)
    blocks: list[BlockOwner] = field(default_factory=list)
    block_tables: dict[int, list[int]] = field(default_factory=dict)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    kv: KvCounters = field(default_factory=KvCounters)
    type: str = "snapshot"


@dataclass(slots=True)
class ByeEvent:
    step: int
    t: float
    reason: str = "drained"
    type: str = "bye"


Event = Union[HelloEvent, RequestEvent, RejectEvent, StepEvent, SnapshotEvent, ByeEvent]

EVENT_TYPES: dict[str, type] = {
    "hello": HelloEvent,
    "request": RequestEvent,
    "reject": RejectEvent,
    "step": StepEvent,
    "snapshot": SnapshotEvent,
    "bye": ByeEvent,
}
