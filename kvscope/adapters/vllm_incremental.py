"""VllmEventBuilder's step, with block deltas read from vLLM's SchedulerOutput instead of a full diff.

Inside a real `vllm serve` the pool holds tens of thousands of blocks, and VllmEventBuilder's
``step()`` walks every block and every table each step (bench/vllm_watch_cost.py: longer than
vLLM's own schedule + update at 256 running). vLLM already says what changed: each scheduler
output carries the blocks it gave each request (a new request's or a resumed one's whole table, a
running one's new blocks), and a request that leaves ``req_to_blocks`` gave its table back. So this
builder keeps a mirror of the tables (updated in ``after_schedule``, O(new blocks)), finds the
requests that left (O(requests in the mirror)), reads the refcount and cached state of only the blocks
that moved, and keeps the KV counters by the same changes. Its ``step()`` does per request only
what must be per request: the batch entry (built when ``schedule()`` returns it, so a start position
is the one that step computed from, even with async scheduling), whether it sampled, the queue lists;
finishes come from vLLM's own set of freed requests, not a scan. Admission, hits, preemptions and
snapshots are VllmEventBuilder's; ``snapshot()`` resets the mirror.

Assumes one KV-cache group of full attention (group 0), as VllmEventBuilder's tables do.
"""

from __future__ import annotations

from itertools import repeat
from operator import add, attrgetter, floordiv
from typing import Any

from kvscope.adapters.vllm_events import VllmEventBuilder, _Seen, finish_reason, usable_blocks
from kvscope.protocol.blockmap import BlockJournal
from kvscope.protocol.events import (
    BLOCKED_KV,
    DECODE,
    PREFILL,
    BatchEntry,
    BlockAlloc,
    Finish,
    FirstToken,
    ItlSample,
    KvCounters,
    Preemption,
    PrefixHit,
    RefChange,
    StepEvent,
)

_computed = attrgetter("num_computed_tokens")
_request_id = attrgetter("request_id")
_req = attrgetter("req")
_outputs = attrgetter("num_output_tokens")


class IncrementalBuilder(VllmEventBuilder):
    def __init__(self, scheduler: Any, req_id=None) -> None:
        super().__init__(scheduler, req_id)
        self._mirror: dict[str, list[int]] = {}  # vLLM id -> block table, as of the last schedule()
        self._mirrored: set[int] = set()  # id() of scheduler outputs already folded into the mirror
        self._pending: list[tuple[str, list[int]]] = []  # (vLLM id, blocks added) since the last step
        self._released: list[tuple[str, list[int]]] = []  # tables preempted since the last step
        self._cached_now: set[int] = set()  # free blocks holding a prefix, by the changes seen
        self._shared: set[int] = set()  # blocks with refcount > 1, by the changes seen
        self._batches: dict[int, tuple[list, list]] = {}  # id(output) -> (batch entries, their _Seen)
        self._freed: set[str] = set()  # requests vLLM freed (finished) by schedule() calls since the last step
        self._in_step = False

    # ---- the mirror ----------------------------------------------------------------------
    def after_schedule(self, out: Any) -> None:
        raw = getattr(out, "_out", out)  # the watch may hand a view of the output
        if id(raw) in self._mirrored:
            return  # folded in when schedule() returned it (step() calls this again)
        self._mirrored.add(id(raw))
        self._batches[id(raw)] = self._batch_now(raw)
        freed = raw.finished_req_ids
        if freed:
            self._freed.update(freed)
        mirror = self._mirror
        for vid in raw.preempted_req_ids or ():
            table = mirror.pop(vid, None)
            if table:
                self._released.append((vid, table))
        for new in raw.scheduled_new_reqs:  # the mirror's list grows later; the pending one must not
            blocks = list(new.block_ids[0]) if new.block_ids else []
            mirror[new.req_id] = list(blocks)
            self._pending.append((new.req_id, blocks))
        cached = raw.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        for vid, ids in zip(cached.req_ids, cached.new_block_ids):
            if ids is None:
                continue
            blocks = list(ids[0])
            if vid in resumed:  # back from preemption: its whole table
                mirror[vid] = list(blocks)
            else:
                mirror.setdefault(vid, []).extend(blocks)
            if blocks:
                self._pending.append((vid, blocks))

    def _batch_now(self, raw: Any) -> tuple[list, list]:
        """The step's batch entries and their requests' records, read right after ``schedule()`` (vLLM
        has just advanced ``num_computed_tokens`` by the step's tokens: start = computed - scheduled)."""
        requests, seen_map, ids = self.sched.requests, self._seen, self.ids
        entries: list = []
        members: list = []
        for vid, n in raw.num_scheduled_tokens.items():
            seen = seen_map.get(vid)
            if seen is None:
                req = requests.get(vid)
                if req is None:
                    continue
                seen = seen_map[vid] = _Seen(req, ids[vid])
            req = seen.req
            start = req.num_computed_tokens - n
            if start < 0:
                start = 0
            # a decode computes one token past the prompt; a prompt chunk or a resumed request's recompute is a prefill
            entries.append(BatchEntry(seen.rid, DECODE if n == 1 and start >= req.num_prompt_tokens else PREFILL,
                                      n, start))
            members.append(seen)
        return entries, members

    def step(self, out: Any, t_start: float, t_end: float, dropped: int = 0) -> StepEvent:
        """VllmEventBuilder.step's event, with per-request work only where the protocol needs an entry."""
        raw = getattr(out, "_out", out)
        self.after_schedule(out)  # a no-op when the watch handed it over at schedule()
        self._mirrored.discard(id(raw))  # a later output may be folded in already
        entries, members = self._batches.pop(id(raw))
        self._in_step = True
        try:
            return self._step(out, entries, members, t_start, t_end, dropped)
        finally:
            self._in_step = False

    def _step(self, out: Any, batch: list, members: list, t_start: float, t_end: float, dropped: int) -> StepEvent:
        s, ids, seen_map = self.sched, self.ids, self._seen
        self.step_count += 1
        preempted_vids = out.preempted_req_ids or ()
        admission = self.admission(out)
        bs = self.block_size
        hits = [PrefixHit(rid, n, n // bs) for rid, n in self.admissions(out) if n]
        preemptions = []
        for vid in sorted(preempted_vids, key=ids.__getitem__):
            preemptions.append(Preemption(ids[vid], BLOCKED_KV))
            seen = seen_map.get(vid)
            if seen is not None:
                seen.preemptions += 1
        # who sampled: only the step's scheduled requests get tokens from its update
        sampled, first_tokens, itl = [], [], []
        for seen, n_out in zip(members, map(_outputs, map(_req, members))):
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
        # who finished: vLLM's own record of the requests it freed (handed to each schedule(), and since)
        freed = self._freed
        freed.update(getattr(s, "finished_req_ids", ()) or ())
        finished = []
        requests = s.requests
        for vid in [v for v in freed if v in seen_map]:
            seen = seen_map[vid]
            req = seen.req
            if vid in requests and not req.is_finished():
                continue  # freed under this id earlier, and a new request reuses it
            finished.append(Finish(seen.rid, seen.ttft or 0.0, t_end - req.arrival_time, req.num_output_tokens,
                                   finish_reason(req.status)))
            ids.forget(vid)
            del seen_map[vid]
            self._announced.discard(vid)
        freed.clear()
        if finished:
            self._last_running = ([], [])  # a finished request's vLLM id may come back as a new request
        alloc, freed_blocks, refs = self._deltas(None, None, None)
        self._claims.apply(alloc, freed_blocks, refs)
        running, waiting, preempted = self.queues()
        return StepEvent(
            step=self.step_count, t=t_start, dur=t_end - t_start, budget=s.max_num_scheduled_tokens, batch=batch,
            running=running, waiting=waiting, preempted=preempted, admission=admission, preemptions=preemptions,
            alloc=[BlockAlloc(b, r) for b, r in alloc], freed=freed_blocks, refs=[RefChange(b, c) for b, c in refs],
            sampled=sampled, first_tokens=first_tokens, finished=finished, itl=itl, kv=self.kv_counters(),
            dropped=dropped, hits=hits)

    def snapshot(self, step: int, t: float):
        snap = super().snapshot(step, t)  # reads the whole state (the full scan, once per snapshot)
        self._mirror = {vid: [b.block_id for b in blocks if not b.is_null]
                        for vid, blocks in self._manager().req_to_blocks.items()}
        self._pending, self._released = [], []
        self._cached_now = {bo.block for bo in snap.blocks if bo.refcount <= 0}
        self._shared = {bo.block for bo in snap.blocks if bo.refcount > 1}
        return snap

    # ---- what VllmEventBuilder.step reads, cheaply while stepping ---------------------------
    def block_tables(self) -> dict[int, list[int]]:
        return {} if self._in_step else super().block_tables()

    def _block_state(self):
        return ({}, set()) if self._in_step else super()._block_state()

    def _deltas(self, tables, state, dropped):
        if not self._in_step:
            return super()._deltas(tables, state, dropped)
        blocks = self.pool.blocks
        live = self._manager().req_to_blocks
        mirror, ids = self._mirror, self.ids
        released = self._released
        for vid in mirror.keys() - live.keys():  # finished or aborted since the last step
            released.append((vid, mirror.pop(vid)))
        pending = [(vid, bs) for vid, bs in self._pending if vid in mirror]
        reused: dict[int, int] = {}  # block -> times handed out since the last step
        for _, bs in pending:
            for b in bs:
                reused[b] = reused.get(b, 0) + 1
        cached = self._cached_now
        shared = self._shared  # a refcount changes only where a table gained or lost the block
        if not released:  # the common step: blocks only handed out, so the net deltas are the hand-outs
            alloc: list[tuple[int, int]] = []
            refs: list[tuple[int, int]] = []
            for vid, bs in pending:
                rid = ids[vid]
                for b in bs:
                    alloc.append((b, rid))
                    rc = blocks[b].ref_cnt
                    if rc > 1:
                        refs.append((b, rc))
                        shared.add(b)
                    else:
                        shared.discard(b)
                    cached.discard(b)
            self._pending = []
            return alloc, [], refs
        j = BlockJournal()
        for _, table in released:
            for b in table:
                blk = blocks[b]
                if b in reused and blk.ref_cnt <= reused[b]:
                    j.free(b)  # only newcomers hold it now: it leaves the old table, and a claim follows
                elif blk.ref_cnt > 0:
                    j.ref(b, blk.ref_cnt)  # still shared by a live request
                elif blk.block_hash is not None:
                    j.ref(b, 0)
                    cached.add(b)
                else:
                    j.free(b)
                    cached.discard(b)
        for vid, bs in pending:
            rid = ids[vid]
            for b in bs:
                rc = blocks[b].ref_cnt
                if rc > 1:
                    j.share(b, rid, rc)
                else:
                    j.alloc(b, rid)
                cached.discard(b)
        for _, table in (*released, *pending):
            for b in table:
                if blocks[b].ref_cnt > 1:
                    shared.add(b)
                else:
                    shared.discard(b)
        self._pending, self._released = [], []
        return j.take()

    def kv_counters(self, tables=None, state=None) -> KvCounters:
        if not self._in_step:
            return super().kv_counters(tables, state)
        pool, bs = self.pool, self.block_size
        mirror = self._mirror
        held = sum(map(len, mirror.values()))
        running = self.sched.running
        names = self._last_running[0]  # queues() read them this step
        if len(running) == len(mirror) == len(names) and all(map(mirror.__contains__, names)):
            # every table is a running request's and vLLM allocates for its computed tokens: the sums of
            # table_slots() without a Python loop
            computed = list(map(_computed, running))
            slots = sum(computed)
            need = sum(map(floordiv, map(add, computed, repeat(bs - 1)), repeat(bs)))
            if need <= held and slots <= held * bs:
                return self._counters(held, slots, need)
        requests = self.sched.requests
        slots = need = 0
        for vid, table in mirror.items():  # a waiting request holding KV, or a table past its tokens
            cap = len(table) * bs
            req = requests.get(vid)
            c = cap if req is None else min(req.num_computed_tokens, cap)
            slots += c
            need += -(-c // bs)
        return self._counters(held, slots, need)

    def _counters(self, held: int, slots: int, need: int) -> KvCounters:
        pool, bs = self.pool, self.block_size
        total = usable_blocks(pool)
        free = pool.get_num_free_blocks()
        return KvCounters(total=total, used=total - free, free=free, cached=len(self._cached_now),
                          shared=len(self._shared), token_slots=slots, tail_waste=need * bs - slots,
                          reserve_waste=(held - need) * bs, hit_tokens=self.hit_tokens, query_tokens=self.query_tokens)
