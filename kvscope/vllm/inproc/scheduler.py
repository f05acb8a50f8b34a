"""``--scheduler vllm``: vLLM's own V1 ``Scheduler`` and ``KVCacheManager`` decide every step.

``VllmScheduler`` has the interface of kvscope's ``Scheduler`` (add, schedule, update, abort, queues,
KV counters), so the engine loop, the runner and the events do not branch on who decides. Each step
it translates vLLM's ``SchedulerOutput`` (num_scheduled_tokens, new and cached request data) into
kvscope's ``SchedulerOutput`` over vLLM's physical block ids, and feeds the sampled tokens back to
vLLM as a ``ModelRunnerOutput`` through ``update_from_output``. ``VllmBlocks`` stands where kvscope's
block manager stands: its change queue is the event builder's diff of vLLM's block pool.

kvscope keeps its own ``Request`` per vLLM request (id ``str(req_id)``): the tokens, sampling, stop
checks (EOS, stop strings) and latencies stay kvscope's; vLLM stops on max_tokens / max_model_len by
itself, and a request kvscope stops (EOS) is finished in vLLM with ``finish_requests``.
"""

from __future__ import annotations

from typing import Any

from kvscope.vllm.inproc.core import VllmSchedulerSettings, build_scheduler, make_request, runner_output, vllm_version
from kvscope.vllm.inproc.events import VllmEventBuilder
from kvscope.engine.config import EngineConfig
from kvscope.errors import KvscopeError
from kvscope.engine.kv.events import BlockAllocated, BlockFreed, BlockReleased, BlockShared
from kvscope.engine.request import Request, RequestStatus
from kvscope.engine.sched.output import ScheduledSeq, SchedulerOutput
from kvscope.protocol.events import (
    BLOCKED_KV,
    FINISH_ABORT,
    FINISH_LENGTH,
    FINISH_MAX_MODEL_LEN,
    FINISH_STOP,
    PREEMPT_RECOMPUTE,
    KvCounters,
)

__all__ = ["VllmScheduler", "VllmBlocks"]


class _EventJournal:
    """The builder's journal calls as kvscope's block-manager records (engine/kv/events.py)."""

    def __init__(self) -> None:
        self.events: list = []

    def alloc(self, block: int, req: int) -> None:
        self.events.append(BlockAllocated(block, req))

    def share(self, block: int, req: int, count: int) -> None:
        self.events.append(BlockShared(block, req, count))

    def ref(self, block: int, count: int) -> None:
        self.events.append(BlockReleased(block, count))

    def free(self, block: int) -> None:
        self.events.append(BlockFreed(block))


class VllmBlocks:
    """The block-manager face of vLLM's KV-cache manager: sizes, tables, and the drained change queue."""

    def __init__(self, builder: VllmEventBuilder, block_size: int) -> None:
        self.builder = builder
        self.block_size = block_size
        self.num_blocks = builder.pool.num_gpu_blocks
        self.capacity_tokens = (self.num_blocks - 1) * block_size  # block 0 is vLLM's null block
        self._dropped: set[int] = set()

    def drop(self, req_id: int) -> None:
        self._dropped.add(req_id)

    def take_events(self) -> list:
        j = _EventJournal()
        self.builder.diff_blocks(j, self._dropped)
        self._dropped = set()
        return j.events

    @property
    def tables(self) -> dict[int, list[int]]:
        return self.builder.block_tables()

    @property
    def ref_counts(self) -> dict[int, int]:
        return self.builder._block_state()[0]

    @property
    def cached_blocks(self) -> set[int]:
        return self.builder._block_state()[1]


class VllmScheduler:
    def __init__(self, config: EngineConfig, num_blocks: int, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self.settings = VllmSchedulerSettings(
            block_size=config.block_size, num_blocks=num_blocks, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens, max_model_len=max_model_len,
            enable_prefix_caching=config.prefix_caching, enable_chunked_prefill=True,
            long_prefill_token_threshold=config.long_prefill_token_threshold, policy=config.policy)
        self.vllm = build_scheduler(self.settings)
        self.events = VllmEventBuilder(self.vllm, req_id=int)
        self.bm = VllmBlocks(self.events, config.block_size)
        self.requests: dict[int, Request] = {}
        self.step_count = 0
        self.budget = config.max_num_batched_tokens
        self.num_recomputed_tokens = 0
        self._out: Any = None

    def hello_config(self) -> dict[str, Any]:
        """What the engine's hello adds under --scheduler vllm."""
        return {"vllm_version": vllm_version(),
                "null_block": 0}  # vLLM's block 0 holds no KV: kv.total is num_blocks - 1

    # ---- requests ----------------------------------------------------------------------
    def add(self, request: Request) -> None:
        if request.params.n > 1:
            raise KvscopeError("--scheduler vllm: n > 1 (parallel sampling) is kvscope's own; use --scheduler kvscope")
        request.arrival_step = self.step_count
        self.requests[request.req_id] = request
        self.vllm.add_request(make_request(str(request.req_id), request.prompt_token_ids, request.params.max_tokens,
                                           request.arrival, self.settings.block_size, request.priority))

    def add_forks(self, request: Request, samples: list[Request]) -> None:
        raise KvscopeError("--scheduler vllm: n > 1 (parallel sampling) is kvscope's own; use --scheduler kvscope")

    def has_unfinished(self) -> bool:
        return bool(self.requests)

    def _by_status(self, status_name: str) -> list[Request]:
        out = []
        for vr in self.events._waiting_requests():
            if vr.status.name == status_name or (status_name == "WAITING" and vr.status.name != "PREEMPTED"):
                req = self.requests.get(int(vr.request_id))
                if req is not None:
                    out.append(req)
        return out

    @property
    def running(self) -> list[Request]:
        return [self.requests[int(r.request_id)] for r in self.vllm.running if int(r.request_id) in self.requests]

    @property
    def waiting(self) -> list[Request]:
        return [self.requests[int(r.request_id)] for r in self.events._waiting_requests()
                if int(r.request_id) in self.requests]

    def queue_ids(self) -> tuple[list[int], list[int], list[int], list[int]]:
        running, waiting, preempted = self.events.queues()
        return running, waiting, preempted, []

    def kv_counters(self) -> KvCounters:
        return self.events.kv_counters()

    # ---- one step ----------------------------------------------------------------------
    def schedule(self, now: float) -> SchedulerOutput:
        self.step_count += 1
        vout = self.vllm.schedule()
        self.events.after_schedule(vout)
        self._out = vout
        out = SchedulerOutput(self.step_count, self.budget)
        tables = self.events.block_tables()
        for vid in sorted(vout.preempted_req_ids or (), key=int):
            req = self.requests[int(vid)]
            req.status = RequestStatus.PREEMPTED
            req.num_preemptions += 1
            self.num_recomputed_tokens += req.num_computed_tokens
            req.num_recomputed_tokens += req.num_computed_tokens
            req.num_computed_tokens = 0
            out.preempted.append(req.req_id)
            out.preemptions.append((req.req_id, BLOCKED_KV, PREEMPT_RECOMPUTE))
            self.bm.drop(req.req_id)
        for rid, hit in self.events.admissions(vout):
            req = self.requests[rid]
            out.admitted.append(rid)
            if req.first_scheduled is None:
                req.first_scheduled = now
                req.num_cached_tokens = hit
            if hit:
                out.hits.append((rid, hit, hit // self.settings.block_size))
        decodes = out.decodes
        for vid, n in vout.num_scheduled_tokens.items():
            req = self.requests[int(vid)]
            vreq = self.vllm.requests[vid]
            req.status = RequestStatus.RUNNING
            start = vreq.num_computed_tokens - n  # vLLM advanced it inside schedule()
            req.num_computed_tokens = start
            table = tables.get(req.req_id, [])
            tokens = req.token_ids[start:start + n]
            sample = start + n >= len(req.token_ids)
            if n == 1 and sample and start >= req.num_prompt_tokens:
                decodes.req_ids.append(req.req_id)
                decodes.positions.append(start)
                decodes.token_ids.append(tokens[0])
                decodes.block_tables.append(table)
            else:
                out.add(ScheduledSeq(req.req_id, tokens, start, table, sample, start < req.num_prompt_tokens))
        for vr in self.events._waiting_requests():
            req = self.requests.get(int(vr.request_id))
            if req is not None and req.status is RequestStatus.RUNNING:
                req.status = RequestStatus.WAITING
        out.admission = self.events.admission(vout)
        return out

    def update(self, out: SchedulerOutput, sampled: dict[int, int], now: float,
               eos_token_ids: frozenset[int]) -> list[Request]:
        """Apply the step's tokens in kvscope's requests and in vLLM's; returns the requests released."""
        vout = self._out
        finished: list[Request] = []
        stopped: list[str] = []
        tokens: dict[str, list[int]] = {}
        for vid, n in vout.num_scheduled_tokens.items():
            req = self.requests.get(int(vid))
            if req is None:  # ended during the step (an error, isolated by the engine)
                continue
            req.num_computed_tokens += n
            if req.num_computed_tokens < req.num_prompt_tokens:
                req.num_prefill_chunks += 1
            tok = sampled.get(req.req_id)
            if tok is None or req.num_computed_tokens < len(req.token_ids):
                continue
            req.append_token(tok, now)
            tokens[vid] = [tok]
            if tok in eos_token_ids and not req.params.ignore_eos:
                stopped.append(vid)
        live = [v for v in vout.num_scheduled_tokens if int(v) in self.requests]
        self.vllm.update_from_output(vout, runner_output(live, tokens))
        if stopped:
            from vllm.v1.request import RequestStatus as VllmStatus

            self.vllm.finish_requests([v for v in stopped if v in self.vllm.requests], VllmStatus.FINISHED_STOPPED)
        for vid in live:
            if vid in self.vllm.requests and not self.vllm.requests[vid].is_finished():
                continue
            req = self.requests[int(vid)]
            n_out = req.num_output_tokens
            if vid in stopped:
                reason = FINISH_STOP
            elif n_out >= req.params.max_tokens:
                reason = FINISH_LENGTH
            else:
                reason = FINISH_MAX_MODEL_LEN
            self._release(req, reason, now)
            finished.append(req)
        return finished

    def _release(self, req: Request, reason: str, now: float) -> None:
        req.finish_reason = reason
        req.status = RequestStatus.FINISHED
        req.finish_time = now
        self.bm.drop(req.req_id)
        del self.requests[req.req_id]

    def abort(self, req_id: int, now: float, reason: str = FINISH_ABORT) -> Request | None:
        req = self.requests.get(req_id)
        if req is None:
            return None
        from vllm.v1.request import RequestStatus as VllmStatus

        vid = str(req_id)
        if vid in self.vllm.requests:
            self.vllm.finish_requests([vid], VllmStatus.FINISHED_ABORTED)
        self._release(req, reason, now)
        return req
