"""Prometheus metrics computed from the event stream, with vLLM V1's names, types, labels and buckets.

An event sink like the trace writer: `publish` runs on the engine thread and only
updates prometheus_client metrics (thread-safe); `exposition()` renders them for
/metrics. It reads events only, so it works as well on a subscriber's stream.
docs/METRICS.md lists every metric and what kvscope puts in it.
"""

from __future__ import annotations

from dataclasses import dataclass

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from kvscope.protocol.events import (
    BLOCK_REASONS,
    DECODE,
    PREFILL,
    VERDICT_BLOCKED,
    HelloEvent,
    RejectEvent,
    RequestEvent,
    SnapshotEvent,
    StepEvent,
)
from kvscope.goodput import GoodputTally, RequestRecord, slo_of
from kvscope.serve.metrics_defs import GoodputMetrics, KvscopeMetrics, VllmMetrics

# vLLM's finished_reason label values (vllm.v1.engine.FINISH_REASON_STRINGS), all pre-created
VLLM_FINISH_REASONS = ("stop", "length", "abort", "error", "repetition")
MAX_TRACKED_REQUESTS = 1 << 20  # per-request timing state; beyond this, new requests are not timed


@dataclass(slots=True)
class _Timing:
    arrival: float
    prompt_len: int = 0
    max_tokens: int = 0
    scheduled: float | None = None  # start of the first step that computed it
    computed: int = 0  # prompt tokens its prefill chunks computed before its first token (the rest were shared)
    first_token: float | None = None  # end of the step that sampled its first token
    last_token: float | None = None


def step_kind(ev: StepEvent) -> str:
    """prefill, decode, mixed, or idle (nothing computed)."""
    kinds = {b.kind for b in ev.batch}
    if not kinds:
        return "idle"
    return "mixed" if len(kinds) > 1 else (PREFILL if PREFILL in kinds else DECODE)


def vllm_finish_reason(reason: str) -> str:
    return "length" if reason == "max_model_len" else reason


class PrometheusSink:
    def __init__(self, model_name: str, engine: str = "0") -> None:
        self.labels = (model_name, engine)
        self.registry = CollectorRegistry()
        self.vllm: VllmMetrics | None = None  # made at the first hello (buckets depend on max_model_len)
        self.kvscope: KvscopeMetrics | None = None
        self.goodput: GoodputMetrics | None = None  # with an SLO in the hello (kvscope serve --slo)
        self._judge: GoodputTally | None = None
        self._timing: dict[int, _Timing] = {}
        self._hits = self._queries = self._cow = 0  # the engine's cumulative counters, last seen

    def publish(self, event) -> None:
        if isinstance(event, StepEvent):
            if self.vllm is not None:
                self._step(event)
        elif isinstance(event, RequestEvent):
            if len(self._timing) < MAX_TRACKED_REQUESTS:
                self._timing[event.req] = _Timing(event.arrival, event.prompt_len, event.max_tokens)
        elif isinstance(event, HelloEvent):
            if self.vllm is None:
                max_model_len = int(event.config.max_model_len or 1)
                self.vllm = VllmMetrics(self.registry, self.labels, max_model_len, VLLM_FINISH_REASONS)
                self.kvscope = KvscopeMetrics(self.registry, self.labels, BLOCK_REASONS)
                slo = slo_of(event.config)
                if slo:
                    self._judge = GoodputTally(slo)
                    self.goodput = GoodputMetrics(self.registry, self.labels,
                                                  {k: slo.target_ms(k) / 1000.0 for k in slo.keys})
        elif isinstance(event, SnapshotEvent):
            for rs in event.requests:  # requests that arrived before this sink was attached
                if rs.req not in self._timing and len(self._timing) < MAX_TRACKED_REQUESTS:
                    self._timing[rs.req] = _Timing(rs.arrival, rs.prompt_len, rs.max_tokens)
        elif isinstance(event, RejectEvent) and self.kvscope is not None:
            self.kvscope.rejected.inc()

    def _step(self, ev: StepEvent) -> None:
        v, k = self.vllm, self.kvscope
        end = ev.t + ev.dur
        kv = ev.kv
        waiting = len(ev.waiting) + len(ev.preempted) + len(ev.swapped)
        v.running.set(len(ev.running))
        v.waiting.set(waiting)
        v.waiting_capacity.set(waiting)  # kvscope never defers a request: every waiting one waits for capacity
        usage = kv.used / kv.total if kv.total else 0.0
        v.kv_usage.set(usage)
        v.gpu_cache_usage.set(usage)
        self._hits, hits = kv.hit_tokens, max(0, kv.hit_tokens - self._hits)
        self._queries, queries = kv.query_tokens, max(0, kv.query_tokens - self._queries)
        self._cow, cow = kv.cow_copies, max(0, kv.cow_copies - self._cow)
        v.prefix_queries.inc(queries)
        v.prefix_hits.inc(hits)
        v.preemptions.inc(len(ev.preemptions))
        v.generation_tokens.inc(len(ev.sampled))
        v.iteration_tokens.observe(sum(b.tokens for b in ev.batch))
        timing = self._timing
        for b in ev.batch:
            tm = timing.get(b.req)
            if tm is not None:
                if tm.scheduled is None:
                    tm.scheduled = ev.t
                if b.kind == PREFILL and tm.first_token is None:
                    tm.computed += b.tokens
        for ft in ev.first_tokens:
            v.ttft.observe(ft.ttft)
            tm = timing.get(ft.req)
            if tm is not None:
                tm.first_token = end
                v.prompt_tokens.inc(tm.prompt_len)
                computed = min(tm.computed, tm.prompt_len)
                v.prompt_tokens_by_source["local_compute"].inc(computed)
                v.prompt_tokens_by_source["local_cache_hit"].inc(tm.prompt_len - computed)
                v.prompt_tokens_cached.inc(tm.prompt_len - computed)
        for rid in ev.sampled:
            tm = timing.get(rid)
            if tm is not None:
                tm.last_token = end
        for s in ev.itl:
            v.itl.observe(s.gap)
            v.tpot_deprecated.observe(s.gap)
        for f in ev.finished:
            self._finished(f, timing.pop(f.req, None), end)
        self._kvscope(k, ev, kv, cow)

    def _finished(self, f, tm: _Timing | None, end: float) -> None:
        v = self.vllm
        if self._judge is not None:  # the one judge the dashboard and bench use
            j = self._judge.add(RequestRecord.of_finish(f), end)
            g = self.goodput
            g.judged.inc()
            if j.good:
                g.good.inc()
                g.good_tokens.inc(f.output_len)
            for key, value, target in j.checks:
                if value <= target and not j.ended_badly:
                    g.met[key].inc()
        v.success[vllm_finish_reason(f.reason)].inc()
        v.e2e.observe(f.e2e)
        v.generation_tokens_request.observe(f.output_len)
        v.max_generation_tokens_request.observe(f.output_len)
        if tm is None:
            return
        v.prompt_tokens_request.observe(tm.prompt_len)
        v.max_tokens_param.observe(tm.max_tokens)
        v.n_param.observe(1)
        scheduled = tm.scheduled if tm.scheduled is not None else end
        v.queue_time.observe(max(0.0, scheduled - tm.arrival))
        last = tm.last_token if tm.last_token is not None else scheduled
        v.inference_time.observe(max(0.0, last - scheduled))
        if tm.first_token is not None:
            v.prefill_time.observe(max(0.0, tm.first_token - scheduled))
            decode = max(0.0, last - tm.first_token)
            v.decode_time.observe(decode)
            if f.output_len > 1:
                v.request_tpot.observe(decode / (f.output_len - 1))

    @staticmethod
    def _kvscope(k: KvscopeMetrics, ev: StepEvent, kv, cow: int) -> None:
        k.steps[step_kind(ev)].inc()
        k.step_duration.observe(ev.dur)
        if ev.admission.verdict == VERDICT_BLOCKED and ev.admission.reason in k.blocked:
            k.blocked[ev.admission.reason].inc()
        for p in ev.preemptions:
            k.preemptions.labels(*k.labels, p.reason, p.mode).inc()
        for s in ev.swaps:
            k.swapped_blocks.labels(*k.labels, s.direction).inc(s.blocks)
        k.cow_copies.inc(cow)
        k.padding_tokens.inc(ev.padding)
        k.dropped_events.inc(ev.dropped)
        k.preempted.set(len(ev.preempted))
        k.swapped.set(len(ev.swapped))
        for state, n in (("used", kv.used), ("cached", kv.cached), ("free", kv.free), ("shared", kv.shared)):
            k.kv_blocks[state].set(n)
        k.swap_used.set(kv.swap_used)
        k.swap_total.set(kv.swap_total)
        k.swap_usage.set(kv.swap_used / kv.swap_total if kv.swap_total else 0.0)

    def exposition(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST

    def close(self) -> None:
        pass

