"""Drive vLLM's own scheduler directly (no kvscope engine): a workload in, one record per step out."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.vllm.inproc.core import VllmSchedulerSettings, build_scheduler, make_request, runner_output
from kvscope.vllm.inproc.events import VllmEventBuilder


@dataclass
class DirectStep:
    scheduled: dict[str, int]
    tables: dict[str, list[int]]  # after the step's update (what the step event describes)
    preempted: list[str]
    refcounts: dict[int, int]  # block -> refcount, referenced blocks only
    cached: set[int]  # free blocks still holding a cached prefix
    event: object = None
    ids: dict[str, int] = field(default_factory=dict)  # vLLM id -> protocol id, as the builder had them


@dataclass
class Arrival:
    req_id: str
    prompt: list[int]
    max_tokens: int
    step: int = 0  # added before this step's schedule()
    priority: int = 0


def drive(settings: VllmSchedulerSettings, arrivals: list[Arrival], events: bool = False, max_steps: int = 2000,
          token=lambda rid, n: 7) -> tuple[list[DirectStep], VllmEventBuilder | None]:
    """Run vLLM's scheduler until every request finishes (sampled tokens come from `token`); with
    `events`, build each step's StepEvent with kvscope's builder as a watcher inside vLLM would."""
    s = build_scheduler(settings)
    b = VllmEventBuilder(s) if events else None
    pending = sorted(arrivals, key=lambda a: a.step)
    steps: list[DirectStep] = []
    for i in range(max_steps):
        while pending and pending[0].step <= i:
            a = pending.pop(0)
            s.add_request(make_request(a.req_id, a.prompt, a.max_tokens, float(i), settings.block_size, a.priority))
        if not s.get_num_unfinished_requests() and not pending:
            break
        out = s.schedule()
        names: dict[str, int] = {}
        if b is not None:
            b.after_schedule(out)
            names = {r: b.ids(r) for r in out.num_scheduled_tokens}  # before the update may finish them
        ids = list(out.num_scheduled_tokens)
        sampled = {}
        for rid in ids:
            req = s.requests[rid]
            if req.num_computed_tokens >= req.num_tokens:
                sampled[rid] = [token(rid, req.num_output_tokens)]
        s.update_from_output(out, runner_output(ids, sampled))
        tables = {rid: [blk.block_id for blk in blocks]
                  for rid, blocks in s.kv_cache_manager.coordinator.single_type_managers[0].req_to_blocks.items()
                  if blocks}
        pool = s.kv_cache_manager.block_pool.blocks
        refcounts = {blk.block_id: blk.ref_cnt for blk in pool if blk.ref_cnt > 0 and not blk.is_null}
        cached = {blk.block_id for blk in pool if blk.ref_cnt == 0 and blk.block_hash is not None}
        event = b.step(out, float(i), float(i) + 0.5) if b is not None else None
        if b is not None:
            names.update((r, b.ids(r)) for r in {*tables, *s.requests})
        steps.append(DirectStep(dict(out.num_scheduled_tokens), tables, sorted(out.preempted_req_ids or ()),
                                refcounts, cached, event, names))
    return steps, b
