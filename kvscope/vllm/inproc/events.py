"""kvscope's protocol events, built from the state of vLLM's own V1 scheduler.

The builder kvscope's engine uses when vLLM's scheduler decides (``--scheduler vllm``,
``kvscope.vllm.inproc.scheduler``). Inside a real ``vllm serve`` the watched scheduler
(kvscope.vllm.inproc.watched) publishes the same events with the same meanings, split between
vLLM's thread and its own (vllm_capture, vllm_assemble), so that a server's step pays little.

It needs vLLM's scheduler object and nothing of kvscope's engine. It reads, never writes:
``scheduler.running``, ``scheduler.waiting`` / ``kv_holding_waiting``, ``scheduler.requests``,
the KV-cache manager's block tables (``coordinator.single_type_managers[0].req_to_blocks``, physical
block ids; vLLM's block 0 is its null block and is never handed out) and its ``BlockPool``
(refcounts, which free blocks still hold a cached prefix).

API (all methods are cheap enough to call once per scheduler step)::

    b = VllmEventBuilder(scheduler, req_id=None)   # req_id: vLLM's str id -> protocol int id
                                                   # (default: sequential ints in order of first sight;
                                                   #  kvscope's engine passes ``int``)
    b.hello_config()          -> dict               # vLLM's settings under kvscope's hello.config keys
    b.new_requests(t)         -> list[RequestEvent] # requests not seen before (arrivals)
    out = scheduler.schedule()
    b.after_schedule(out)     # keeps requests that finish in this step's update (call before the update)
    # ... the model runs; scheduler.update_from_output(out, runner_out) ...
    b.step(out, t_start, t_end) -> StepEvent        # the whole step, deltas against the previous call
    b.snapshot(step, t)       -> SnapshotEvent      # the whole state (for a late subscriber or a seek)

``step()`` diffs vLLM's state against what the previous ``step()`` (or ``snapshot()``) saw, so call it
once per step, after ``update_from_output`` (finished requests are then released). Pieces usable alone:
``queues()``, ``block_tables()``, ``batch(out)``, ``admission(out)`` (before ``step()``), ``kv_counters()``.

What each field means, from vLLM's objects:

- ``batch``: one entry per request in ``out.num_scheduled_tokens``; a prefill chunk while the request's
  computed tokens (before the step) are below its prompt plus output-so-far minus one, else a decode.
- ``running`` / ``waiting`` / ``preempted``: vLLM's ``running`` list, and its waiting queues in the order
  it would admit (requests holding KV first), split by status (``PREEMPTED`` -> preempted).
- ``preemptions``: ``out.preempted_req_ids`` (vLLM preempts by recompute when a block allocation fails,
  reason ``kv_blocks``).
- ``admission``: the head of WAITING after ``schedule()``: ``admitted`` if some request was admitted this
  step, else why the head waits: ``max_num_seqs`` (running is full), ``token_budget`` (the step's token
  budget is spent), otherwise ``kv_blocks`` (its blocks could not be allocated).
- ``hits``: requests scheduled for the first time (``scheduled_new_reqs``) or resumed, whose computed
  tokens before the step (found in the prefix cache) are > 0.
- ``alloc`` / ``freed`` / ``refs``: the net block deltas of the protocol's block-map rule
  (``kvscope.protocol.blockmap``), from the tables and refcounts before and after.
- ``first_tokens`` / ``itl`` / ``sampled`` / ``finished``: from each request's output-token count, timed
  at ``t_end`` on the caller's clock (vLLM requests' ``arrival_time`` should be on that clock too).
"""

from __future__ import annotations

from collections.abc import Callable
from operator import attrgetter
from typing import Any

from kvscope.protocol.blockmap import BlockJournal, BlockMap
from kvscope.protocol.events import (
    BLOCKED_BUDGET,
    BLOCKED_KV,
    BLOCKED_SEQS,
    DECODE,
    FINISH_ABORT,
    FINISH_ERROR,
    FINISH_LENGTH,
    FINISH_STOP,
    PREFILL,
    VERDICT_ADMITTED,
    VERDICT_BLOCKED,
    VERDICT_IDLE,
    Admission,
    BatchEntry,
    BlockAlloc,
    BlockOwner,
    Finish,
    FirstToken,
    ItlSample,
    KvCounters,
    Preemption,
    PrefixHit,
    RefChange,
    RequestEvent,
    RequestState,
    SnapshotEvent,
    StepEvent,
)

__all__ = ["VllmEventBuilder", "RequestIds", "finish_reason", "usable_blocks", "table_slots"]

_request_id = attrgetter("request_id")


def usable_blocks(pool: Any) -> int:
    """Blocks of vLLM's pool that can hold KV: ``num_gpu_blocks`` less its null block (block 0), as
    ``BlockPool.get_usage()`` counts them."""
    return max(0, pool.num_gpu_blocks - 1)


def table_slots(blocks: int, computed: int | None, block_size: int) -> tuple[int, int, int]:
    """(token slots, tail waste, reserve waste) of one request's table of ``blocks`` blocks with ``computed``
    tokens (None: unknown, counted full): the slots of the blocks its computed tokens need, less those
    tokens, are its tail; its blocks past those are reserved ahead."""
    cap = blocks * block_size
    c = cap if computed is None else max(0, min(computed, cap))
    need = -(-c // block_size)
    return c, need * block_size - c, (blocks - need) * block_size


class RequestIds(dict):
    """vLLM's string request ids -> the protocol's int ids, stable for the builder's life.

    A dict (``ids[vid]`` is a plain lookup once seen, so hot loops pay no Python call); a new id is
    assigned on first sight by ``__missing__``."""

    def __init__(self, convert: Callable[[str], int] | None = None) -> None:
        super().__init__()
        self._convert = convert
        self._names: dict[int, str] = {}
        self._next = 0

    def __missing__(self, rid: str) -> int:
        if self._convert is not None:
            got = self._convert(rid)
        else:
            got, self._next = self._next, self._next + 1
        self[rid] = got
        self._names[got] = rid
        return got

    def __call__(self, rid: str) -> int:
        return self[rid]

    def name(self, rid: int) -> str:
        """The vLLM id of a protocol id seen before (its decimal string otherwise)."""
        return self._names.get(rid, str(rid))

    def forget(self, rid: str) -> None:
        """Drop a finished request's mapping (memory stays bounded; sequential ids are never reused)."""
        got = self.pop(rid, None)
        if got is not None:
            self._names.pop(got, None)


def finish_reason(status: Any) -> str:
    """vLLM's RequestStatus of a finished request -> the protocol's finish reason."""
    name = getattr(status, "name", str(status))
    if name == "FINISHED_LENGTH_CAPPED":
        return FINISH_LENGTH
    if name in ("FINISHED_ABORTED", "FINISHED_IGNORED"):
        return FINISH_ABORT
    if name == "FINISHED_ERROR":
        return FINISH_ERROR
    return FINISH_STOP


class _Seen:
    """What the builder remembers of one request between steps."""

    __slots__ = ("req", "rid", "outputs", "last_t", "ttft", "preemptions")

    def __init__(self, req: Any, rid: int) -> None:
        self.req = req
        self.rid = rid
        self.outputs = 0
        self.last_t: float | None = None
        self.ttft: float | None = None
        self.preemptions = 0


class VllmEventBuilder:
    def __init__(self, scheduler: Any, req_id: Callable[[str], int] | None = None) -> None:
        self.sched = scheduler
        self.ids = RequestIds(req_id)
        self.kv = scheduler.kv_cache_manager
        self.pool = self.kv.block_pool
        self.block_size = scheduler.block_size
        self._seen: dict[str, _Seen] = {}
        self._announced: set[str] = set()
        # the block state a watcher has: table per request (protocol id), refcount and cached per block
        self._tables: dict[int, list[int]] = {}
        self._refs: dict[int, int] = {}
        self._cached: set[int] = set()
        self.hit_tokens = 0
        self.query_tokens = 0
        self.step_count = 0
        self._last_running: tuple[list[str], list[int]] = ([], [])
        # the owner (claimer) of each block as a watcher rebuilds it from the deltas: what snapshots report
        self._claims = BlockMap(self.pool.num_gpu_blocks, tables=False)
        # _block_state's last answer, and the blocks vLLM handed out since (from each SchedulerOutput)
        self._state: tuple[dict[int, int], set[int]] | None = None
        self._handed_out: set[int] = set()

    # ---- reading vLLM's state --------------------------------------------------------
    def _manager(self) -> Any:
        return self.kv.coordinator.single_type_managers[0]

    def _waiting_requests(self) -> list[Any]:
        s = self.sched
        holding = getattr(s, "kv_holding_waiting", None)
        return [*(holding or ()), *s.waiting]

    def queues(self) -> tuple[list[int], list[int], list[int]]:
        """(running, waiting, preempted) as protocol ids, in vLLM's order."""
        ids = self.ids
        waiting, preempted = [], []
        for r in self._waiting_requests():
            (preempted if r.status.name == "PREEMPTED" else waiting).append(ids[r.request_id])
        return self._running_ids(), waiting, preempted

    def _running_ids(self) -> list[int]:
        """RUNNING as protocol ids; the previous list again when vLLM's running list holds the same requests
        (most steps: one C-level pass and a compare instead of a lookup per request)."""
        now = list(map(_request_id, self.sched.running))
        last_v, last_ids = self._last_running
        if now != last_v:
            last_ids = list(map(self.ids.__getitem__, now))
            self._last_running = (now, last_ids)
        return list(last_ids)

    def block_tables(self) -> dict[int, list[int]]:
        """Protocol id -> physical block ids, for every request holding blocks (null blocks left out)."""
        tables: dict[int, list[int]] = {}
        for rid, blocks in self._manager().req_to_blocks.items():
            ids = [b.block_id for b in blocks if not b.is_null]
            if ids:
                tables[self.ids(rid)] = ids
        return tables

    def _block_state(self) -> tuple[dict[int, int], set[int]]:
        """(refcount of every referenced block, free blocks that still hold a cached prefix).

        Kept from the blocks that can have changed since the last call, not from a pass over the pool
        (a GPU-sized pool holds tens of thousands of blocks): a block's refcount changes only while a
        request's table holds it, and a free block gains or loses its cached prefix only by being handed
        out (evicted) or given back. So the candidates are the blocks held now, those held at the last
        call and those handed out since (``after_schedule`` notes them); the first call reads the whole
        pool.
        """
        refs: dict[int, int] = {}
        for blocks in self._manager().req_to_blocks.values():
            for blk in blocks:
                if not blk.is_null:
                    refs[blk.block_id] = blk.ref_cnt
        state = self._state
        if state is None:
            cached = {blk.block_id for blk in self.pool.blocks
                      if not blk.is_null and blk.ref_cnt == 0 and blk.block_hash is not None}
        else:
            refs_before, cached = state[0], set(state[1])
            cached.difference_update(refs)
            pool = self.pool.blocks
            for b in self._handed_out.union(refs_before).difference(refs):
                blk = pool[b]
                if blk.is_null:
                    continue
                if blk.ref_cnt == 0 and blk.block_hash is not None:
                    cached.add(b)
                else:
                    cached.discard(b)
        self._handed_out = set()
        self._state = (refs, cached)
        return dict(refs), set(cached)

    def kv_counters(self, tables: dict[int, list[int]] | None = None,
                    state: tuple[dict[int, int], set[int]] | None = None) -> KvCounters:
        """The pool's counters by docs/PROTOCOL.md's rule: the null block is no block of the pool, so
        ``total`` is ``num_gpu_blocks - 1`` and ``used / total`` is vLLM's own ``BlockPool.get_usage()``."""
        tables = self.block_tables() if tables is None else tables
        refs, cached = self._block_state() if state is None else state
        requests, name = self.sched.requests, self.ids.name
        slots = tail = reserve = 0
        for rid, table in tables.items():
            req = requests.get(name(rid))
            s, t, r = table_slots(len(table), req.num_computed_tokens if req is not None else None, self.block_size)
            slots += s
            tail += t
            reserve += r
        total = usable_blocks(self.pool)
        free = self.pool.get_num_free_blocks()
        return KvCounters(
            total=total,
            used=total - free,
            free=free,
            cached=len(cached),
            shared=sum(1 for c in refs.values() if c > 1),
            token_slots=slots,
            tail_waste=tail,
            reserve_waste=reserve,
            hit_tokens=self.hit_tokens,
            query_tokens=self.query_tokens,
        )

    # ---- per-step pieces -------------------------------------------------------------
    def after_schedule(self, out: Any) -> None:
        """Note the requests ``schedule()`` returned; call right after it (before the model runs).

        A request that finishes in the same step's update (e.g. ``max_tokens=1``) has left
        ``scheduler.requests`` by the time ``step()`` runs; this keeps its record.
        """
        requests = self.sched.requests
        for vid in out.num_scheduled_tokens:
            if vid not in self._seen and vid in requests:
                self._seen[vid] = _Seen(requests[vid], self.ids(vid))
        handed = self._handed_out  # a block handed out and given back within one step is found through these
        for new in out.scheduled_new_reqs:
            for group in new.block_ids or ():
                handed.update(group)
        for ids in out.scheduled_cached_reqs.new_block_ids:
            for group in ids or ():
                handed.update(group)

    def batch(self, out: Any) -> list[BatchEntry]:
        """The step's batch from ``num_scheduled_tokens`` (valid after ``schedule()`` and after the update:
        vLLM advances ``num_computed_tokens`` inside ``schedule()``)."""
        entries = []
        requests = self.sched.requests
        for vid, n in out.num_scheduled_tokens.items():
            seen = self._seen.get(vid)
            req = seen.req if seen is not None else requests.get(vid)
            if req is None:
                continue
            start = max(0, req.num_computed_tokens - n)
            # a decode computes one token past the prompt; anything else (a prompt chunk, or the
            # recompute of a resumed request) is a prefill
            kind = DECODE if n == 1 and start >= req.num_prompt_tokens else PREFILL
            entries.append(BatchEntry(self.ids(vid), kind, n, start))
        return entries

    def admissions(self, out: Any) -> list[tuple[int, int]]:
        """(request, tokens found in the prefix cache) for each request admitted this step, counted into
        the KV counters' hit/query tokens; call once per step. The found tokens are the computed tokens
        before the step of a request scheduled for the first time (NewRequestData) or resumed."""
        found = {new.req_id: new.num_computed_tokens for new in out.scheduled_new_reqs}
        cached_reqs = out.scheduled_cached_reqs
        resumed = cached_reqs.resumed_req_ids
        if resumed:  # (usually none: no pass over every running request)
            found.update((vid, n) for vid, n in zip(cached_reqs.req_ids, cached_reqs.num_computed_tokens)
                         if vid in resumed)
        admitted = []
        for vid, cached in found.items():
            seen = self._seen.get(vid)
            if seen is None:
                continue
            prompt = seen.req.num_prompt_tokens
            self.query_tokens += prompt
            self.hit_tokens += min(cached, prompt)
            admitted.append((seen.rid, cached))
        return admitted

    def admission(self, out: Any) -> Admission:
        """Why the head of WAITING was not admitted this step (vLLM's state after ``schedule()``)."""
        waiting = self._waiting_requests()
        admitted = bool(out.scheduled_new_reqs) or bool(out.scheduled_cached_reqs.resumed_req_ids)
        if not waiting:
            return Admission(VERDICT_ADMITTED) if admitted else Admission(VERDICT_IDLE)
        head = self.ids(waiting[0].request_id)
        s = self.sched
        if len(s.running) >= s.max_num_running_reqs:
            reason = BLOCKED_SEQS
        elif out.total_num_scheduled_tokens >= s.max_num_scheduled_tokens:
            reason = BLOCKED_BUDGET
        else:
            reason = BLOCKED_KV
        return Admission(VERDICT_BLOCKED, reason, head)

    # ---- whole events ----------------------------------------------------------------
    def hello_config(self) -> dict[str, Any]:
        """vLLM's scheduler settings under the keys kvscope's hello.config uses."""
        import vllm

        s = self.sched
        sc = s.scheduler_config
        return dict(
            scheduler="vllm",
            vllm_version=vllm.__version__,
            mode="chunked" if sc.enable_chunked_prefill else "continuous",
            policy=str(getattr(s.policy, "value", s.policy)),
            block_size=self.block_size,
            num_blocks=self.pool.num_gpu_blocks,  # block ids are vLLM's physical ids, 1..num_gpu_blocks - 1
            null_block=self.pool.null_block.block_id,
            max_num_seqs=s.max_num_running_reqs,
            max_num_batched_tokens=s.max_num_scheduled_tokens,
            prefix_caching=bool(s.cache_config.enable_prefix_caching),
            long_prefill_token_threshold=sc.long_prefill_token_threshold,
        )

    def request_event(self, req: Any) -> RequestEvent:
        sp = req.sampling_params
        return RequestEvent(self.ids(req.request_id), req.num_prompt_tokens,
                            sp.max_tokens if sp is not None and sp.max_tokens is not None else 0,
                            req.priority, req.arrival_time)

    def new_requests(self) -> list[RequestEvent]:
        """A RequestEvent for each request of the scheduler not announced before (arrivals)."""
        events = []
        for vid, req in self.sched.requests.items():
            if vid not in self._announced:
                self._announced.add(vid)
                events.append(self.request_event(req))
        return events

    def step(self, out: Any, t_start: float, t_end: float, dropped: int = 0) -> StepEvent:
        """The StepEvent of the step whose ``schedule()`` returned ``out`` (call after the update)."""
        s = self.sched
        self.step_count += 1
        self.after_schedule(out)
        batch = self.batch(out)
        preempted_ids = sorted(out.preempted_req_ids or (), key=lambda v: self.ids(v))
        admission = self.admission(out)
        hits = [PrefixHit(rid, n, n // self.block_size) for rid, n in self.admissions(out) if n]
        for vid in out.preempted_req_ids or ():
            seen = self._seen.get(vid)
            if seen is not None:
                seen.preemptions += 1
        sampled, first_tokens, itl, finished = [], [], [], []
        for vid, seen in list(self._seen.items()):
            req = seen.req
            n_out = req.num_output_tokens
            if n_out > seen.outputs:
                sampled.append(seen.rid)
                if seen.outputs == 0:
                    seen.ttft = t_end - req.arrival_time
                    first_tokens.append(FirstToken(seen.rid, seen.ttft))
                elif seen.last_t is not None:
                    itl.append(ItlSample(seen.rid, t_end - seen.last_t))
                seen.outputs = n_out
                seen.last_t = t_end
            if vid not in s.requests or req.is_finished():
                self.ids.forget(vid)
                finished.append(Finish(seen.rid, seen.ttft or 0.0, t_end - req.arrival_time, n_out,
                                       finish_reason(req.status)))
                del self._seen[vid]
                self._announced.discard(vid)
        if finished:
            self._last_running = ([], [])  # a finished request's vLLM id may come back as a new request
        tables = self.block_tables()
        state = self._block_state()
        dropped_tables = {self.ids(v) for v in out.preempted_req_ids or ()} | {f.req for f in finished}
        alloc, freed, refs = self._deltas(tables, state, dropped_tables)
        self._claims.apply(alloc, freed, refs)
        running, waiting, preempted = self.queues()
        event = StepEvent(
            step=self.step_count,
            t=t_start,
            dur=t_end - t_start,
            budget=s.max_num_scheduled_tokens,
            batch=batch,
            running=running,
            waiting=waiting,
            preempted=preempted,
            admission=admission,
            preemptions=[Preemption(self.ids(v), BLOCKED_KV) for v in preempted_ids],
            alloc=[BlockAlloc(b, r) for b, r in alloc],
            freed=freed,
            refs=[RefChange(b, c) for b, c in refs],
            sampled=sampled,
            first_tokens=first_tokens,
            finished=finished,
            itl=itl,
            kv=self.kv_counters(tables, state),
            dropped=dropped,
            hits=hits,
        )
        return event

    def _deltas(self, tables: dict[int, list[int]], state: tuple[dict[int, int], set[int]],
                dropped: set[int]) -> tuple[list[tuple[int, int]], list[int], list[tuple[int, int]]]:
        j = BlockJournal()
        self.diff_blocks(j, dropped, tables, state)
        return j.take()

    def diff_blocks(self, j: Any, dropped: set[int], tables: dict[int, list[int]] | None = None,
                    state: tuple[dict[int, int], set[int]] | None = None) -> None:
        """Write to ``j`` (a ``BlockJournal``, or anything with its alloc/share/ref/free) the calls that
        take a watcher's block map from the state the last call saw to vLLM's state now.

        ``dropped``: requests whose tables a watcher drops this step (preempted, finished); a request
        dropped and re-admitted in the same step gets its whole table again.
        """
        tables = self.block_tables() if tables is None else tables
        refs_now, cached_now = self._block_state() if state is None else state
        refs_before, cached_before = self._refs, self._cached
        # the holders that keep a block across the step (not dropped, already held it)
        kept: dict[int, int] = {}
        for rid, table in self._tables.items():
            if rid in dropped:
                continue
            now = tables.get(rid, ())
            for b in set(table).intersection(now):
                kept[b] = kept.get(b, 0) + 1
        # a block cached-free before and after is untouched (its state and holders are the same)
        touched = set(refs_before).union(refs_now, cached_before.symmetric_difference(cached_now))
        for b in sorted(touched):
            before_held = b in refs_before
            if b in refs_now:
                if before_held and not kept.get(b):
                    j.free(b)  # it changed hands (its holders were dropped): a new claim follows
            elif b in cached_now:
                if before_held or b not in cached_before:
                    j.ref(b, 0)
            elif before_held or b in cached_before:
                j.free(b)
        claimed: set[int] = set()
        for rid, table in tables.items():
            old = () if rid in dropped else self._tables.get(rid, ())
            old_set = set(old)
            for b in table:
                if b in old_set:
                    continue
                if not kept.get(b) and b not in claimed:
                    claimed.add(b)
                    j.alloc(b, rid)
                    if refs_now.get(b, 1) != 1:
                        j.ref(b, refs_now[b])
                else:
                    j.share(b, rid, refs_now.get(b, 1))
        for b, c in refs_now.items():  # a sharer left (or joined) without a table change of its own
            if kept.get(b) and refs_before.get(b) != c and b not in claimed:
                j.ref(b, c)
        self._tables = {r: list(t) for r, t in tables.items()}
        self._refs, self._cached = dict(refs_now), set(cached_now)

    def snapshot(self, step: int, t: float) -> SnapshotEvent:
        """The whole state; also resets the diff base, so the next ``step()`` is relative to it."""
        tables = self.block_tables()
        refs, cached = self._block_state()
        holders: dict[int, set[int]] = {}
        for rid, table in tables.items():
            for b in table:
                holders.setdefault(b, set()).add(rid)
        claims = self._claims
        owner: dict[int, int] = {}
        for b in refs:  # the claimer the deltas named (it stays the owner while the block is shared: the
            # protocol's rule), else (no step since the last snapshot, or a resync) the block's first holder
            if b < len(claims) and claims.refcount[b] > 0 and claims.owner[b] >= 0:
                owner[b] = claims.owner[b]
            else:
                held = holders.get(b, ())
                owner[b] = min(held, default=-1, key=lambda r: tables[r].index(b))
        blocks = [BlockOwner(b, owner[b], c) for b, c in refs.items()]
        blocks += [BlockOwner(b, -1, 0) for b in cached]
        running, waiting, preempted = self.queues()
        states = []
        for req in [*self.sched.running, *self._waiting_requests()]:
            vid = req.request_id
            seen = self._seen.get(vid)
            sp = req.sampling_params
            status = "running" if req.status.name == "RUNNING" else (
                "preempted" if req.status.name == "PREEMPTED" else "waiting")
            states.append(RequestState(
                req=self.ids(vid), state=status, prompt_len=req.num_prompt_tokens,
                max_tokens=sp.max_tokens if sp is not None and sp.max_tokens is not None else 0,
                computed=req.num_computed_tokens, output_len=req.num_output_tokens, priority=req.priority,
                arrival=req.arrival_time, ttft=seen.ttft if seen else None,
                preemptions=seen.preemptions if seen else 0,
                cached_tokens=max(0, getattr(req, "num_cached_tokens", 0) or 0)))
        self._tables = {r: list(tb) for r, tb in tables.items()}
        self._refs, self._cached = dict(refs), set(cached)
        claims.reset(len(claims))
        for bo in blocks:
            claims.owner[bo.block] = bo.req
            claims.refcount[bo.block] = bo.refcount
            claims.cached[bo.block] = bo.refcount <= 0
        return SnapshotEvent(step=step, t=t, requests=states, blocks=sorted(blocks, key=lambda o: o.block),
                             block_tables=tables, running=running, waiting=waiting, preempted=preempted,
                             kv=self.kv_counters(tables, (refs, cached)))
