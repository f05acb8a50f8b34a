"""Iteration-level scheduler: decides, once per step, which tokens of which requests run.

Pure logic over requests and the block manager (no torch). The four modes are
settings of this one scheduler:

- naive:      continuous with one sequence at a time.
- static:     a batch forms only when the previous one is done; prompts are padded
              to the longest, finished rows keep their slot (and compute) until the
              longest row ends, and KV for prompt + max_tokens is reserved up front.
- continuous: admit/release every step; a waiting prompt is prefilled whole, and
              such a prefill step runs before any decode (prefill first).
- chunked:    decodes first, then prefill chunks, all within max_num_batched_tokens.

Policies (kvscope.engine.sched.policies) order WAITING and pick preemption victims:
admission is head-of-line in the policy's order. When blocks run out, the policy's
victim (FCFS: the newest running request) is preempted by recompute, or with
``preemption="swap"`` its computed KV is copied to a CPU pool (state SWAPPED) and
copied back when it reaches the head of WAITING again. Each step serves, within
the token budget: running decodes, running prefill chunks, then WAITING in policy
order, where the head is either swapped in or admitted (with prefix caching, a new
request starts after its cached prefix).

Parallel sampling (``SamplingParams.n``, ``add_forks``): one sample computes the prompt while the
others wait outside WAITING; then each of them shares its blocks and computes only the last prompt
token, into a copy of the block holding it. The prompt is computed once however a sample ends: one
that ends while others have not taken the blocks holds them until they have (held blocks are freed
before a running request that needs blocks preempts anyone); one that ends before its prompt is
computed hands its place and KV to the next sample; one preempted by recompute shares them again.
"""

from __future__ import annotations

from collections import deque

from kvscope.engine.kv.block_manager import BlockManager, blocks_needed
from kvscope.engine.config import PREEMPT_RECOMPUTE, PREEMPT_SWAP, EngineConfig, Mode
from kvscope.errors import KvscopeError
from kvscope.engine.sched.policies import Policy, load_policy
from kvscope.engine.request import Request, RequestStatus
from kvscope.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvscope.engine.kv.swap import CpuBlockPool
from kvscope.protocol.events import (
    BLOCKED_BUDGET,
    BLOCKED_KV,
    BLOCKED_SEQS,
    BLOCKED_STATIC,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MAX_MODEL_LEN,
    FINISH_STOP,
    VERDICT_ADMITTED,
    VERDICT_BLOCKED,
    VERDICT_IDLE,
    Admission,
    KvCounters,
)


class Scheduler:
    def __init__(self, config: EngineConfig, block_manager: BlockManager, max_model_len: int,
                 num_cpu_blocks: int = 0) -> None:
        self.config = config
        self.mode = Mode(config.mode)
        self.bm = block_manager
        self.max_model_len = max_model_len
        self.max_num_seqs = config.effective_max_num_seqs
        self.budget = config.max_num_batched_tokens
        self.policy = load_policy(config.policy)
        self._reorders = type(self.policy).order is not Policy.order
        # preempted requests sit at the front (FCFS), swapped ones too (status SWAPPED)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: newest last
        self.requests: dict[int, Request] = {}
        self.step_count = 0
        self._finished_since_last: list[int] = []
        # Parallel sampling, by family (the first sample's id, which the others have as fork_of): the ids
        # of all n; the samples waiting (outside WAITING) while one of them (the first, or the heir of a
        # first that ended before its prompt was computed) computes the prompt; the samples in WAITING that
        # have not taken the prompt's blocks (never admitted, or preempted by recompute); and a sample that
        # ended while some had not (max_tokens 1, EOS, a stop id or string on its first token, an abort),
        # holding its prompt blocks until every sample has them.
        self._families: dict[int, list[int]] = {}
        self._forks: dict[int, list[Request]] = {}
        self._unforked: dict[int, set[int]] = {}
        self._lingering: dict[int, Request] = {}
        self._fresh: set[int] = set()  # admitted this step: a copy-on-write copy into its blocks may be pending
        self.swap_pool = CpuBlockPool(num_cpu_blocks) if config.preemption == PREEMPT_SWAP else None
        self.num_recomputed_tokens = 0  # computed tokens thrown away by recompute preemptions
        # Queue membership as id lists for the step event, rebuilt only when a queue changed
        # (bumped on every change here; the length and ends also key it, as a safety net).
        self._queues_version = 0
        self._queue_ids_key: tuple | None = None
        self._queue_ids: tuple[list[int], list[int], list[int], list[int]] = ([], [], [], [])

    # ---- queue management ----------------------------------------------------
    def add(self, request: Request) -> None:
        self.requests[request.req_id] = request
        request.arrival_step = self.step_count + 1  # the first step that can serve it
        self.policy.on_arrival(request, request.arrival_step)
        self.waiting.append(request)
        self._queues_version += 1

    def add_forks(self, request: Request, samples: list[Request]) -> None:
        """request's other samples (SamplingParams.n): they join WAITING once request has computed its
        prompt, and then share its prompt blocks (the block holding the last prompt token is copied)."""
        for sample in samples:
            self.requests[sample.req_id] = sample
            sample.arrival_step = request.arrival_step
            self.policy.on_arrival(sample, sample.arrival_step)
        request.seq_ids = [request.req_id] + [s.req_id for s in samples]
        self._families[request.req_id] = request.seq_ids
        self._forks[request.req_id] = samples

    @staticmethod
    def _family_of(req: Request) -> int:
        return req.req_id if req.fork_of is None else req.fork_of

    def _queue_forks(self, family: int) -> None:
        """The family's prompt is computed: its waiting samples go to the front of WAITING, each to take
        the prompt's blocks when admitted."""
        samples = self._forks.pop(family, ())
        if not samples:
            return
        self._unforked.setdefault(family, set()).update(s.req_id for s in samples)
        for sample in reversed(samples):
            self.waiting.appendleft(sample)
        self._queues_version += 1

    def _fork_settled(self, sample: Request) -> None:
        """sample left WAITING (admitted, or aborted): a held prompt goes once no other sample needs it."""
        family = self._family_of(sample)
        pending = self._unforked.get(family)
        if pending is None:
            return
        pending.discard(sample.req_id)
        if not pending:
            del self._unforked[family]
            held = self._lingering.pop(family, None)
            if held is not None:
                self.bm.free(held)
                self._tidy_family(family)

    def _drop_lingering(self) -> None:
        """Free every ended sample's held prompt (the samples that had not taken it compute it themselves)."""
        for family, held in list(self._lingering.items()):
            self._unforked.pop(family, None)
            self.bm.free(held)
            del self._lingering[family]
            self._tidy_family(family)

    def _tidy_family(self, family: int) -> None:
        """Forget a family none of whose samples is live or holds blocks any more."""
        ids = self._families.get(family)
        if ids is not None and family not in self._lingering and not any(i in self.requests for i in ids):
            del self._families[family]

    def _prompt_blocks(self, holder: Request, head: Request) -> list[int | None]:
        """The blocks of holder's table that hold head's prompt but its last token (None before a sliding
        window), if holder holds them all with their KV written; else []."""
        computed = head.num_prompt_tokens - 1
        if computed <= 0 or holder.num_computed_tokens < computed or holder.req_id not in self.bm.holders:
            return []
        null, skip = self.bm.null_block, self.bm.outside_window(computed)
        hits = [None if b == null else b for b in holder.block_table[: blocks_needed(computed, self.bm.block_size)]]
        return hits if None not in hits[skip:] else []

    def _end_sample(self, req: Request) -> None:
        """req, a sample of n, ends: if a sample that has not taken the prompt's blocks needs them and no ended
        sample holds them yet, req keeps its prompt blocks (its own tokens' go), else its blocks are freed."""
        family = self._family_of(req)
        if (self._unforked.get(family) and family not in self._lingering
                and any(b is not None for b in self._prompt_blocks(req, req))):
            self.bm.trim(req, req.num_prompt_tokens - 1)  # its own tokens' blocks go now
            self._lingering[family] = req
        else:
            self.bm.free(req)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    @property
    def preempted(self) -> list[Request]:
        return [r for r in self.waiting if r.status is RequestStatus.PREEMPTED]

    @property
    def swapped(self) -> list[Request]:
        return [r for r in self.waiting if r.status is RequestStatus.SWAPPED]

    def queue_ids(self) -> tuple[list[int], list[int], list[int], list[int]]:
        """(running, waiting, preempted, swapped) request ids, in queue order; do not mutate them."""
        running, waiting = self.running, self.waiting
        key = (self._queues_version, len(running), len(waiting),
               running[-1].req_id if running else None, waiting[0].req_id if waiting else None,
               waiting[-1].req_id if waiting else None)
        if key != self._queue_ids_key:
            fresh = RequestStatus.WAITING
            waiting_ids = [r.req_id for r in waiting if r.status is fresh]
            if len(waiting_ids) == len(waiting):  # nothing preempted or swapped: the common case
                preempted_ids, swapped_ids = [], []
            else:
                preempted_ids = [r.req_id for r in waiting if r.status is RequestStatus.PREEMPTED]
                swapped_ids = [r.req_id for r in waiting if r.status is RequestStatus.SWAPPED]
            self._queue_ids = ([r.req_id for r in running], waiting_ids, preempted_ids, swapped_ids)
            self._queue_ids_key = key
        return self._queue_ids

    def kv_counters(self) -> KvCounters:
        kv = self.bm.counters()
        if self.swap_pool is not None:
            kv.swap_total = self.swap_pool.num_blocks
            kv.swap_used = self.swap_pool.num_used
        return kv

    def _reorder(self) -> None:
        """Put WAITING in the policy's order (FCFS: untouched)."""
        if not self._reorders or len(self.waiting) < 2:
            return
        ordered = self.policy.order(list(self.waiting), self.step_count)
        if len(ordered) != len(self.waiting) or {r.req_id for r in ordered} != {r.req_id for r in self.waiting}:
            raise KvscopeError(f"policy {self.config.policy!r}: order() must return the same requests it was given")
        self.waiting = deque(ordered)
        self._queues_version += 1

    def _pick(self, chosen: Request | None, what: str) -> Request | None:
        if chosen is not None and chosen not in self.running:
            raise KvscopeError(f"policy {self.config.policy!r}: {what}() must return a running request")
        return chosen

    def _preempt(self, victim: Request, out: SchedulerOutput, reason: str = BLOCKED_KV) -> None:
        self.running.remove(victim)
        mode = PREEMPT_RECOMPUTE
        pool = self.swap_pool
        kept = self.bm.computed_blocks(victim)
        keep = len(kept)
        # A request admitted this step may still wait on a copy-on-write copy: recompute it.
        if pool is not None and keep and pool.can_hold(keep) and victim.req_id not in out.admitted:
            mode = PREEMPT_SWAP
            out.blocks_to_swap_out.extend(pool.swap_out(victim.req_id, kept))
            out.swaps.append((victim.req_id, "out", keep))
        self.bm.free(victim)
        if mode == PREEMPT_SWAP:
            victim.status = RequestStatus.SWAPPED
        else:
            victim.status = RequestStatus.PREEMPTED
            victim.num_recomputed_tokens += victim.num_computed_tokens
            self.num_recomputed_tokens += victim.num_computed_tokens
            victim.num_computed_tokens = 0  # recompute: prompt and outputs are prefilled again
            family = self._family_of(victim)
            if family in self._families and family not in self._forks:
                # a sample of n: it takes the prompt's blocks again from a sample holding them, and one that
                # ends meanwhile holds them for it
                self._unforked.setdefault(family, set()).add(victim.req_id)
        victim.num_preemptions += 1
        self.waiting.appendleft(victim)
        self._queues_version += 1
        self._reorder()
        out.preempted.append(victim.req_id)
        out.preemptions.append((victim.req_id, reason, mode))
        out.drop(victim.req_id)

    def _admit(self, request: Request, now: float) -> None:
        self.waiting.popleft()
        self._queues_version += 1
        self._fresh.add(request.req_id)
        request.status = RequestStatus.RUNNING
        if request.first_scheduled is None:
            request.first_scheduled = now
        self.running.append(request)

    def _schedule_tokens(self, out: SchedulerOutput, req: Request, n: int) -> None:
        start = req.num_computed_tokens
        out.add(
            ScheduledSeq(
                req_id=req.req_id,
                token_ids=req.token_ids[start : start + n],
                start_pos=start,
                block_table=list(req.block_table),
                sample=start + n == req.num_tokens,
                is_prefill=not req.is_decode,
            )
        )

    # ---- the step ----------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.step_count += 1
        out = SchedulerOutput(step=self.step_count, budget=self.budget, finished_req_ids=self._finished_since_last)
        # tables only grow, or are replaced after a free; a sliding window nulls entries in place
        out.tables_grow_in_place = self.bm.sliding_window is None
        self._finished_since_last = []
        self._fresh.clear()
        self._reorder()
        if self.mode is Mode.STATIC:
            self._schedule_static(out, now)
        elif self.mode is Mode.CHUNKED:
            self._schedule_chunked(out, now)
        else:
            self._schedule_prefill_first(out, now)
        out.blocks_to_copy = self.bm.pop_copies()
        return out

    def _grow_or_preempt(self, req: Request, total_tokens: int, out: SchedulerOutput) -> bool:
        """Find blocks for req by preempting the newest running requests; False if req itself was the victim."""
        while not self.bm.grow(req, total_tokens):
            if self._lingering:  # held prompts of ended samples go before a running request loses its KV
                self._drop_lingering()
                continue
            victim = self._pick(self.policy.victim(list(self.running), req), "victim")
            self._preempt(victim, out)
            if victim is req:
                return False
        return True

    def _verdict_for_head(self, out: SchedulerOutput, budget_left: int) -> Admission:
        """Why the head of WAITING cannot be admitted now (called when admission stopped)."""
        if not self.waiting:
            return Admission(VERDICT_IDLE)
        head = self.waiting[0]
        if len(self.running) >= self.max_num_seqs:
            reason = BLOCKED_SEQS
        elif budget_left <= 0 or (self.mode is not Mode.CHUNKED and out.num_seqs and head.num_remaining > budget_left):
            reason = BLOCKED_BUDGET
        else:
            reason = BLOCKED_KV
        return Admission(VERDICT_BLOCKED, reason, head.req_id)

    def _preempt_for(self, head: Request, out: SchedulerOutput) -> bool:
        """Let the blocked head of WAITING preempt a running request if the policy allows it."""
        if not self.running:
            return False
        victim = self._pick(self.policy.arrival_victim(head, list(self.running)), "arrival_victim")
        if victim is None:
            return False
        self._preempt(victim, out, reason="priority")
        return True

    def _fork_hits(self, head: Request) -> list[int | None]:
        """The blocks holding head's prompt but its last token, from a sample of its family that holds
        them (the held prompt of one that ended, else a running one's): what head shares by refcount.
        One admitted this step is passed over: the copy-on-write copy into its last block is not made yet."""
        family = self._family_of(head)
        ids = self._families.get(family)
        if ids is None:
            return []
        for holder in (self._lingering.get(family), *(self.requests.get(i) for i in ids)):
            if (holder is None or holder is head or holder.req_id in self._fresh
                    or (holder.status is not RequestStatus.RUNNING and holder is not self._lingering.get(family))):
                continue
            hits = self._prompt_blocks(holder, head)
            if hits:
                return hits
        return []

    def _cached_prefix(self, head: Request) -> tuple[list[int | None], int]:
        """(hit blocks, tokens already computed) for the head of WAITING."""
        if head.status is RequestStatus.SWAPPED:
            return [], head.num_computed_tokens
        fork_hits = self._fork_hits(head) if head.num_computed_tokens == 0 and self._families else []
        # a sample that has not sampled yet can get no more from the cache than its prompt but the last token
        if fork_hits and (not self.bm.enable_caching or head.num_output_tokens == 0):
            return fork_hits, head.num_prompt_tokens - 1
        if not self.bm.enable_caching:
            return [], head.num_computed_tokens
        hits = self.bm.match_prefix(head.token_ids)
        # Always compute at least the last token: its logits give the next sample.
        computed = min(len(hits) * self.bm.block_size, head.num_tokens - 1)
        if fork_hits and computed < head.num_prompt_tokens - 1:  # a preempted sample: the larger of the two
            return fork_hits, head.num_prompt_tokens - 1
        return hits[: blocks_needed(computed, self.bm.block_size)], computed

    def _admit_waiting(self, out: SchedulerOutput, now: float, budget_left: int, whole_prompts: bool) -> int:
        """Swap in or admit from the head of WAITING, in order, while seqs, budget and blocks allow."""
        admitted_any = False
        while self.waiting and budget_left > 0:
            head = self.waiting[0]
            if len(self.running) >= self.max_num_seqs:
                if self._preempt_for(head, out):
                    budget_left = self.budget - out.num_tokens
                    continue
                break
            hits, computed = self._cached_prefix(head)
            left = head.num_tokens - computed
            if whole_prompts:
                n = left
                # A prompt larger than the budget still runs when it is alone in the step.
                if out.num_seqs and n > budget_left:
                    break
            else:
                n = min(left, budget_left)
            swapped = head.status is RequestStatus.SWAPPED
            if swapped or not (self.bm.enable_caching or hits):
                ok = self.bm.grow(head, computed + n)  # computed: head.num_computed_tokens
            else:
                ok = self.bm.admit(head, hits, computed, computed + n)  # head now has `computed` computed
            if not ok:
                if self._preempt_for(head, out):
                    budget_left = self.budget - out.num_tokens
                    continue
                if not self.running and self._lingering:  # nothing left to free but held prompts: recompute
                    self._drop_lingering()
                    continue
                break
            if swapped:
                self._swap_in(head, out)
            elif self.bm.enable_caching:
                self.bm.record_lookup(head.num_tokens, computed)
                if head.first_scheduled is None:
                    head.num_cached_tokens = computed
                if computed:
                    # blocks shared or revived: none before the window of a sliding-window model
                    out.hits.append((head.req_id, computed, len(hits) - self.bm.outside_window(computed)))
            self._admit(head, now)
            if self._unforked:
                self._fork_settled(head)
            self._schedule_tokens(out, head, n)
            budget_left -= n
            admitted_any = True
            out.admitted.append(head.req_id)
        out.admission = self._verdict_for_head(out, budget_left) if self.waiting else Admission(VERDICT_IDLE)
        if admitted_any and out.admission.verdict == VERDICT_IDLE:
            out.admission = Admission(VERDICT_ADMITTED, None, out.admitted[-1])
        return budget_left

    def _swap_in(self, req: Request, out: SchedulerOutput) -> None:
        """req has fresh GPU blocks: copy its KV back from the CPU pool into the first of them."""
        pool = self.swap_pool
        held = self.bm.held(req)  # with a sliding window, from the window on
        k = len(pool.tables[req.req_id])
        out.blocks_to_swap_in.extend(pool.swap_in(req.req_id, held[:k]))
        out.swaps.append((req.req_id, "in", k))
        self.bm.commit(req, req.num_computed_tokens)  # its KV is back: register its full blocks

    def _schedule_prefill_first(self, out: SchedulerOutput, now: float) -> None:
        self._admit_waiting(out, now, self.budget, whole_prompts=True)
        if out.num_seqs:
            return  # a prefill step: running requests wait one iteration
        # Every running request runs what it has left, in order: the leading decodes (usually all
        # of them) on the fast path, then the rest one by one, keeping the order.
        running = list(self.running)
        lead = 0
        while lead < len(running) and running[lead].is_decode:
            lead += 1
        self._schedule_decodes(out, running[:lead], budget_left=lead + 1)
        for req in running[lead:]:
            if req.status is not RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            if self._grow_or_preempt(req, req.num_computed_tokens + req.num_remaining, out):
                self._schedule_tokens(out, req, req.num_remaining)

    def _schedule_chunked(self, out: SchedulerOutput, now: float) -> None:
        # Decodes first, then the running prefills, then new admissions. A request's kind cannot
        # change while the decodes are placed (only a preempted one changes, and it is skipped),
        # so one pass sorts them.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for req in self.running:  # req.is_decode, inline (the hottest loop of a step)
            n = len(req.token_ids)
            if n - req.num_computed_tokens == 1 and n > len(req.prompt_token_ids):
                decodes.append(req)
            else:
                prefills.append(req)
        self._schedule_decodes(out, decodes, self.budget)
        budget_left = self.budget - out.num_tokens  # preemptions may have returned budget
        for req in prefills:
            if budget_left <= 0:
                break
            if req.status is not RequestStatus.RUNNING:
                continue
            n = min(req.num_remaining, budget_left)
            if self._grow_or_preempt(req, req.num_computed_tokens + n, out):
                self._schedule_tokens(out, req, n)
                budget_left -= n
        budget_left = self.budget - out.num_tokens
        self._admit_waiting(out, now, budget_left, whole_prompts=False)

    def _schedule_decodes(self, out: SchedulerOutput, decodes: list[Request], budget_left: int) -> int:
        """One token for each decoding request, in order, within the budget. The fast path: the block
        manager is asked only by a request whose next token starts a new block."""
        bs = self.bm.block_size
        running = RequestStatus.RUNNING
        d = out.decodes  # a preemption below drops from these same lists
        ids, positions, token_ids, block_tables = d.req_ids, d.positions, d.token_ids, d.block_tables
        take = decodes if len(decodes) <= budget_left else decodes[:max(0, budget_left)]
        starting = [req for req in take if req.num_computed_tokens >= len(req.block_table) * bs]
        if len(starting) <= self.bm.pool.num_free:
            # Every block they need is free: nobody is preempted, so the columns are built whole,
            # the blocks taken in the same order as the loop below would take them.
            for req in starting:
                self.bm.grow(req, req.num_computed_tokens + 1)
            starts = [req.num_computed_tokens for req in take]
            ids += [req.req_id for req in take]
            positions += starts
            token_ids += [req.token_ids[start] for req, start in zip(take, starts)]
            block_tables += [req.block_table for req in take]
            return budget_left - len(take)
        for req in decodes:
            if budget_left <= 0:
                break
            if req.status is not running:
                continue  # preempted earlier in this loop
            start = req.num_computed_tokens
            table = req.block_table
            if start >= len(table) * bs:
                if not self._grow_or_preempt(req, start + 1, out):
                    continue
            ids.append(req.req_id)
            positions.append(start)
            token_ids.append(req.token_ids[start])
            block_tables.append(table)
            budget_left -= 1
        return budget_left

    def _schedule_static(self, out: SchedulerOutput, now: float) -> None:
        if not self.running:
            self._form_static_batch(out, now)
            return
        if self.waiting:
            out.admission = Admission(VERDICT_BLOCKED, BLOCKED_STATIC, self.waiting[0].req_id)
        for req in self.running:
            if req.done_generating:
                out.pad_rows.append(1)  # the finished row still costs one token of compute
            else:
                self._schedule_tokens(out, req, req.num_remaining)

    def _form_static_batch(self, out: SchedulerOutput, now: float) -> None:
        while self.waiting and len(self.running) < self.max_num_seqs:
            head = self.waiting[0]
            reserve = min(head.num_prompt_tokens + head.params.max_tokens, self.max_model_len)
            hits = self._fork_hits(head) if self._families and head.num_computed_tokens == 0 else []
            if hits:  # a sample of n: it shares the prompt's blocks but the one holding the last token
                ok = self.bm.admit(head, hits, head.num_prompt_tokens - 1, reserve)
            else:
                ok = blocks_needed(reserve, self.bm.block_size) <= self.bm.num_free and self.bm.grow(head, reserve)
            if not ok:
                if not self.running and self._lingering:  # nothing left to free but held prompts: recompute
                    self._drop_lingering()
                    continue
                break
            self._admit(head, now)
            if self._unforked:
                self._fork_settled(head)
            out.admitted.append(head.req_id)
        if self.waiting:
            out.admission = self._verdict_for_head(out, self.budget)
        elif out.admitted:
            out.admission = Admission(VERDICT_ADMITTED, None, out.admitted[-1])
        longest = max((r.num_remaining for r in self.running), default=0)
        for req in self.running:
            self._schedule_tokens(out, req, req.num_remaining)
            if longest > req.num_remaining:
                out.pad_rows.append(longest - req.num_remaining)

    # ---- after the forward -----------------------------------------------------------
    def update(
        self, out: SchedulerOutput, sampled: dict[int, int], now: float, eos_token_ids: frozenset[int]
    ) -> list[Request]:
        """Apply a step's results; returns requests that finished (and were released) this step."""
        finished: list[Request] = []
        requests = self.requests
        # Decodes first, as they ran: the fast path (one token each, always sampled).
        sampled_reqs = [requests[r] for r in out.decodes.req_ids]
        self.bm.commit_decodes(sampled_reqs)
        for req, token in zip(sampled_reqs, [sampled[r] for r in out.decodes.req_ids]):
            req.token_ids.append(token)  # req.append_token, inline
            req.token_times.append(now)
        commit = self.bm.commit
        for seq in out.other_seqs:
            req = requests[seq.req_id]
            commit(req, req.num_computed_tokens + len(seq.token_ids))
            if seq.is_prefill:
                req.num_prefill_chunks += 1
            if seq.sample:
                req.append_token(sampled[seq.req_id], now)
                sampled_reqs.append(req)
        if self._forks:  # the sample computing a prompt of n computed it: the others can fork now
            for req in sampled_reqs:
                if req.num_output_tokens == 1 and self._family_of(req) in self._forks:
                    self._queue_forks(self._family_of(req))
        self._stop_finished(sampled_reqs, now, eos_token_ids, finished)
        if self.mode is Mode.STATIC and self.running and all(r.done_generating for r in self.running):
            for req in list(self.running):
                self._release(req, now)
                finished.append(req)
        return finished

    def _stop_finished(self, sampled: list[Request], now: float, eos_token_ids: frozenset[int],
                       finished: list[Request]) -> None:
        """The one stop check: each request that just sampled a token, in order, ends if that token
        is an EOS it does not ignore, or it reached max_tokens or max_model_len."""
        max_len = self.max_model_len
        for req in sampled:
            tokens = req.token_ids
            params = req.params
            n = len(tokens)
            if tokens[-1] in eos_token_ids and not params.ignore_eos:
                reason = FINISH_STOP
            elif n - len(req.prompt_token_ids) >= params.max_tokens:
                reason = FINISH_LENGTH
            elif n >= max_len:
                reason = FINISH_MAX_MODEL_LEN
            else:
                continue
            self._finish(req, reason, now, finished)

    def _finish(self, req: Request, reason: str, now: float, finished: list[Request]) -> None:
        req.finish_reason = reason
        if self.mode is Mode.STATIC:
            req.done_generating = True  # the row keeps its slot until the batch ends
        else:
            self._release(req, now)
            finished.append(req)

    # ---- abort ------------------------------------------------------------------------
    def abort(self, req_id: int, now: float, reason: str = FINISH_ABORT) -> Request | None:
        """End a live request between steps (its client left, or a stop id or string ended it): it leaves
        its queue, its blocks are freed (or stay cached with prefix caching), swapped KV is dropped. A
        sample of n still computing the prompt hands its place and KV to the next sample; one that has
        computed it may hold its prompt blocks for the samples that have not taken them. None if it is
        not live."""
        req = self.requests.get(req_id)
        if req is None:
            return None
        family = self._family_of(req)
        pending = self._forks.get(family) if family in self._families else None
        held = False  # its blocks may stay held for samples that have not taken them
        if pending and req in pending:  # a sample still waiting for its prompt's KV
            pending.remove(req)
            if not pending:
                del self._forks[family]
        elif pending:  # the sample computing the prompt: the first waiting sample takes its place and its KV
            self._hand_over(req, pending.pop(0))
            if not pending:
                del self._forks[family]
        elif req.status is RequestStatus.RUNNING:
            self.running.remove(req)
            held = family in self._families
        else:
            self.waiting.remove(req)
            if req.status is RequestStatus.SWAPPED:
                self.swap_pool.drop(req_id)
        self._queues_version += 1
        if self._unforked:
            self._fork_settled(req)
        req.finish_reason = reason
        if held:
            self._end_sample(req)
        else:
            self.bm.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_time = now
        self._finished_since_last.append(req.req_id)
        del self.requests[req.req_id]
        if self._families:
            self._tidy_family(family)
        return req

    def _hand_over(self, source: Request, heir: Request) -> None:
        """source, the sample computing its family's prompt, ends before it has: heir, a sample waiting for
        that prompt, takes its place in its queue with the KV it has computed (blocks by refcount, or its
        swapped-out copy), and computes the rest of the prompt for the others."""
        if source.status is RequestStatus.RUNNING:
            self.running[self.running.index(source)] = heir
            self.bm.adopt(heir, source)
            heir.first_scheduled = source.first_scheduled
            heir.num_prefill_chunks = source.num_prefill_chunks
        else:
            self.waiting[self.waiting.index(source)] = heir
            if source.status is RequestStatus.SWAPPED:
                self.swap_pool.tables[heir.req_id] = self.swap_pool.tables.pop(source.req_id)
                heir.num_computed_tokens = source.num_computed_tokens
        kept = (RequestStatus.RUNNING, RequestStatus.SWAPPED)
        heir.status = source.status if source.status in kept else RequestStatus.WAITING
        heir.num_cached_tokens = source.num_cached_tokens

    def _release(self, req: Request, now: float) -> None:
        self.running.remove(req)
        self._queues_version += 1
        if self._families:
            self._end_sample(req)  # freed, or held for the samples that have not taken its prompt blocks
        else:
            self.bm.free(req)
        req.status = RequestStatus.FINISHED
        req.finish_time = now
        self._finished_since_last.append(req.req_id)
        del self.requests[req.req_id]
        if self._families:
            self._tidy_family(self._family_of(req))
