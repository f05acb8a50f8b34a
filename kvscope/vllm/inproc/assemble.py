"""The watched scheduler's events, assembled on the watch's own thread from what vLLM's thread captured.

``Assembler`` turns kvscope.vllm.inproc.capture's captures into protocol events, in order, and owns
everything a watcher's view is made of: the protocol ids of vLLM's requests, what each request has
done (outputs seen, last token time, TTFT, preemptions), the claimers' block map that snapshots report,
the prefix-hit tallies. It never reads a live vLLM object: a capture holds plain values, and finished
``Request`` objects (which vLLM no longer changes) or fields that never change (prompt length, arrival).
The events mean what VllmEventBuilder's mean (kvscope.vllm.inproc.events), field for field.
"""

from __future__ import annotations

from typing import Any

from kvscope.vllm.inproc.capture import SnapshotCapture, StepCapture
from kvscope.vllm.inproc.events import RequestIds, _Seen, finish_reason
from kvscope.protocol.blockmap import BlockMap
from kvscope.protocol.events import (
    BLOCKED_BUDGET,
    BLOCKED_KV,
    BLOCKED_SEQS,
    DECODE,
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

_STATES = {"RUNNING": "running", "PREEMPTED": "preempted"}  # any other live status reads as waiting


class Assembler:
    def __init__(self, block_size: int, num_blocks: int, wall_start: float) -> None:
        self.block_size = block_size
        self.wall_start = wall_start
        self.ids = RequestIds()
        self.seen: dict[str, _Seen] = {}
        self.claims = BlockMap(num_blocks, tables=False)
        self.hit_tokens = 0
        self.query_tokens = 0
        self.step_count = 0
        self._running: tuple[list[str], list[int]] = ([], [])
        self._waiting: tuple[list[str], list[bool], list[int], list[int]] = ([], [], [], [])

    def _t(self, t: float) -> float:
        return max(0.0, t - self.wall_start)

    # ---- events ---------------------------------------------------------------------------------
    def request(self, req: Any) -> RequestEvent:
        sp = req.sampling_params
        return RequestEvent(self.ids[req.request_id], req.num_prompt_tokens,
                            sp.max_tokens if sp is not None and sp.max_tokens is not None else 0,
                            req.priority, self._t(req.arrival_time))

    def step(self, c: StepCapture, dropped: int = 0) -> StepEvent:
        ids, seen_map, bs = self.ids, self.seen, self.block_size
        self.step_count += 1
        t_end = c.t_end
        batch, members = [], []
        for vid, n, computed, req in zip(c.vids, c.ns, c.computed, c.reqs):
            seen = seen_map.get(vid)
            if seen is None:
                seen = seen_map[vid] = _Seen(req, ids[vid])
            start = computed - n if computed > n else 0
            # a decode computes one token past the prompt; a prompt chunk or a resumed request's recompute is a prefill
            batch.append(BatchEntry(seen.rid, DECODE if n == 1 and start >= req.num_prompt_tokens else PREFILL, n,
                                    start))
            members.append(seen)
        hits = []
        for vid, cached in c.hits:
            seen = seen_map.get(vid)
            if seen is None:
                continue
            prompt = seen.req.num_prompt_tokens
            self.query_tokens += prompt
            self.hit_tokens += min(cached, prompt)
            if cached:
                hits.append(PrefixHit(seen.rid, cached, cached // bs))
        preemptions = []
        for vid in sorted(c.preempted, key=ids.__getitem__):
            preemptions.append(Preemption(ids[vid], BLOCKED_KV))
            seen = seen_map.get(vid)
            if seen is not None:
                seen.preemptions += 1
        sampled, first_tokens, itl = [], [], []  # only the step's scheduled requests get tokens from its update
        for seen, n_out in zip(members, c.outs):
            if n_out > seen.outputs:
                rid = seen.rid
                sampled.append(rid)
                if seen.outputs == 0:
                    seen.ttft = t_end - seen.req.arrival_time
                    first_tokens.append(FirstToken(rid, seen.ttft))
                elif seen.last_t is not None:
                    itl.append(ItlSample(rid, t_end - seen.last_t))
                seen.outputs = n_out
                seen.last_t = t_end
        if c.waiting:
            head = ids[c.head]
            reason = BLOCKED_SEQS if c.seqs_full else (BLOCKED_BUDGET if c.budget_spent else BLOCKED_KV)
            admission = Admission(VERDICT_BLOCKED, reason, head)
        else:
            admission = Admission(VERDICT_ADMITTED if c.admitted else VERDICT_IDLE)
        running = self._running_ids(c.running)
        waiting, preempted = self._waiting_ids(c.waiting, c.waiting_preempted)
        alloc = [(b, ids[vid]) for b, vid in c.alloc]
        self.claims.apply(alloc, c.freed, c.refs)
        finished = []
        for vid, req in c.finished:
            seen = seen_map.pop(vid, None)
            if seen is None:
                continue
            finished.append(Finish(seen.rid, seen.ttft or 0.0, t_end - req.arrival_time, req.num_output_tokens,
                                   finish_reason(req.status)))
            ids.forget(vid)
        if finished:  # a finished request's vLLM id may come back as a new request
            self._running = ([], [])
            self._waiting = ([], [], [], [])
        return StepEvent(
            step=self.step_count, t=self._t(c.t_start), dur=t_end - c.t_start, budget=c.budget, batch=batch,
            running=running, waiting=waiting, preempted=preempted, admission=admission, preemptions=preemptions,
            alloc=[BlockAlloc(b, r) for b, r in alloc], freed=c.freed, refs=[RefChange(b, n) for b, n in c.refs],
            sampled=sampled, first_tokens=first_tokens, finished=finished, itl=itl, kv=self._kv(c.kv),
            dropped=dropped, hits=hits)

    def snapshot(self, c: SnapshotCapture) -> SnapshotEvent:
        """The whole state; the claimers' map starts over from it."""
        ids, seen_map, claims = self.ids, self.seen, self.claims
        for vid in [v for v in seen_map if v not in c.live]:  # finished in a step that was lost (a drop)
            del seen_map[vid]
            ids.forget(vid)
        tables = {ids[vid]: t for vid, t in c.tables.items()}
        owner: dict[int, int] = {}
        for rid, table in tables.items():
            for b in table:
                if b not in owner:
                    # the claimer the deltas named (it stays the owner while the block is shared: the protocol's
                    # rule), else (no step since the last snapshot, or a resync) the block's first holder
                    known = b < len(claims) and claims.refcount[b] > 0 and claims.owner[b] >= 0
                    owner[b] = claims.owner[b] if known else rid
        blocks = [BlockOwner(b, owner.get(b, -1), n) for b, n in c.refs.items()]
        blocks += [BlockOwner(b, -1, 0) for b in c.cached]
        blocks.sort(key=lambda o: o.block)
        claims.reset(len(claims))
        for bo in blocks:
            claims.owner[bo.block] = bo.req
            claims.refcount[bo.block] = bo.refcount
            claims.cached[bo.block] = bo.refcount <= 0
        states = []
        for vid, status, prompt, max_tokens, computed, outputs, priority, arrival, cached, req in c.requests:
            seen = seen_map.get(vid)
            states.append(RequestState(
                req=ids[vid], state=_STATES.get(status, "waiting"), prompt_len=prompt, max_tokens=max_tokens,
                computed=computed, output_len=outputs, priority=priority, arrival=self._t(arrival),
                ttft=seen.ttft if seen else None, preemptions=seen.preemptions if seen else 0, cached_tokens=cached))
        self._running = ([], [])
        self._waiting = ([], [], [], [])
        waiting, preempted = self._waiting_ids(c.waiting, c.waiting_preempted)
        return SnapshotEvent(step=self.step_count, t=self._t(c.t), requests=states, blocks=blocks, block_tables=tables,
                             running=self._running_ids(c.running), waiting=waiting, preempted=preempted,
                             kv=self._kv(c.kv))

    # ---- pieces -----------------------------------------------------------------------------------
    def _running_ids(self, names: list[str]) -> list[int]:
        """Protocol ids of RUNNING; the last list again when the same requests run (most steps)."""
        last_names, last_ids = self._running
        if names != last_names:
            last_ids = list(map(self.ids.__getitem__, names))
            self._running = (names, last_ids)
        return list(last_ids)

    def _waiting_ids(self, names: list[str], preempted_flags: list[bool]) -> tuple[list[int], list[int]]:
        last_names, last_flags, waiting, preempted = self._waiting
        if names != last_names or preempted_flags != last_flags:
            ids = self.ids
            waiting, preempted = [], []
            for vid, p in zip(names, preempted_flags):
                (preempted if p else waiting).append(ids[vid])
            self._waiting = (names, preempted_flags, waiting, preempted)
        return list(waiting), list(preempted)

    def _kv(self, kv: tuple[int, ...]) -> KvCounters:
        total, free, cached, shared, held, slots, need = kv
        bs = self.block_size
        return KvCounters(total=total, used=total - free, free=free, cached=cached, shared=shared, token_slots=slots,
                          tail_waste=need * bs - slots, reserve_waste=(held - need) * bs,
                          hit_tokens=self.hit_tokens, query_tokens=self.query_tokens)
