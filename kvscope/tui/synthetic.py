"""A deterministic synthetic event stream for tests, benchmarks and screenshots.

A toy scheduler (paged blocks, chunked prefill, a prefix cache, preemption by
recompute) run on a virtual clock. It exists so the TUI can be developed and
tested without the engine; it is not the engine and makes no claim about
performance. Its events follow the rules documented in ``kvscope.tui.state``:
like the engine, steps count from 1, a snapshot carries the step it follows, block
deltas are net over the step (docs/PROTOCOL.md), and a block whose refcount drops
to 0 while it holds a registered prefix stays cached (a RefChange to 0, not freed); a
cached block leaves the cache through ``freed`` (evicted, or reused: freed + alloc).
"""

from __future__ import annotations

import math
import random
from collections import OrderedDict, deque
from dataclasses import dataclass, field

from kvscope.protocol.events import (
    BLOCKED_BUDGET,
    BLOCKED_KV,
    BLOCKED_SEQS,
    DECODE,
    FINISHED,
    PREEMPTED,
    PREFILL,
    PROTOCOL_VERSION,
    RUNNING,
    VERDICT_ADMITTED,
    VERDICT_BLOCKED,
    VERDICT_IDLE,
    WAITING,
    Admission,
    BatchEntry,
    BlockAlloc,
    BlockOwner,
    ByeEvent,
    Finish,
    FirstToken,
    HelloEvent,
    ItlSample,
    KvCounters,
    Preemption,
    RefChange,
    RejectEvent,
    RequestEvent,
    RequestState,
    SnapshotEvent,
    StepEvent,
)


class _NetLog:
    """Allocator calls of one step turned into net ``alloc``/``freed`` lists.

    Like ``kvscope.protocol.deltas.BlockDeltaLog`` (a block allocated and freed
    in the step is in neither list, one freed and handed out again is in both),
    but ``alloc`` keeps the order of the allocations, so a request's blocks
    arrive in logical (block table) order. ``share`` adds a block that stays
    owned by someone else to a request's table; ``ref`` records refcounts,
    handed out as the final count per block.
    """

    def __init__(self) -> None:
        self.calls: list[tuple[str, int, int]] = []
        self.refs: dict[int, int] = {}

    def alloc(self, block: int, req: int) -> None:
        self.calls.append(("alloc", block, req))

    def free(self, block: int) -> None:
        self.calls.append(("free", block, -1))
        self.refs.pop(block, None)  # back in the pool: earlier counts no longer apply

    def share(self, block: int, req: int) -> None:
        self.calls.append(("share", block, req))

    def ref(self, block: int, refcount: int) -> None:
        self.refs[block] = refcount  # net: the last count per block, first-touch order

    def take(self) -> tuple[list[BlockAlloc], list[int], list[RefChange]]:
        start: dict[int, str] = {}
        last: dict[int, int] = {}  # block -> index of its last alloc/free call
        for i, (kind, b, _) in enumerate(self.calls):
            if kind == "share":
                continue
            start.setdefault(b, "free" if kind == "alloc" else "owned")
            last[b] = i
        alloc: list[BlockAlloc] = []
        freed: list[int] = []
        freed_set: set[int] = set()
        for i, (kind, b, req) in enumerate(self.calls):
            if kind == "share":
                alloc.append(BlockAlloc(b, req))
            elif start[b] == "owned" and b not in freed_set:
                freed.append(b)  # it left its owner at some point this step
                freed_set.add(b)
            if kind == "alloc" and last[b] == i:
                alloc.append(BlockAlloc(b, req))
        refs = [RefChange(b, c) for b, c in self.refs.items()]
        self.calls = []
        self.refs = {}
        return alloc, freed, refs


@dataclass
class _Req:
    req: int
    prompt_len: int
    max_tokens: int
    priority: int
    arrival: float
    prefix: int | None
    state: str = WAITING
    computed: int = 0
    output_len: int = 0
    target: int = 0
    blocks: list = field(default_factory=list)
    ttft: float | None = None
    last_tok: float | None = None
    preemptions: int = 0


class SyntheticEngine:
    """Generates hello, request, step, snapshot and bye events, step by step."""

    def __init__(
        self,
        *,
        seed: int = 0,
        num_blocks: int = 96,
        block_size: int = 16,
        budget: int = 256,
        max_seqs: int = 8,
        mode: str = "chunked",
        arrival_p: float = 0.4,
        prefix_share: float = 0.35,
        prefix_blocks: int = 2,
        long_p: float = 0.08,
        snapshot_every: int = 50,
        bursts: tuple[int, ...] = (),
        burst_size: int = 6,
    ) -> None:
        self.rng = random.Random(seed)
        self.seed = seed
        self.n = num_blocks
        self.bs = block_size
        self.budget = budget
        self.max_seqs = max_seqs
        self.mode = mode
        self.arrival_p = arrival_p
        self.prefix_share = prefix_share
        self.prefix_len = prefix_blocks * block_size
        self.long_p = long_p
        self.snapshot_every = snapshot_every
        self.bursts = set(bursts)
        self.burst_size = burst_size
        self.config = {
            "model": "synthetic", "device": "cpu", "backend": "sim", "mode": mode, "policy": "fcfs",
            "block_size": block_size, "num_blocks": num_blocks, "max_num_seqs": max_seqs,
            "max_num_batched_tokens": budget,
        }
        self.t = 0.0
        self.done_step = 0  # last completed step (steps count from 1, as in the engine)
        self.next_id = 0
        self.reqs: dict[int, _Req] = {}
        self.waiting: deque[int] = deque()
        self.preempted: list[int] = []
        self.running: list[int] = []
        self.free: deque[int] = deque(range(num_blocks))
        self.cached: OrderedDict[int, None] = OrderedDict()
        self.rc = [0] * num_blocks
        self.owner = [-1] * num_blocks
        self.block_key: dict[int, int] = {}
        self.registry: dict[int, list[int]] = {}
        self.log = _NetLog()  # net block deltas per step, as the protocol asks

    # -- helpers --------------------------------------------------------------------
    def hello(self) -> HelloEvent:
        # A run is identified by its wall_start: different seeds, different runs.
        return HelloEvent(version=PROTOCOL_VERSION, config=dict(self.config), wall_start=1_700_000_000.0 + self.seed)

    def _arrive(self, out: list) -> None:
        rng = self.rng
        rid = self.next_id
        self.next_id += 1
        prefix = rng.randrange(2) if rng.random() < self.prefix_share else None
        if rng.random() < self.long_p:
            prompt = rng.randint(600, 1100)
        else:
            prompt = rng.randint(20, 160)
        if prefix is not None:
            prompt = max(prompt, self.prefix_len + 8)
        r = _Req(rid, prompt, rng.randint(6, 40), rng.choice((0, 0, 0, 1, 2)), round(self.t, 6), prefix)
        r.target = prompt
        if math.ceil((prompt + r.max_tokens) / self.bs) > self.n:
            out.append(RequestEvent(rid, r.prompt_len, r.max_tokens, r.priority, r.arrival))
            out.append(RejectEvent(rid, "max_model_len", r.arrival))
            return
        self.reqs[rid] = r
        self.waiting.append(rid)
        out.append(RequestEvent(rid, r.prompt_len, r.max_tokens, r.priority, r.arrival))

    def _capacity(self) -> int:
        return len(self.free) + len(self.cached)

    def _take(self) -> int | None:
        if self.free:
            return self.free.popleft()
        if self.cached:
            b, _ = self.cached.popitem(last=False)
            self.log.free(b)  # evicted: the cached prefix is gone
            key = self.block_key.pop(b, None)
            if key is not None:
                blocks = self.registry.pop(key, [])
                for ob in blocks:
                    self.block_key.pop(ob, None)
            return b
        return None

    def _grow(self, r: _Req, upto: int, alloc: list) -> bool:
        need = math.ceil(upto / self.bs) - len(r.blocks)
        if need <= 0:
            return True
        if need > self._capacity():
            return False
        for _ in range(need):
            b = self._take()
            self.rc[b] = 1
            self.owner[b] = r.req
            r.blocks.append(b)
            self.log.alloc(b, r.req)
        return True

    def _release(self, r: _Req, freed: list, refs: list) -> None:
        for b in r.blocks:
            self.rc[b] -= 1
            if self.rc[b] > 0:
                self.log.ref(b, self.rc[b])
            elif b in self.block_key:
                self.cached[b] = None
                self.log.ref(b, 0)
            else:
                self.owner[b] = -1
                self.free.append(b)
                self.log.free(b)
        r.blocks = []

    def _preempt(self, victim: _Req, preemptions: list, freed: list, refs: list) -> None:
        self._release(victim, freed, refs)
        victim.state = PREEMPTED
        victim.computed = 0
        victim.target = victim.prompt_len + victim.output_len
        victim.preemptions += 1
        self.running.remove(victim.req)
        self.preempted.append(victim.req)
        preemptions.append(Preemption(victim.req, BLOCKED_KV, "recompute"))

    # -- one iteration --------------------------------------------------------------
    def step(self) -> list:
        out: list = []
        rng = self.rng
        if rng.random() < self.arrival_p:
            self._arrive(out)
        n = self.done_step + 1
        if n in self.bursts:
            for _ in range(self.burst_size):
                self._arrive(out)

        freed: list[int] = []
        alloc: list[BlockAlloc] = []
        refs: list[RefChange] = []
        preemptions: list[Preemption] = []
        batch: list[BatchEntry] = []

        left = self.budget
        # 1. decodes of running requests whose prefill is done (oldest first)
        for rid in list(self.running):
            r = self.reqs[rid]
            if r.state != RUNNING or r.computed < r.target or left <= 0:
                continue
            while not self._grow(r, r.computed + 1, alloc):
                victim = self.reqs[self.running[-1]]
                self._preempt(victim, preemptions, freed, refs)
                if victim is r:
                    break
            if r.state != RUNNING:
                continue
            batch.append(BatchEntry(rid, DECODE, 1, r.computed))
            left -= 1
        # 2. prefill chunks of running requests
        for rid in self.running:
            r = self.reqs[rid]
            if r.computed >= r.target or left <= 0:
                continue
            chunk = min(r.target - r.computed, left)
            if self.mode != "chunked" and chunk < r.target - r.computed:
                continue
            while chunk > 0 and not self._grow(r, r.computed + chunk, alloc):
                chunk = len(r.blocks) * self.bs + self._capacity() * self.bs - r.computed
                chunk = min(chunk, r.target - r.computed, left)
            if chunk <= 0:
                continue
            batch.append(BatchEntry(rid, PREFILL, chunk, r.computed))
            left -= chunk
        # 3. admission: preempted first, then waiting
        admission = Admission(VERDICT_IDLE)
        while self.preempted or self.waiting:
            from_pre = bool(self.preempted)
            rid = self.preempted[0] if from_pre else self.waiting[0]
            r = self.reqs[rid]
            if len(self.running) >= self.max_seqs:
                admission = Admission(VERDICT_BLOCKED, BLOCKED_SEQS, rid)
                break
            if left <= 0:
                admission = Admission(VERDICT_BLOCKED, BLOCKED_BUDGET, rid)
                break
            shared = self.registry.get(r.prefix) if r.prefix is not None else None
            start = self.prefix_len if shared and r.target > self.prefix_len else 0
            chunk = min(r.target - start, left)
            if self.mode != "chunked" and chunk < r.target - start:
                admission = Admission(VERDICT_BLOCKED, BLOCKED_BUDGET, rid)
                break
            need = math.ceil((start + chunk) / self.bs) - (len(shared) if start else 0)
            evictable_shared = sum(1 for b in (shared or ()) if b in self.cached) if start else 0
            if need > self._capacity() - evictable_shared:
                admission = Admission(VERDICT_BLOCKED, BLOCKED_KV, rid)
                break
            if from_pre:
                self.preempted.pop(0)
            else:
                self.waiting.popleft()
            if start:
                for b in shared:
                    if self.rc[b] == 0:  # a cached block leaves the cache for rid
                        self.cached.pop(b, None)
                        self.owner[b] = rid
                        self.log.free(b)
                        self.log.alloc(b, rid)
                    else:  # a block still held: shared, keeps its first owner
                        self.log.share(b, rid)
                    self.rc[b] += 1
                    r.blocks.append(b)
                    self.log.ref(b, self.rc[b])
            r.computed = start
            ok = self._grow(r, start + chunk, alloc)
            assert ok
            r.state = RUNNING
            self.running.append(rid)
            batch.append(BatchEntry(rid, PREFILL, chunk, start))
            left -= chunk
            admission = Admission(VERDICT_ADMITTED, None, rid)

        # run
        tokens = sum(b.tokens for b in batch)
        dur = round(0.004 + 2.5e-5 * tokens + 0.0005 * rng.random(), 6)
        t0 = self.t
        t_end = round(t0 + dur, 6)
        sampled: list[int] = []
        firsts: list[FirstToken] = []
        itl: list[ItlSample] = []
        finished: list[Finish] = []
        for be in batch:
            r = self.reqs[be.req]
            r.computed = be.start + be.tokens
            if r.prefix is not None and r.prefix not in self.registry and r.computed >= self.prefix_len \
                    and r.preemptions == 0 and len(r.blocks) >= self.prefix_len // self.bs:
                blocks = r.blocks[: self.prefix_len // self.bs]
                if not any(b in self.block_key for b in blocks):
                    self.registry[r.prefix] = list(blocks)
                    for b in blocks:
                        self.block_key[b] = r.prefix
            if r.computed < r.target:
                continue
            r.output_len += 1
            sampled.append(r.req)
            if r.ttft is None:
                r.ttft = round(t_end - r.arrival, 6)
                firsts.append(FirstToken(r.req, r.ttft))
            elif r.last_tok is not None:
                itl.append(ItlSample(r.req, round(t_end - r.last_tok, 6)))
            r.last_tok = t_end
            if r.output_len >= r.max_tokens:
                r.state = FINISHED
                finished.append(Finish(r.req, r.ttft, round(t_end - r.arrival, 6), r.output_len, "length"))
                self.running.remove(r.req)
                self._release(self.reqs.pop(r.req), freed, refs)

        alloc, freed, refs = self.log.take()
        kv = self._kv()
        ev = StepEvent(
            step=n, t=t0, dur=dur, budget=self.budget, batch=batch, padding=0,
            running=list(self.running), waiting=list(self.waiting), preempted=list(self.preempted),
            admission=admission, preemptions=preemptions, alloc=alloc, freed=freed, refs=refs,
            sampled=sampled, first_tokens=firsts, finished=finished, itl=itl, kv=kv,
        )
        out.append(ev)
        self.t = t_end
        self.done_step = n
        if self.snapshot_every and n % self.snapshot_every == 0:
            out.append(self.snapshot())
        return out

    def _kv(self) -> KvCounters:
        used = sum(1 for c in self.rc if c > 0)
        shared = sum(1 for c in self.rc if c > 1)
        slots = tail = 0
        for r in self.reqs.values():
            if r.blocks:
                have = len(r.blocks) * self.bs
                c = min(r.computed, have)
                slots += c
                tail += have - c
        return KvCounters(total=self.n, used=used, free=self.n - used, cached=len(self.cached), shared=shared,
                          token_slots=slots, tail_waste=tail, reserve_waste=0)

    def snapshot(self) -> SnapshotEvent:
        live = [r for r in self.reqs.values() if r.state != FINISHED]
        reqs = [RequestState(r.req, r.state, r.prompt_len, r.max_tokens, r.computed, r.output_len, r.priority,
                             r.arrival, r.ttft, r.preemptions) for r in live]
        blocks = [BlockOwner(b, self.owner[b], self.rc[b]) for b in range(self.n)
                  if self.rc[b] > 0 or b in self.cached]
        tables = {r.req: list(r.blocks) for r in live if r.blocks}
        return SnapshotEvent(step=self.done_step, t=self.t, requests=reqs, blocks=blocks,
                             block_tables=tables, running=list(self.running), waiting=list(self.waiting),
                             preempted=list(self.preempted), swapped=[], kv=self._kv())


def synthetic_events(steps: int = 200, *, bye: bool = True, **kw) -> list:
    """hello, the opening snapshot (step 0), ``steps`` iterations, then bye."""
    eng = SyntheticEngine(**kw)
    events: list = [eng.hello(), eng.snapshot()]
    for _ in range(steps):
        events.extend(eng.step())
    if bye:
        events.append(ByeEvent(step=eng.done_step, t=eng.t, reason="drained"))
    return events
