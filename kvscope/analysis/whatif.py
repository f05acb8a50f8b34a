"""What-if: re-run a trace's own requests through the sim, with the trace's settings or one knob changed.

The requests keep what the trace says of them: arrival, prompt length, max_tokens
(or the output length a model run actually produced, for a request that stopped
early), priority, and the shared-prefix structure seen through prefix-cache hits.
Prompt contents are synthetic: the sim's cost depends on lengths only, and prefix
sharing is rebuilt by giving every request that hit the cache the same leading
tokens.

This is the one analysis module that imports the engine, and only inside
``run_sim``: the diagnosis itself reads events and nothing else.
"""

from __future__ import annotations

import time
from typing import Any, Iterable

import msgspec

from kvscope.analysis.figures import RunFigures, run_figures
from kvscope.goodput import NO_SLO, GoodputTally, RequestRecord, Slo
from kvscope.protocol.events import RequestEvent, StepEvent

# Engine settings a what-if carries over from a trace's hello config.
CARRIED = ("mode", "policy", "block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens",
           "max_model_len", "seed", "prefix_caching", "preemption", "swap_space", "gpu", "tp",
           "kv_cache_dtype", "gpu_memory_utilization", "sim_efficiency",
           "scheduler", "long_prefill_token_threshold")  # a trace of vLLM's scheduler replays through vLLM's
PREFIX_TOKEN_BASE = 17  # the shared prefix's token ids start here; unique parts never repeat it


class ReplayRequest(msgspec.Struct, frozen=True):
    req: int
    arrival: float
    prompt_len: int
    max_tokens: int
    priority: int = 0
    prefix_len: int = 0  # leading prompt tokens shared with the other requests that have a prefix


class TraceRequests:
    """Collects the requests of an event stream (arrival, lengths, priority, prefix hits, outputs)."""

    def __init__(self) -> None:
        self.requests: dict[int, RequestEvent] = {}
        self.hits: dict[int, int] = {}
        self.outputs: dict[int, tuple[int, str, float, float]] = {}  # output_len, reason, ttft, finish time
        self.preemptions: dict[int, int] = {}
        self.itl_req: list[int] = []
        self.itl_gap: list[float] = []
        self.finish_records: dict[int, tuple[RequestRecord, float]] = {}  # for goodput: record, finish time

    def add(self, ev: Any) -> None:
        if type(ev) is StepEvent:
            if ev.hits:
                for h in ev.hits:
                    self.hits.setdefault(h.req, h.tokens)
            end_t = float(ev.t + ev.dur)
            for f in ev.finished:
                r = self.requests.get(f.req)
                self.outputs[f.req] = (f.output_len, f.reason, f.ttft, (r.arrival if r else 0.0) + f.e2e)
                self.finish_records[f.req] = (RequestRecord.of_finish(f), end_t)
            for p in ev.preemptions:
                self.preemptions[p.req] = self.preemptions.get(p.req, 0) + 1
            for s in ev.itl:
                self.itl_req.append(s.req)
                self.itl_gap.append(s.gap)
        elif type(ev) is RequestEvent:
            self.requests[ev.req] = ev

    def goodput(self, slo: Slo, ids: set[int] | None = None) -> GoodputTally:
        """The finished requests (of ``ids``, default all) judged against ``slo``."""
        tally = GoodputTally(slo)
        for k, (rec, end) in self.finish_records.items():
            if ids is None or k in ids:
                tally.add(rec, end)
        return tally

    def figures(self, ids: set[int] | None = None, slo: Slo = NO_SLO) -> RunFigures:
        """The trace's own figures over the finished requests (of ``ids``, default all), as serve reports them."""
        import numpy as np

        done = [(k, v) for k, v in self.outputs.items() if ids is None or k in ids]
        reqs = [self.requests[k] for k in (self.requests if ids is None else ids) if k in self.requests]
        req_ids = np.array(self.itl_req, dtype=np.int64)
        gaps = np.array(self.itl_gap, dtype=float)
        if ids is not None and len(req_ids):
            gaps = gaps[np.isin(req_ids, np.fromiter(ids, dtype=np.int64, count=len(ids)))]
        pre = sum(v for k, v in self.preemptions.items() if ids is None or k in ids)
        return run_figures([v[2] for _, v in done], gaps, sum(v[0] for _, v in done),
                           min((r.arrival for r in reqs), default=None), max((v[3] for _, v in done), default=None),
                           pre, self.goodput(slo, ids) if slo else None)

    def replay_requests(self, first: int = 0, count: int | None = None) -> list[ReplayRequest]:
        """The requests sorted by arrival, [first, first + count) of them."""
        ordered = sorted(self.requests.values(), key=lambda r: (r.arrival, r.req))
        ordered = ordered[first:] if count is None else ordered[first:first + count]
        out = []
        for r in ordered:
            max_tokens = r.max_tokens
            done = self.outputs.get(r.req)
            if done is not None and done[1] in ("stop", "abort") and done[0] >= 1:
                max_tokens = done[0]  # stopped at EOS or aborted: the sim generates exactly that many
            out.append(ReplayRequest(r.req, r.arrival, max(1, r.prompt_len), max(1, max_tokens), r.priority,
                                     min(self.hits.get(r.req, 0), r.prompt_len - 1)))
        return _give_prefix_to_donor(out)


def _give_prefix_to_donor(reqs: list[ReplayRequest]) -> list[ReplayRequest]:
    """The first request to hit a prefix found it cached, so an earlier one computed it: give that
    donor (the latest earlier request without a hit and long enough) the longest shared prefix."""
    longest = max((r.prefix_len for r in reqs), default=0)
    if longest == 0:
        return reqs
    first_hit = next(i for i, r in enumerate(reqs) if r.prefix_len)
    for i in range(first_hit - 1, -1, -1):
        r = reqs[i]
        if r.prefix_len == 0 and r.prompt_len > longest:
            reqs[i] = msgspec.structs.replace(r, prefix_len=longest)
            break
    return reqs


def prompt_tokens(r: ReplayRequest, vocab: int) -> list[int]:
    """The shared prefix, then a part that starts with a marker and the request id, so no two
    requests share a block beyond the prefix (block hashes chain, so one differing block is enough)."""
    span = vocab - PREFIX_TOKEN_BASE - 2
    prefix = [PREFIX_TOKEN_BASE + (k * 977) % span for k in range(r.prefix_len)]
    n = r.prompt_len - r.prefix_len
    ident = [PREFIX_TOKEN_BASE - 1, PREFIX_TOKEN_BASE + r.req % span, PREFIX_TOKEN_BASE + (r.req // span) % span,
             PREFIX_TOKEN_BASE + (r.req // span // span) % span]
    rest = [PREFIX_TOKEN_BASE + (k * 131) % span for k in range(max(0, n - len(ident)))]
    return prefix + (ident + rest)[:n]


def sim_settings(config: dict, *, backend_model: str | None = None, gpu: str | None = None,
                 efficiency: dict | None = None) -> dict:
    """EngineConfig keyword arguments that reproduce a trace's settings on the sim backend."""
    settings = {k: config[k] for k in CARRIED if k in config and config[k] is not None}
    settings["model"] = backend_model or config.get("model", "tiny")
    if gpu is not None:
        settings["gpu"] = gpu
    if efficiency is not None:
        settings["sim_efficiency"] = efficiency
    settings["backend"] = "sim"
    settings.pop("sim_pace", None)
    if config.get("backend") != "sim":  # a model run's GPU settings mean nothing to the sim's sizing
        for k in ("tp", "kv_cache_dtype"):
            settings.pop(k, None)
    return settings


class SimRun(msgspec.Struct):
    figures: RunFigures
    steps: int
    wall_s: float
    num_blocks: int
    finished: int
    rejected: int


def run_sim(requests: Iterable[ReplayRequest], settings: dict, max_steps: int | None = None,
            slo: Slo = NO_SLO) -> SimRun:
    """Drive a sim engine over the requests (the serve loop's rule: submit once the clock passes the
    arrival, jump idle gaps) until all finish or max_steps; figures of the finished requests."""
    from kvscope.engine.config import EngineConfig
    from kvscope.engine.errors import RequestRejected
    from kvscope.engine.llm_engine import LLMEngine
    from kvscope.engine.sampling_params import SamplingParams
    from kvscope.engine.telemetry import finish_record

    engine = LLMEngine(EngineConfig(**settings))
    vocab = engine.loaded.vocab_size
    reqs = sorted(requests, key=lambda r: (r.arrival, r.req))
    wall = time.perf_counter()
    ttft: list[float] = []
    itl: list[float] = []
    out_tokens = 0
    last_finish = None
    rejected = 0
    finished = 0
    goodput = GoodputTally(slo)  # each finished request's finish record, as a trace would hold it
    i = 0
    while max_steps is None or engine.scheduler.step_count < max_steps:
        now = engine.now()
        while i < len(reqs) and reqs[i].arrival <= now:
            r = reqs[i]
            if not 1 <= r.prompt_len < engine.max_model_len:  # a trace's sizes are not trusted: checked before
                rejected += 1  # anything is built from them (the sim could not serve it either)
                i += 1
                continue
            params = SamplingParams(max_tokens=r.max_tokens, ignore_eos=True)
            try:
                engine.add_request(prompt_tokens(r, vocab), params, r.priority, arrival=r.arrival)
            except RequestRejected:
                rejected += 1
            i += 1
        if engine.has_unfinished():
            for req in engine.step():
                m = req.metrics()
                finished += 1
                out_tokens += m.num_output_tokens
                if m.ttft is not None:
                    ttft.append(m.ttft)
                itl.extend(m.itl)
                goodput.add(RequestRecord.of_finish(finish_record(req)), req.finish_time)
                last_finish = req.finish_time if last_finish is None else max(last_finish, req.finish_time)
        elif i < len(reqs):
            engine.clock.sleep_until(reqs[i].arrival)
        else:
            break
    wall = time.perf_counter() - wall
    first_arrival = reqs[0].arrival if reqs else 0.0
    figures = run_figures(ttft, itl, out_tokens, first_arrival, last_finish, engine.num_preemptions,
                          goodput if slo else None)
    return SimRun(figures, engine.scheduler.step_count, wall, engine.num_blocks, finished, rejected)
