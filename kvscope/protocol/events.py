"""Event schema, version 1: the only contract between the engine and its watchers.

Every event is a msgspec Struct here, and these declarations are the schema: the
codec (``kvscope.protocol.codec``) decodes straight into them, so every type, range,
enum and length below is checked on the way in. On the wire a top-level event is a
msgpack map tagged by ``type``; nested records are positional arrays
(``array_like``) in the field order declared below (docs/PROTOCOL.md). Times are
seconds on the engine's clock (0 at engine start) unless a field says ``wall``.
"""

from enum import StrEnum
from typing import Annotated, Literal, Union, get_args

import msgspec
from msgspec import UNSET, Meta, Struct, UnsetType

from .engine_info import CpuInfo, CudaInfo, EngineInfo, SimInfo, VllmInfo, engine_info  # noqa: F401
from .types import (  # noqa: F401 - the schema's field types, re-exported
    FLOAT_MAX,
    INT64_MAX,
    INT64_MIN,
    MAX_LIST_LEN,
    MAX_NAME_LEN,
    MAX_TEXT_LEN,
    Count,
    CountList,
    Float,
    Int,
    IntList,
    Name,
    ProtocolEvent,
    Text,
    list_of,
)
from .vllm_watched import (  # noqa: F401 - a recorded vLLM's events, re-exported
    BlockHash,
    VllmBlockEvent,
    VllmCachedBlock,
    VllmKvCounters,
    VllmKvEvent,
    VllmMetricsEvent,
    VllmSnapshotEvent,
)

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
    """The scheduler's four modes (hello.config.mode): settings of one scheduler, see engine/sched/scheduler.py."""

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

# ----------------------------------------------------------------------------- field types
# (the numeric, string and list types with their limits are in .types)
Kind = Literal["prefill", "decode"]
Verdict = Literal["admitted", "blocked", "idle"]
State = Literal["waiting", "running", "preempted", "swapped", "finished"]
Direction = Literal["out", "in"]
Source = Annotated[str, Meta(max_length=16)]


_list = list_of


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


class OutputText(Struct, array_like=True, gc=False):
    """A finished request's completion as text (models with a real tokenizer only)."""

    req: Int
    text: Text


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
# hello.config: EngineInfo, the engine's own fields plus optional per-backend sections
# (kvscope.protocol.engine_info; a flat map on the wire).


# ---------------------------------------------------------------------------- events
class HelloEvent(ProtocolEvent, tag="hello"):
    version: Int
    config: EngineInfo
    wall_start: Float

    def __post_init__(self) -> None:
        if type(self.config) is not EngineInfo:  # built by hand from a dict
            self.config = engine_info(self.config)


class RequestEvent(ProtocolEvent, tag="request"):
    req: Int
    prompt_len: Count
    max_tokens: Count
    priority: Int
    arrival: Float
    source: Source = SOURCE_ENGINE  # SOURCE_HTTP for a request sent to the HTTP API (optional: older streams omit it)
    # the prompt as text, models with a real tokenizer only (left out of the encoding when unset)
    prompt_text: Text | UnsetType = UNSET


class RejectEvent(ProtocolEvent, tag="reject"):
    req: Int
    reason: Name
    t: Float


class StepEvent(ProtocolEvent, tag="step"):
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
    # completions of the requests finished this step, as text (real tokenizers only; unset otherwise)
    outputs: _list(OutputText) | UnsetType = UNSET
    # the text each unfinished request's completion grew by this step (real tokenizers only; unset otherwise)
    text: _list(OutputText) | UnsetType = UNSET


class SnapshotEvent(ProtocolEvent, tag="snapshot"):
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


class ByeEvent(ProtocolEvent, tag="bye"):
    step: Int
    t: Float
    reason: Name = "drained"


class HeartbeatEvent(ProtocolEvent, tag="heartbeat"):
    """Sent by a publisher that has had nothing to send for a while (an idle or paused engine), so a
    watcher knows the engine is up. Never recorded in a trace; a reader skips it."""
    t: Float  # the publisher's wall clock (time.time())


# A watched vLLM's recording events (vllm_metrics, vllm_kv, vllm_snapshot) live in
# kvscope.protocol.vllm_watched; they are part of the one union.
Event = Union[HelloEvent, RequestEvent, RejectEvent, StepEvent, SnapshotEvent, ByeEvent, HeartbeatEvent,
              VllmMetricsEvent, VllmKvEvent, VllmSnapshotEvent]


def _registry(union) -> dict[str, type]:
    """tag -> class for every event of the union; each class's ``type`` is its tag."""
    out: dict[str, type] = {}
    for cls in get_args(union):
        cls.type = cls.__struct_config__.tag
        if cls.type in out:
            raise TypeError(f"two events tagged {cls.type!r}")
        out[cls.type] = cls
    return out


EVENT_TYPES: dict[str, type] = _registry(Event)

# The roles a trace gives events: a chunk opens with a snapshot; ticks advance `step`.
SNAPSHOT_TYPES = (SnapshotEvent, VllmSnapshotEvent)
TICK_TYPES = (StepEvent, VllmMetricsEvent, VllmKvEvent)
BACKEND_VLLM = "vllm"  # hello.config.backend of a recorded vLLM
