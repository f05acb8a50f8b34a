"""VllmEventBuilder's step, with block deltas read from vLLM's SchedulerOutput instead of a full diff.

Inside a real `vllm serve` the pool holds tens of thousands of blocks, and VllmEventBuilder's
``step()`` walks every block and every table each step (bench/vllm_watch_cost.py: longer than
vLLM's own schedule + update at 256 running). vLLM already says what changed: each scheduler
output carries the blocks it gave each request (a new request's or a resumed one's whole table, a
running one's new blocks), and a request that leaves ``req_to_blocks`` gave its table back. So this
builder keeps a mirror of the tables (updated in ``after_schedule``, O(new blocks)), finds the
requests that left (O(requests in the mirror)), reads the refcount and cached state of only the blocks
that moved, and keeps the KV counters by the same changes. Everything else (batch, queues, admission,
hits, first tokens, finishes, snapshots) is VllmEventBuilder's; ``snapshot()`` resets the mirror.

Assumes one KV-cache group of full attention (group 0), as VllmEventBuilder's tables do.
"""

from __future__ import annotations

from typing import Any

from kvscope.adapters.vllm_events import VllmEventBuilder, usable_blocks
from kvscope.protocol.blockmap import BlockJournal
from kvscope.protocol.events import KvCounters


class IncrementalBuilder(VllmEventBuilder):
    def __init__(self, scheduler: Any, req_id=None) -> None:
        super().__init__(scheduler, req_id)
        self._mirror: dict[str, list[int]] = {}  # vLLM id -> block table, as of the last schedule()
        self._mirrored: set[int] = set()  # id() of scheduler outputs already folded into the mirror
        self._pending: list[tuple[str, list[int]]] = []  # (vLLM id, blocks added) since the last step
        self._released: list[tuple[str, list[int]]] = []  # tables preempted since the last step
        self._cached_now: set[int] = set()  # free blocks holding a prefix, by the changes seen
        self._shared: set[int] = set()  # blocks with refcount > 1, by the changes seen
        self._in_step = False

    # ---- the mirror ----------------------------------------------------------------------
    def after_schedule(self, out: Any) -> None:
        raw = getattr(out, "_out", out)  # the watch may hand a view of the output
        if id(raw) in self._mirrored:
            return  # folded in when schedule() returned it (step() calls this again)
        super().after_schedule(out)
        self._mirrored.add(id(raw))
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

    def step(self, out: Any, t_start: float, t_end: float, dropped: int = 0):
        self._in_step = True
        try:
            return super().step(out, t_start, t_end, dropped)
        finally:
            self._in_step = False
            self._mirrored.discard(id(getattr(out, "_out", out)))  # a later output may be folded in already

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
        for vid in [v for v in mirror if v not in live]:  # finished or aborted since the last step
            released.append((vid, mirror.pop(vid)))
        pending = [(vid, bs) for vid, bs in self._pending if vid in mirror]
        reused: dict[int, int] = {}  # block -> times handed out since the last step
        for _, bs in pending:
            for b in bs:
                reused[b] = reused.get(b, 0) + 1
        cached = self._cached_now
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
            rid = ids(vid)
            for b in bs:
                rc = blocks[b].ref_cnt
                if rc > 1:
                    j.share(b, rid, rc)
                else:
                    j.alloc(b, rid)
                cached.discard(b)
        shared = self._shared  # a refcount changes only where a table gained or lost the block
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
        requests = self.sched.requests
        slots = need = held = 0
        for vid, table in self._mirror.items():  # O(requests holding blocks); the same sums as table_slots()
            n = len(table)
            cap = n * bs
            req = requests.get(vid)
            c = cap if req is None else min(req.num_computed_tokens, cap)
            slots += c
            need += -(-c // bs)
            held += n
        total = usable_blocks(pool)
        free = pool.get_num_free_blocks()
        return KvCounters(total=total, used=total - free, free=free, cached=len(self._cached_now),
                          shared=len(self._shared), token_slots=slots, tail_waste=need * bs - slots,
                          reserve_waste=(held - need) * bs, hit_tokens=self.hit_tokens, query_tokens=self.query_tokens)
