"""Builds protocol events from the engine's own state. The only engine module that speaks protocol."""

from __future__ import annotations

from kvscope.engine.kv.block_manager import BlockManager
from kvscope.engine.kv.events import BlockDeltas
from kvscope.engine.request import Request, RequestStatus
from kvscope.engine.sched.scheduler import Scheduler
from kvscope.engine.sched.output import SchedulerOutput
from kvscope.protocol.blockmap import BlockMap
from kvscope.protocol.events import (
    DECODE,
    PREFILL,
    BatchEntry,
    BlockAlloc,
    BlockOwner,
    Finish,
    FirstToken,
    ItlSample,
    KvCounters,
    OutputText,
    Preemption,
    PrefixHit,
    RefChange,
    RequestEvent,
    RequestState,
    SnapshotEvent,
    StepEvent,
    Swap,
)


def request_event(req: Request, prompt_text: str | None = None) -> RequestEvent:
    event = RequestEvent(req.req_id, req.num_prompt_tokens, req.params.max_tokens, req.priority, req.arrival,
                         source=req.source)
    if prompt_text is not None:
        event.prompt_text = prompt_text
    return event


def finish_record(req: Request) -> Finish:
    m = req.metrics()
    return Finish(req.req_id, m.ttft or 0.0, m.e2e or 0.0, m.num_output_tokens, req.finish_reason or "")


def step_event(out: SchedulerOutput, sched: Scheduler, sampled_reqs: list[Request], finished: list[Request],
               deltas: BlockDeltas, kv: KvCounters, t_start: float, t_end: float, dropped: int,
               outputs: list[OutputText] | None = None) -> StepEvent:
    first_tokens: list[FirstToken] = []
    itl: list[ItlSample] = []
    for req in sampled_reqs:
        times = req.token_times
        if len(times) == 1:
            first_tokens.append(FirstToken(req.req_id, times[0] - req.arrival))
        else:
            itl.append(ItlSample(req.req_id, times[-1] - times[-2]))
    running, waiting, preempted, swapped = sched.queue_ids()  # cached between queue changes: copy
    event = StepEvent(
        step=out.step,
        t=t_start,
        dur=t_end - t_start,
        budget=out.budget,
        batch=[BatchEntry(r, DECODE, 1, p) for r, p in zip(out.decodes.req_ids, out.decodes.positions)]
        + [BatchEntry(s.req_id, PREFILL if s.is_prefill else DECODE, len(s.token_ids), s.start_pos)
           for s in out.other_seqs],
        padding=out.num_padding_tokens,
        running=list(running),
        waiting=list(waiting),
        preempted=list(preempted),
        swapped=list(swapped),
        admission=out.admission,
        preemptions=[Preemption(r, reason, mode) for r, reason, mode in out.preemptions],
        alloc=[BlockAlloc(b, r) for b, r in deltas.alloc],
        freed=list(deltas.freed),
        refs=[RefChange(b, c) for b, c in deltas.refs],
        sampled=[r.req_id for r in sampled_reqs],
        first_tokens=first_tokens,
        finished=[finish_record(r) for r in finished],
        itl=itl,
        kv=kv,
        dropped=dropped,
        hits=[PrefixHit(r, tokens, blocks) for r, tokens, blocks in out.hits],
        swaps=[Swap(r, direction, blocks) for r, direction, blocks in out.swaps],
    )
    if outputs:
        event.outputs = outputs
    return event


def request_state(req: Request) -> RequestState:
    return RequestState(
        req=req.req_id,
        state=req.status.value,
        prompt_len=req.num_prompt_tokens,
        max_tokens=req.params.max_tokens,
        computed=req.num_computed_tokens,
        output_len=req.num_output_tokens,
        priority=req.priority,
        arrival=req.arrival,
        ttft=req.ttft,
        preemptions=req.num_preemptions,
        cached_tokens=req.num_cached_tokens,
        source=req.source,
    )


def snapshot_event(sched: Scheduler, bm: BlockManager, view: BlockMap, step: int, t: float) -> SnapshotEvent:
    """`view`: the block map rebuilt from the deltas sent so far (kv_events.BlockDeltaFold.view)."""
    blocks: dict[int, BlockOwner] = {}
    owner = view.owner  # who a watcher's block map shows as owner (the claimer), -1 if none
    tables = bm.tables
    for req_id, table in tables.items():
        for block in table:
            if block not in blocks:
                o = owner[block]
                blocks[block] = BlockOwner(block, o if o >= 0 else req_id, bm.ref_counts[block])
    for block in bm.cached_blocks:  # cached: free, refcount 0, still holding a prefix
        blocks[block] = BlockOwner(block, owner[block], 0)
    waiting = [r for r in sched.waiting if r.status is RequestStatus.WAITING]
    preempted = [r for r in sched.waiting if r.status is RequestStatus.PREEMPTED]
    swapped = [r for r in sched.waiting if r.status is RequestStatus.SWAPPED]
    return SnapshotEvent(
        step=step,
        t=t,
        requests=[request_state(r) for r in sched.running + list(sched.waiting)],
        blocks=sorted(blocks.values(), key=lambda b: b.block),
        block_tables=tables,
        running=[r.req_id for r in sched.running],
        waiting=[r.req_id for r in waiting],
        preempted=[r.req_id for r in preempted],
        swapped=[r.req_id for r in swapped],
        kv=sched.kv_counters(),
    )
