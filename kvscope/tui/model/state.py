"""The TUI's state and the reducer that folds protocol events into it.

``reduce(state, event) -> state`` is the only way events change the picture; live
mode and replay feed it the same events, so a replay at step N shows what live
showed at step N. The reducer is deterministic: no clock, no I/O, no randomness.
For speed it updates ``state`` in place and returns it (a ``hello`` starts and
returns a fresh state); callers that need a frozen copy take ``picture(state)``.

Every history is bounded (deques with ``maxlen``, fixed-size histograms, a
bounded store of finished requests), so memory stays flat however long it runs.

Rules this module applies (kept here so the widgets need not know them):

* Blocks, per step, as docs/PROTOCOL.md says: ``freed`` blocks go back to the
  pool, then each ``alloc`` (block, req) adds the block to req's table (a block
  still held by a live request becomes shared and keeps its first owner), then
  ``refs`` set refcounts (the last one per block wins). Prefix-cache extension: a
  RefChange to 0 of a block not in ``freed`` leaves it *cached* (free, still
  holding a reusable prefix; a snapshot lists it with refcount 0); a cached block
  leaves the cache through ``freed``. A request's table is dropped when it
  finishes, is rejected or is preempted (recompute, or swap: its KV moves to CPU
  memory and it gets new blocks when swapped in). For older, non-net
  streams: a block given to a request that finishes in the same step and also
  listed in ``freed`` ends free.
* Prefill chunks: each PREFILL batch entry of a request is one chunk. A recompute
  preemption starts a new prefill pass over prompt + outputs (chunks done and
  computed tokens reset to 0). Total chunks of the current pass =
  ``done + ceil(remaining / chunk)`` with ``remaining = target - computed`` and
  ``chunk`` = config ``chunk_size`` / ``max_num_batched_tokens`` / the step's
  token budget in chunked mode; in other modes the rest of the prompt is one
  chunk. After a snapshot (which carries no chunk counts) ``done`` is estimated
  the same way from the tokens already computed.
* A hello identical to the last one (same config and wall_start) is the same
  engine run announcing itself around an on-demand snapshot: nothing changes. The
  first hello seen only teaches the config (a late joiner may get it just after
  the snapshot it asked for). A different hello after that is a new engine run:
  the state starts afresh.
* Staleness: a step number that is not the previous one + 1, or ``dropped > 0``,
  marks the state stale; the next snapshot clears it. A step number that goes
  backwards means the engine restarted: requests, blocks and queues are cleared.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass, field
from typing import Any

from msgspec import UNSET

from kvscope.goodput import RequestRecord
from kvscope.protocol.blockmap import BlockMap
from kvscope.protocol.events import (
    FINISHED,
    PREEMPTED,
    PREFILL,
    RUNNING,
    SWAPPED,
    VERDICT_IDLE,
    WAITING,
    Admission,
    ByeEvent,
    EngineInfo,
    HelloEvent,
    KvCounters,
    RejectEvent,
    RequestEvent,
    SnapshotEvent,
    StepEvent,
)

HISTORY_STEPS = 512  # per-step batch history kept
RATE_WINDOW = 32  # steps used for iterations/s and output tok/s
LOG_LEN = 48  # lifecycle entries kept per request
FINISHED_KEEP = 128  # finished requests kept for the detail screen
REJECTS_KEEP = 32
MAX_OUTPUT_TEXT = 4000  # characters of a live request's completion kept (the engine sends at most as many)
MAX_LIVE_REQUESTS = 100_000  # guard against a stream that never reports finishes
MAX_TRACKED_BLOCKS = 1 << 18  # per-block memory past this is refused: the map draws this many

# Connection states shown in the header.
CONN_LIVE, CONN_REPLAY, CONN_DISCONNECTED, CONN_CONNECTING = "live", "replay", "disconnected", "connecting"

# Lifecycle log kinds.
LOG_QUEUED, LOG_PREFILL, LOG_FIRST, LOG_DECODE = "queued", "prefill", "first_token", "decode"
LOG_PREEMPT, LOG_FINISH, LOG_REJECT, LOG_RESYNC = "preempted", "finished", "rejected", "resync"


@dataclass(slots=True)
class LogEntry:
    kind: str
    step: int
    t: float
    start: int = 0  # first token position (prefill chunks)
    tokens: int = 0  # tokens computed (prefill) or decode steps (decode)
    end_step: int = -1  # last step of a run of decodes
    end_t: float = 0.0
    note: str = ""


@dataclass(slots=True)
class ReqView:
    req: int
    prompt_len: int = 0
    max_tokens: int = 0
    priority: int = 0
    arrival: float = 0.0
    state: str = WAITING
    computed: int = 0
    output_len: int = 0
    ttft: float | None = None
    preemptions: int = 0
    cached_tokens: int = 0  # prompt tokens served from the prefix cache (first admission)
    source: str = ""  # "http" for a request sent to the HTTP API
    swaps: int = 0  # times swapped out to CPU
    chunks_done: int = 0  # prefill chunks in the current prefill pass
    total_chunks: int = 0  # prefill chunks over the request's life
    prefill_target: int = 0  # tokens this prefill pass must compute
    decoding: bool = False
    finish_reason: str | None = None
    e2e: float | None = None
    end_t: float | None = None
    known: bool = True  # False: seen in a queue before any request/snapshot record
    prompt_text: str = ""  # real-tokenizer models only (RequestEvent.prompt_text)
    output_text: str = ""  # the completion as it grows (StepEvent.text), whole once finished (outputs)
    judgement: Any = None  # against the SLO once finished (kvscope.goodput.Judgement)
    log: deque = field(default_factory=lambda: deque(maxlen=LOG_LEN))


@dataclass(slots=True)
class StepSample:
    step: int
    t: float
    dur: float
    prefill: int
    decode: int
    padding: int
    budget: int
    out_tokens: int


def _block_map() -> BlockMap:
    return BlockMap(limit=MAX_TRACKED_BLOCKS)


@dataclass(slots=True)
class TuiState:
    config: EngineInfo | None = None  # from hello; None until one is seen
    wall_start: float | None = None  # identifies the engine run (from hello)
    version: int = 0  # bumped by every change; the app repaints when it moves
    conn: str = CONN_CONNECTING
    step: int = -1
    t: float = 0.0
    last_step: int | None = None
    requests: dict[int, ReqView] = field(default_factory=dict)
    finished: OrderedDict = field(default_factory=OrderedDict)
    running: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    swapped: list[int] = field(default_factory=list)
    admission: Admission = field(default_factory=lambda: Admission(VERDICT_IDLE))
    blocks: BlockMap = field(default_factory=_block_map)  # owners, refcounts, cached flags, tables
    kv: KvCounters = field(default_factory=KvCounters)
    history: deque = field(default_factory=lambda: deque(maxlen=HISTORY_STEPS))
    ttft: Any = None  # LogHistogram
    itl: Any = None  # LogHistogram
    last_batch: StepSample | None = None
    steps_seen: int = 0
    tokens_out: int = 0
    finished_count: int = 0
    rejected_count: int = 0
    rejects: deque = field(default_factory=lambda: deque(maxlen=REJECTS_KEEP))
    preemption_count: int = 0
    preempted_now: list = field(default_factory=list)  # (req, reason, mode) of this step's preemptions
    swap_out_count: int = 0  # swaps out to the CPU pool seen
    swap_in_count: int = 0
    hit_count: int = 0  # admissions that found a cached prefix
    dropped: int = 0  # events the publisher reported dropped
    local_dropped: int = 0  # events this TUI dropped (backlog overflow)
    malformed: int = 0  # frames refused by the decoder
    notice: str = ""  # something about the stream the screen must say (a refused value, a cap)
    pool_size: int = 0  # the largest pool size the stream claimed
    gaps: int = 0  # jumps in step numbers
    stale: bool = False
    stale_reason: str = ""
    synced: bool = False  # True once a hello at start or a snapshot was applied
    snapshots: int = 0
    restarts: int = 0
    ended: str | None = None  # bye reason
    # goodput (docs/GOODPUT.md): finish records judged against slo_override (--slo) or the hello's SLO
    slo_override: Any = None  # kvscope.goodput.Slo, kept across engine restarts
    goodput: Any = None  # GoodputTally

    def __post_init__(self) -> None:
        from kvscope.goodput import GoodputTally, resolve_slo
        from kvscope.tui.model.histogram import LogHistogram

        if self.ttft is None:
            self.ttft = LogHistogram(1e-3, 1e3, 6)
        if self.itl is None:
            self.itl = LogHistogram(1e-4, 1e2, 6)
        if self.goodput is None:
            self.goodput = GoodputTally(resolve_slo(self.slo_override, self.config))
        if not self.blocks.owner and self.config is not None and self.config.num_blocks:
            _claim_pool(self, self.config.num_blocks, reset=True)

    # -- read helpers used by widgets and screens ---------------------------------
    @property
    def tables(self) -> dict[int, list[int]]:
        """Each live request's block table, in logical order."""
        return self.blocks.tables

    @property
    def mode(self) -> str:
        return (self.config.mode if self.config is not None else "") or "?"

    @property
    def block_size(self) -> int:
        return self.config.block_size if self.config is not None else 16

    def get(self, req: int) -> ReqView | None:
        r = self.requests.get(req)
        return r if r is not None else self.finished.get(req)

    def chunk_size(self) -> int:
        if self.config is not None and self.config.max_num_batched_tokens:
            return self.config.max_num_batched_tokens
        return self.last_batch.budget if self.last_batch and self.last_batch.budget > 0 else 512

    def chunks(self, r: ReqView) -> tuple[int, int]:
        """(done, total) prefill chunks of the current prefill pass (see module doc)."""
        done = r.chunks_done
        if r.decoding or r.state == FINISHED:
            return done, max(done, 1 if r.prefill_target > 0 else 0)
        remaining = max(0, r.prefill_target - r.computed)
        if remaining == 0:
            return done, max(done, 1)
        if self.mode == "chunked":
            return done, done + math.ceil(remaining / max(1, self.chunk_size()))
        return done, done + 1

    def rates(self) -> tuple[float, float]:
        """(iterations/s, output tokens/s) over the last RATE_WINDOW steps, engine time."""
        h = self.history
        n = min(len(h), RATE_WINDOW)
        if n == 0:
            return 0.0, 0.0
        first = h[-n]
        last = h[-1]
        span = (last.t + last.dur) - first.t
        if span <= 0:
            span = sum(h[-i].dur for i in range(1, n + 1))
        if span <= 0:
            return 0.0, 0.0
        toks = 0
        for i in range(1, n + 1):
            toks += h[-i].out_tokens
        return n / span, toks / span


# ---------------------------------------------------------------------------------
def new_state(config: EngineInfo | None = None, conn: str = CONN_CONNECTING, slo_override: Any = None) -> TuiState:
    return TuiState(config=config, conn=conn, slo_override=slo_override)


def set_slo_override(state: TuiState, slo: Any) -> TuiState:
    """Judge goodput by ``slo`` (--slo) instead of the SLO the run recorded; before any event is folded."""
    from kvscope.goodput import GoodputTally, resolve_slo

    state.slo_override = slo
    state.goodput = GoodputTally(resolve_slo(slo, state.config))
    state.version += 1
    return state


def set_connection(state: TuiState, conn: str) -> TuiState:
    if state.conn != conn:
        state.conn = conn
        state.version += 1
    return state


def note_local_drop(state: TuiState, n: int) -> TuiState:
    """The TUI itself had to drop ``n`` events (its backlog overflowed)."""
    if n > 0:
        state.local_dropped += n
        _mark_stale(state, "events dropped")
        state.version += 1
    return state


def reset_stats(state: TuiState) -> TuiState:
    state.ttft.clear()
    state.itl.clear()
    state.history.clear()
    state.version += 1
    return state


def reduce(state: TuiState, event: Any) -> TuiState:
    """Fold one protocol event into the state; returns the (usually same) state."""
    kind = getattr(event, "type", None)
    if kind == "step":
        _step(state, event)
    elif kind == "request":
        _request(state, event)
    elif kind == "snapshot":
        _snapshot(state, event)
    elif kind == "hello":
        return _hello(state, event)
    elif kind == "reject":
        _reject(state, event)
    elif kind == "bye":
        _bye(state, event)
    elif kind == "latency":  # not on the wire: a replay seek's TTFT/ITL so far (tui/model/latency_seed.py)
        state.ttft.clear()
        state.ttft.merge(event.ttft)
        state.itl.clear()
        state.itl.merge(event.itl)
        goodput = getattr(event, "goodput", None)
        if goodput is not None and goodput.slo == state.goodput.slo:
            state.goodput = goodput.copy()
    else:
        return state
    state.version += 1
    return state


def reduce_all(state: TuiState, events) -> TuiState:
    for e in events:
        state = reduce(state, e)
    return state


# -- event handlers -----------------------------------------------------------------
def _hello(state: TuiState, ev: HelloEvent) -> TuiState:
    if state.wall_start == ev.wall_start and state.config == ev.config:
        # The same engine run announcing itself again (around an on-demand
        # snapshot): nothing to reset.
        return state
    if state.config is None:
        # The first hello we see. Either the run is just starting, or we joined it
        # late and this hello came with an on-demand snapshot (before or after it):
        # keep what we have, learn the config.
        state.config = ev.config
        state.wall_start = ev.wall_start
        if state.goodput.requests == 0:  # the SLO the run recorded, unless --slo overrides it
            from kvscope.goodput import resolve_slo

            state.goodput.slo = resolve_slo(state.slo_override, ev.config)
        _claim_pool(state, ev.config.num_blocks or 0)
        if state.steps_seen == 0 and state.snapshots == 0:
            state.synced = True
        state.version += 1
        return state
    fresh = new_state(ev.config, conn=state.conn, slo_override=state.slo_override)
    fresh.wall_start = ev.wall_start
    fresh.synced = True
    fresh.dropped = state.dropped
    fresh.local_dropped = state.local_dropped
    fresh.malformed = state.malformed
    fresh.restarts = state.restarts + (1 if state.steps_seen else 0)
    fresh.version = state.version + 1
    return fresh


def note_malformed(state: TuiState, n: int, error: str | None) -> TuiState:
    """``n`` more frames were refused by the decoder; ``error`` is the last one's message."""
    if n > 0:
        state.malformed += n
        if error:
            state.notice = f"refused {state.malformed} bad frame(s); last: {error}"
        state.version += 1
    return state


def _claim_pool(state: TuiState, n: int, reset: bool = False) -> None:
    """Size the block map for a pool of ``n`` blocks, within MAX_TRACKED_BLOCKS."""
    if n > state.pool_size:
        state.pool_size = n
        if n > MAX_TRACKED_BLOCKS:
            state.notice = (f"KV pool of {n:,} blocks is larger than this screen tracks: "
                            f"the map shows the first {MAX_TRACKED_BLOCKS:,}, the counters all")
    if reset:
        state.blocks.reset(n)
    else:
        state.blocks.ensure(n)


def _mark_stale(state: TuiState, reason: str) -> None:
    state.stale = True
    if not state.stale_reason:
        state.stale_reason = reason


def _placeholder(state: TuiState, req: int) -> ReqView:
    r = state.requests.get(req)
    if r is None:
        r = ReqView(req=req, known=False)
        if len(state.requests) < MAX_LIVE_REQUESTS:
            state.requests[req] = r
        if not state.synced:
            _mark_stale(state, "joined mid-stream")
    return r


def _request(state: TuiState, ev: RequestEvent) -> None:
    r = state.requests.get(ev.req)
    if r is None:
        r = ReqView(req=ev.req)
        if len(state.requests) < MAX_LIVE_REQUESTS:
            state.requests[ev.req] = r
    r.prompt_len = ev.prompt_len
    r.max_tokens = ev.max_tokens
    r.priority = ev.priority
    r.arrival = ev.arrival
    r.source = ev.source
    if ev.prompt_text is not UNSET:
        r.prompt_text = ev.prompt_text
    r.prefill_target = max(r.prefill_target, ev.prompt_len)
    r.known = True
    r.log.append(LogEntry(LOG_QUEUED, state.step + 1 if state.step >= 0 else 0, ev.arrival))


def _retire(state: TuiState, r: ReqView) -> None:
    state.requests.pop(r.req, None)
    state.tables.pop(r.req, None)
    state.finished[r.req] = r
    state.finished.move_to_end(r.req)
    while len(state.finished) > FINISHED_KEEP:
        state.finished.popitem(last=False)


def _reject(state: TuiState, ev: RejectEvent) -> None:
    state.rejected_count += 1
    state.rejects.append((ev.req, ev.reason, ev.t))
    r = state.requests.get(ev.req)
    if r is not None:
        r.state = FINISHED
        r.finish_reason = f"rejected: {ev.reason}"
        r.end_t = ev.t
        r.log.append(LogEntry(LOG_REJECT, max(state.step, 0), ev.t, note=ev.reason))
        _retire(state, r)
    for q in (state.waiting, state.running, state.preempted, state.swapped):
        if ev.req in q:
            q.remove(ev.req)


def _bye(state: TuiState, ev: ByeEvent) -> None:
    state.ended = ev.reason or "bye"
    state.t = max(state.t, ev.t)


def _clear_live(state: TuiState) -> None:
    state.requests.clear()
    state.running = []
    state.waiting = []
    state.preempted = []
    state.swapped = []
    state.blocks.reset(len(state.blocks))
    state.admission = Admission(VERDICT_IDLE)


def _step(state: TuiState, ev: StepEvent) -> None:
    last = state.last_step
    if last is not None:
        if ev.step <= last:
            # Step numbers went backwards: the engine restarted without a hello we saw.
            state.restarts += 1
            _clear_live(state)
            state.synced = False
            _mark_stale(state, "engine restarted")
        elif ev.step != last + 1:
            state.gaps += 1
            _mark_stale(state, f"missed steps {last + 1}..{ev.step - 1}")
    elif not state.synced:
        _mark_stale(state, "joined mid-stream")
    if ev.dropped:
        state.dropped += ev.dropped
        _mark_stale(state, f"{ev.dropped} events dropped")
    state.last_step = ev.step
    state.step = ev.step
    state.t = ev.t
    state.steps_seen += 1
    step = ev.step
    t_end = ev.t + ev.dur

    state.admission = ev.admission
    state.kv = ev.kv
    if ev.kv.total > len(state.blocks):
        _claim_pool(state, ev.kv.total)

    # Preemptions happen at schedule time, before this step's allocations.
    state.preempted_now = [(pe.req, pe.reason, pe.mode) for pe in ev.preemptions]
    for pe in ev.preemptions:
        state.preemption_count += 1
        r = _placeholder(state, pe.req)
        r.preemptions += 1
        r.log.append(LogEntry(LOG_PREEMPT, step, ev.t, note=f"{pe.reason}, {pe.mode}"))
        if pe.mode == "swap":
            r.state = SWAPPED  # its KV went to CPU memory: its GPU blocks are released
            state.tables.pop(pe.req, None)
        else:
            r.state = PREEMPTED
            r.computed = 0
            r.chunks_done = 0
            r.decoding = False
            r.prefill_target = r.prompt_len + r.output_len
            state.tables.pop(pe.req, None)

    for h in ev.hits:
        state.hit_count += 1
        r = _placeholder(state, h.req)
        if r.cached_tokens == 0:
            r.cached_tokens = h.tokens
    for sw in ev.swaps:
        if sw.direction == "out":
            state.swap_out_count += 1
            _placeholder(state, sw.req).swaps += 1
        else:
            state.swap_in_count += 1

    _apply_blocks(state, ev)

    prefill = decode = 0
    for be in ev.batch:
        r = _placeholder(state, be.req)
        r.state = RUNNING
        r.computed = be.start + be.tokens
        if be.kind == PREFILL:
            prefill += be.tokens
            r.chunks_done += 1
            r.total_chunks += 1
            r.log.append(LogEntry(LOG_PREFILL, step, ev.t, start=be.start, tokens=be.tokens, end_step=step, end_t=t_end))
        else:
            decode += be.tokens
            r.decoding = True
            lg = r.log[-1] if r.log else None
            if lg is not None and lg.kind == LOG_DECODE and lg.end_step == step - 1:
                lg.tokens += be.tokens
                lg.end_step = step
                lg.end_t = t_end
            else:
                r.log.append(LogEntry(LOG_DECODE, step, ev.t, start=be.start, tokens=be.tokens, end_step=step, end_t=t_end))

    for req in ev.sampled:
        r = state.requests.get(req)
        if r is not None:
            r.output_len += 1
    state.tokens_out += len(ev.sampled)

    for ft in ev.first_tokens:
        state.ttft.add(ft.ttft)
        r = state.requests.get(ft.req)
        if r is not None:
            r.ttft = ft.ttft
            r.log.append(LogEntry(LOG_FIRST, step, t_end, note=f"{ft.ttft:.6f}"))
    for s in ev.itl:
        state.itl.add(s.gap)

    # Queue membership is authoritative each step.
    state.running = list(ev.running)
    state.waiting = list(ev.waiting)
    state.preempted = list(ev.preempted)
    state.swapped = list(ev.swapped)
    for ids, st in ((ev.running, RUNNING), (ev.waiting, WAITING), (ev.preempted, PREEMPTED), (ev.swapped, SWAPPED)):
        for req in ids:
            r = state.requests.get(req)
            if r is None:
                r = _placeholder(state, req)
            r.state = st

    if ev.text is not UNSET:  # the completions as they grow (request detail streams them)
        for o in ev.text:
            r = state.requests.get(o.req)
            if r is not None and len(r.output_text) < MAX_OUTPUT_TEXT:
                r.output_text = (r.output_text + o.text)[:MAX_OUTPUT_TEXT]
    texts = {o.req: o.text for o in ev.outputs} if ev.outputs is not UNSET else {}
    for f in ev.finished:
        state.finished_count += 1
        judgement = state.goodput.add(RequestRecord.of_finish(f), t_end)
        r = state.requests.get(f.req)
        if r is None:
            continue
        r.state = FINISHED
        r.ttft = f.ttft if r.ttft is None else r.ttft
        r.e2e = f.e2e
        r.output_len = f.output_len
        r.finish_reason = f.reason
        r.judgement = judgement
        r.output_text = texts.get(f.req, r.output_text)
        r.end_t = t_end
        r.log.append(LogEntry(LOG_FINISH, step, t_end, note=f.reason))
        _retire(state, r)

    sample = StepSample(step, ev.t, ev.dur, prefill, decode, ev.padding, ev.budget, len(ev.sampled))
    state.history.append(sample)
    state.last_batch = sample


def _apply_blocks(state: TuiState, ev: StepEvent) -> None:
    state.blocks.apply_step(ev, max_table=MAX_TRACKED_BLOCKS, max_tables=MAX_LIVE_REQUESTS)


def _snapshot(state: TuiState, ev: SnapshotEvent) -> None:
    prev_requests = state.requests
    prev_finished = state.finished
    state.requests = {}
    state.step = ev.step
    state.last_step = ev.step
    state.t = ev.t
    state.kv = ev.kv
    state.running = list(ev.running)
    state.waiting = list(ev.waiting)
    state.preempted = list(ev.preempted)
    state.swapped = list(ev.swapped)
    if ev.kv.total > state.pool_size:
        _claim_pool(state, ev.kv.total)
    n = max((state.config.num_blocks or 0) if state.config is not None else 0, len(state.blocks))
    state.blocks.load_snapshot(ev, n)
    chunk = state.chunk_size()
    chunked = state.mode == "chunked"
    for rs in ev.requests:
        old = prev_requests.get(rs.req) or prev_finished.get(rs.req)
        r = ReqView(req=rs.req)
        if old is not None:
            r.log = old.log
            r.total_chunks = old.total_chunks
            r.prompt_text, r.output_text = old.prompt_text, old.output_text
        r.prompt_len = rs.prompt_len
        r.max_tokens = rs.max_tokens
        r.priority = rs.priority
        r.arrival = rs.arrival
        r.source = rs.source
        r.state = rs.state
        r.computed = rs.computed
        r.output_len = rs.output_len
        r.ttft = rs.ttft
        r.preemptions = rs.preemptions
        r.cached_tokens = rs.cached_tokens
        # Decoding once everything but the last sampled token is in the cache.
        r.decoding = rs.output_len > 0 and rs.computed >= rs.prompt_len + rs.output_len - 1
        r.prefill_target = rs.prompt_len + (0 if r.decoding else rs.output_len)
        prefilled = min(rs.computed, r.prefill_target)
        if old is not None and old.computed == rs.computed and old.preemptions == rs.preemptions:
            r.chunks_done = old.chunks_done
            r.decoding = old.decoding or r.decoding
        elif prefilled <= 0:
            r.chunks_done = 0
        else:
            r.chunks_done = math.ceil(prefilled / max(1, chunk)) if chunked else 1
        if rs.state == FINISHED:
            state.finished[rs.req] = r
        else:
            state.requests[rs.req] = r
        if old is None or state.stale:
            r.log.append(LogEntry(LOG_RESYNC, ev.step, ev.t, note="snapshot"))
    state.preempted_now = []
    state.stale = False
    state.stale_reason = ""
    state.synced = True
    state.snapshots += 1


# -- comparison -------------------------------------------------------------------
def picture(state: TuiState) -> dict[str, Any]:
    """What the dashboard shows of queues, requests and blocks, as plain data.

    Used to check that replay at step N equals live at step N (histories and
    lifecycle logs are excluded: after a seek they only start at the snapshot).
    """
    reqs = {}
    for rid, r in state.requests.items():
        reqs[rid] = (r.state, r.prompt_len, r.max_tokens, r.priority, r.arrival, r.computed,
                     r.output_len, r.ttft, r.preemptions)
    return {
        "step": state.step,
        "running": list(state.running),
        "waiting": list(state.waiting),
        "preempted": list(state.preempted),
        "swapped": list(state.swapped),
        "requests": reqs,
        "owner": [o if rc > 0 else -1 for o, rc in zip(state.blocks.owner, state.blocks.refcount)],
        "refcount": list(state.blocks.refcount),
        "cached": [bool(c) for c in state.blocks.cached],
        "tables": {k: list(v) for k, v in state.tables.items() if v},
        "kv": state.kv,
    }
