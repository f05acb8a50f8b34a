"""What the watched scheduler copies out of vLLM on vLLM's own thread: the least a step's event needs.

The watch splits each step in two. On vLLM's thread (inside ``schedule()`` and ``update_from_output()``)
the ``Capturer`` copies what vLLM is about to change: a few C-level passes over the step's requests
(computed tokens when ``schedule()`` returns, output counts after the update, the RUNNING and WAITING
ids) and, from the blocks the ``SchedulerOutput`` says moved, the net block deltas (a mirror of the
block tables, refcounts of only the touched blocks). Everything else (protocol ids, batch entries,
sampled / first-token / ITL records, finishes, the claimers' map, the event structs) is the
``Assembler``'s (kvscope.vllm.inproc.assemble), on the watch's own thread, from these captures alone.

A finished vLLM ``Request`` is never changed again, so a capture may hand the object itself; a live
one is read here. One KV-cache group of full attention (group 0) is assumed, as everywhere in the watch.
"""

from __future__ import annotations

from collections import Counter
from itertools import chain, compress, repeat
from operator import add, attrgetter, floordiv
from typing import Any

import msgspec

from kvscope.vllm.inproc.events import table_slots, usable_blocks
from kvscope.protocol.blockmap import BlockJournal

_computed = attrgetter("num_computed_tokens")
_outputs = attrgetter("num_output_tokens")
_output_ids = attrgetter("_output_token_ids")  # what num_output_tokens counts, read without a Python call
_request_id = attrgetter("request_id")


class StepCapture(msgspec.Struct, kw_only=True):
    """One step, as copied on vLLM's thread (plain values, and finished requests)."""

    t_start: float
    t_end: float
    vids: list  # the batch: vLLM ids, tokens scheduled, computed tokens when schedule() returned, the Requests
    ns: list
    computed: list
    reqs: list
    outs: list  # output tokens of each, after the update
    hits: list  # (vLLM id, tokens found in the prefix cache) of the requests admitted
    preempted: list
    finished: list  # (vLLM id, finished Request)
    alloc: list  # net block deltas over vLLM ids
    freed: list
    refs: list
    running: list
    waiting: list
    waiting_preempted: list
    head: str | None
    seqs_full: bool
    budget_spent: bool
    admitted: bool
    budget: int
    kv: tuple


class SnapshotCapture(msgspec.Struct, kw_only=True):
    """The whole state, as copied on vLLM's thread."""

    t: float
    tables: dict
    refs: dict
    cached: set
    requests: list
    running: list
    waiting: list
    waiting_preempted: list
    kv: tuple
    live: set


class Capturer:
    def __init__(self, scheduler: Any) -> None:
        self.sched = scheduler
        self.pool = scheduler.kv_cache_manager.block_pool
        self.block_size = scheduler.block_size
        self._mirror: dict[str, list[int]] = {}  # vLLM id -> block table (physical ids), as of the last schedule()
        self._pending: list[tuple[str, list[int]]] = []  # (vLLM id, blocks added) since the last step
        self._released: list[tuple[str, list[int]]] = []  # tables preempted since the last step
        self._cached: set[int] = set()  # free blocks holding a prefix, by the changes seen
        self._shared: set[int] = set()  # blocks with refcount > 1, by the changes seen
        self._batches: dict[int, tuple] = {}  # id(scheduler output) -> the batch as schedule() returned it
        self._freed: set[str] = set()  # requests vLLM freed (finished) by the schedule() calls since the last step
        self._live: dict[str, Any] = {}  # vLLM id -> Request, from its first schedule() to its finish
        self._waiting_last: tuple[list[str], list[bool]] = ([], [])
        self._computed: dict[str, int] = {}  # vLLM id -> computed tokens when the last schedule() returned it

    def _manager(self) -> Any:
        return self.sched.kv_cache_manager.coordinator.single_type_managers[0]

    def _waiting_requests(self) -> list[Any]:
        """vLLM's waiting queues in admission order: requests holding KV first (its queues' own iteration)."""
        s = self.sched
        holding = getattr(s, "kv_holding_waiting", None)
        return [*holding, *s.waiting] if holding is not None and len(holding) else list(s.waiting)

    # ---- schedule() returned ---------------------------------------------------------------
    def scheduled(self, out: Any) -> None:
        requests = self.sched.requests
        nst = out.num_scheduled_tokens
        vids, ns = list(nst), list(nst.values())
        try:
            reqs = list(map(requests.__getitem__, vids))
        except KeyError:  # (never seen: schedule() hands out only live requests)
            vids = [v for v in vids if v in requests]
            ns, reqs = [nst[v] for v in vids], [requests[v] for v in vids]
        # vLLM advanced num_computed_tokens by the step's tokens inside schedule(): start = computed - scheduled
        computed = list(map(_computed, reqs))
        self._batches[id(out)] = (vids, ns, computed, reqs)
        self._computed.update(zip(vids, computed))  # the KV counters' token slots, as of the last schedule()
        if out.finished_req_ids:
            self._freed.update(out.finished_req_ids)
        mirror = self._mirror
        for vid in out.preempted_req_ids or ():
            table = mirror.pop(vid, None)
            if table:
                self._released.append((vid, table))
        live = self._live
        for new in out.scheduled_new_reqs:  # the mirror's list grows later; the pending one must not
            vid = new.req_id
            req = requests.get(vid)
            if req is not None:
                live[vid] = req
            blocks = list(new.block_ids[0]) if new.block_ids else []
            mirror[vid] = list(blocks)
            self._pending.append((vid, blocks))
        cached = out.scheduled_cached_reqs
        resumed = cached.resumed_req_ids
        new_ids = cached.new_block_ids
        for vid, ids in compress(zip(cached.req_ids, new_ids), new_ids):  # (None: no new block)
            blocks = list(ids[0])
            if vid in resumed:  # back from preemption: its whole table
                mirror[vid] = list(blocks)
            else:
                mirror.setdefault(vid, []).extend(blocks)
            if blocks:
                self._pending.append((vid, blocks))

    # ---- update_from_output() returned -------------------------------------------------------
    def step(self, out: Any, preempted: set[str], t_start: float, t_end: float) -> StepCapture:
        s = self.sched
        vids, ns, computed, reqs = self._batches.pop(id(out))
        freed = self._freed
        freed.update(getattr(s, "finished_req_ids", ()) or ())
        live = self._live
        finished = [(vid, live.pop(vid)) for vid in freed if vid in live]
        freed.clear()
        alloc, freed_blocks, refs = self._deltas([vid for vid, _ in finished])
        running = list(map(_request_id, s.running))
        waiting, waiting_preempted = self._waiting()
        found = [(new.req_id, new.num_computed_tokens) for new in out.scheduled_new_reqs]
        cr = out.scheduled_cached_reqs
        if cr.resumed_req_ids:  # (usually none: no pass over every running request)
            found += [(v, n) for v, n in zip(cr.req_ids, cr.num_computed_tokens) if v in cr.resumed_req_ids]
        admitted = bool(out.scheduled_new_reqs) or bool(cr.resumed_req_ids)
        return StepCapture(
            t_start=t_start, t_end=t_end, vids=vids, ns=ns, computed=computed, reqs=reqs,
            outs=self._outputs(reqs), hits=found, preempted=list(preempted), finished=finished,
            alloc=alloc, freed=freed_blocks, refs=refs, running=running, waiting=waiting,
            waiting_preempted=waiting_preempted, head=(waiting[0] if waiting else None),
            seqs_full=len(s.running) >= s.max_num_running_reqs,
            budget_spent=out.total_num_scheduled_tokens >= s.max_num_scheduled_tokens,
            admitted=admitted, budget=s.max_num_scheduled_tokens, kv=self._kv())

    @staticmethod
    def _outputs(reqs: list) -> list[int]:
        try:
            return list(map(len, map(_output_ids, reqs)))
        except (AttributeError, TypeError):  # another vLLM's Request: its public count
            return list(map(_outputs, reqs))

    def _waiting(self) -> tuple[list[str], list[bool]]:
        """WAITING's ids in admission order and which are preempted; the last answer again when the same
        requests wait (a waiting request's status changes only by leaving the queue)."""
        reqs = self._waiting_requests()
        names = list(map(_request_id, reqs))
        last_names, last_flags = self._waiting_last
        if names != last_names:
            last_flags = [r.status.name == "PREEMPTED" for r in reqs]
            self._waiting_last = (names, last_flags)
        return names, last_flags

    def _deltas(self, finished: list[str] = ()) -> tuple[list, list[int], list]:
        """The step's net block deltas over vLLM ids, from the mirror's changes (O(blocks that moved)).
        ``finished``: the requests vLLM freed since the last step; their tables went back to the pool."""
        blocks = self.pool.blocks
        live = self._manager().req_to_blocks
        mirror = self._mirror
        released = self._released
        for vid in finished:
            if vid not in live:  # (a KV connector may hold a finished request's blocks a while: found below)
                table = mirror.pop(vid, None)
                if table is not None:
                    released.append((vid, table))
        if len(mirror) != len(live):  # a table left some other way: find it (O(requests))
            for vid in mirror.keys() - live.keys():
                released.append((vid, mirror.pop(vid)))
        pending = self._pending
        if released:  # a table handed blocks and gone within the step hands nothing
            pending = [(vid, bs) for vid, bs in pending if vid in mirror]
        self._pending, self._released = [], []
        cached, shared = self._cached, self._shared  # a refcount changes only where a table gained or lost it
        if not released:  # the common step: blocks only handed out, so the net deltas are the hand-outs
            alloc: list = []
            refs: list = []
            for vid, bs in pending:
                for b in bs:
                    alloc.append((b, vid))
                    rc = blocks[b].ref_cnt
                    if rc > 1:
                        refs.append((b, rc))
                        shared.add(b)
                    else:
                        shared.discard(b)
                    cached.discard(b)
            return alloc, [], refs
        reused: dict[int, int] = {}  # block -> times handed out since the last step
        for _, bs in pending:
            for b in bs:
                reused[b] = reused.get(b, 0) + 1
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
            for b in bs:
                rc = blocks[b].ref_cnt
                if rc > 1:
                    j.share(b, vid, rc)
                else:
                    j.alloc(b, vid)
                cached.discard(b)
        for _, table in (*released, *pending):
            for b in table:
                if blocks[b].ref_cnt > 1:
                    shared.add(b)
                else:
                    shared.discard(b)
        return j.take()

    def _kv(self) -> tuple[int, ...]:
        """(total, free, cached, shared, held, slots, need): KvCounters' inputs, docs/PROTOCOL.md's rule. Token
        slots count each table's computed tokens as of the last ``schedule()`` (which allocated the table)."""
        bs, mirror, computed = self.block_size, self._mirror, self._computed
        held = sum(map(len, mirror.values()))
        slots = need = -1
        if len(computed) > 2 * len(mirror) + 64:  # forget the requests that hold no table any more
            self._computed = computed = {v: computed[v] for v in mirror if v in computed}
        try:
            tokens = list(map(computed.__getitem__, mirror))
            slots = sum(tokens)
            need = sum(map(floordiv, map(add, tokens, repeat(bs - 1)), repeat(bs)))
        except KeyError:  # (a table whose request was never scheduled: held whole, below)
            pass
        if not (0 <= need <= held and slots <= held * bs):  # a table past its tokens: table_slots() per table
            slots = need = 0
            for vid, table in mirror.items():
                c, tail, _ = table_slots(len(table), computed.get(vid), bs)
                slots += c
                need += (c + tail) // bs
        return (usable_blocks(self.pool), self.pool.get_num_free_blocks(), len(self._cached), len(self._shared),
                held, slots, need)

    # ---- the whole state ------------------------------------------------------------------------
    def snapshot(self, t: float, full: bool) -> SnapshotCapture:
        """The whole state. ``full``: read vLLM's tables and every block of its pool, and start the mirror
        over from them (a resync); else from the mirror, which the steps keep equal to vLLM's (cheap: no
        pass over the pool)."""
        blocks = self.pool.blocks
        if full:
            mirror = {vid: [b.block_id for b in bl if not b.is_null] for vid, bl in self._manager().req_to_blocks.items()}
            self._mirror = {vid: table for vid, table in mirror.items() if table}
            refs = {}
            cached = set()
            for blk in blocks:
                if blk.is_null:
                    continue
                if blk.ref_cnt > 0:
                    refs[blk.block_id] = blk.ref_cnt
                elif blk.block_hash is not None:
                    cached.add(blk.block_id)
            self._cached = set(cached)
            self._shared = {b for b, c in refs.items() if c > 1}
            self._pending, self._released = [], []
            self._computed = {r.request_id: r.num_computed_tokens for r in [*self.sched.running, *self._waiting_requests()]}
        else:
            self._deltas_now_into_mirror()
            refs = {b: blocks[b].ref_cnt for b in Counter(chain.from_iterable(self._mirror.values()))}
            cached = set(self._cached)
        tables = {vid: list(tb) for vid, tb in self._mirror.items()}
        running = list(map(_request_id, self.sched.running))
        waiting, waiting_preempted = self._waiting()
        states = []
        for req in [*self.sched.running, *self._waiting_requests()]:
            sp = req.sampling_params
            states.append((req.request_id, req.status.name, req.num_prompt_tokens,
                           sp.max_tokens if sp is not None and sp.max_tokens is not None else 0,
                           req.num_computed_tokens, req.num_output_tokens, req.priority, req.arrival_time,
                           max(0, getattr(req, "num_cached_tokens", 0) or 0), req))
        return SnapshotCapture(t=t, tables=tables, refs=refs, cached=cached, requests=states, running=running,
                               waiting=waiting, waiting_preempted=waiting_preempted, kv=self._kv(),
                               live=set(self.sched.requests))

    def _deltas_now_into_mirror(self) -> None:
        """Before a snapshot from the mirror: nothing may be pending (a snapshot follows a step's deltas)."""
        if self._pending or self._released or len(self._mirror) != len(self._manager().req_to_blocks):
            self._deltas()  # folds what moved since the step (an abort between steps) into the mirror
