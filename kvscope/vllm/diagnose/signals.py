"""What a watched vLLM's /metrics and KV events say, turned into the Signals the verdict rules read.

vLLM exposes counts, rates and histograms, not per-request queues, so each signal the
rules read (kvscope.analysis.signals.Signals) is rebuilt from the series that carry it,
over the intervals between consecutive scrapes:

- an interval is *busy* when vLLM ran an iteration in it (`vllm:iteration_tokens_total`
  count grew) or had requests running;
- the head of WAITING was blocked *on KV* in an interval when requests waited for capacity
  (`vllm:num_requests_waiting_by_reason{reason="capacity"}`, else `num_requests_waiting`)
  while `vllm:kv_cache_usage_perc` was >= 90% or `vllm:num_preemptions` grew; *on
  max_num_seqs* when they waited with `num_requests_running` at max_num_seqs and the pool
  not full; *on the token budget* when they waited with the iteration's mean tokens
  (`iteration_tokens_total` sum / count) >= 90% of max_num_batched_tokens;
- step time = interval / iterations in it; latency percentiles come from the histograms'
  bucket counts added over the recording (estimates, as Prometheus' histogram_quantile).

What vLLM does not expose (max_num_seqs, max_num_batched_tokens, the policy, chunked
prefill) is taken from flags, else inferred, else assumed at vLLM's default, and every
setting says which (``Setting.source``). Each Evidence names the series it came from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import msgspec
import numpy as np

from kvscope.vllm.watch.metrics import Scrape, info_labels, quantile
from kvscope.analysis import verdicts as V
from kvscope.analysis.signals import Signals, _fixed_share
from kvscope.analysis.verdicts import Evidence

KV_FULL = V.KV_FULL
PINNED = 0.9  # an interval's mean iteration tokens at >= 90% of the budget: the budget is what caps it
DEFAULT_POLICY = "fcfs"  # vLLM's default --scheduling-policy
# vLLM's --scheduling-policy values (vllm/config/scheduler.py SchedulerPolicy). A value in vLLM's vocabulary is
# checked against vLLM's names and never read as kvscope's own `--policy module:Class`.
VLLM_SCHEDULING_POLICIES = ("fcfs", "priority")


def vllm_scheduling_policy(value: str) -> str:
    """A vLLM --scheduling-policy value, or a one-line KvscopeError naming vLLM's choices."""
    if value not in VLLM_SCHEDULING_POLICIES:
        from kvscope.errors import KvscopeError

        raise KvscopeError(f"vLLM's --scheduling-policy is one of {', '.join(VLLM_SCHEDULING_POLICIES)} "
                         f"(got {value[:60]!r})")
    return value
S_RUNNING, S_WAITING, S_BY_REASON = "vllm:num_requests_running", "vllm:num_requests_waiting", \
    "vllm:num_requests_waiting_by_reason"
S_KV, S_PREEMPT, S_ITER = "vllm:kv_cache_usage_perc", "vllm:num_preemptions", "vllm:iteration_tokens_total"
S_TTFT, S_ITL, S_QUEUE = "vllm:time_to_first_token_seconds", "vllm:inter_token_latency_seconds", \
    "vllm:request_queue_time_seconds"
S_PREFILL, S_DECODE = "vllm:request_prefill_time_seconds", "vllm:request_decode_time_seconds"
S_PROMPT, S_GEN = "vllm:prompt_tokens", "vllm:generation_tokens"
S_PROMPT_LEN, S_GEN_LEN = "vllm:request_prompt_tokens", "vllm:request_generation_tokens"
S_SUCCESS, S_CACHE_INFO = "vllm:request_success", "vllm:cache_config_info"
S_REQ_PREEMPT = "vllm:request_num_preemptions"
S_HITS, S_QUERIES = "vllm:prefix_cache_hits", "vllm:prefix_cache_queries"


@dataclass
class VllmFlags:
    """vLLM settings the metrics do not carry, as given on the command line (None: not given)."""

    max_num_seqs: int | None = None
    max_num_batched_tokens: int | None = None
    gpu_memory_utilization: float | None = None
    enable_chunked_prefill: bool | None = None
    enable_prefix_caching: bool | None = None
    kv_cache_dtype: str | None = None
    tensor_parallel_size: int | None = None
    scheduling_policy: str | None = None
    model: str | None = None
    gpu: str | None = None


class Setting(msgspec.Struct, kw_only=True):
    name: str  # vLLM's flag, e.g. --max-num-seqs
    value: str | int | float | bool | None
    source: str  # "flag", "vllm:cache_config_info", "inferred: ...", "vLLM default", "unknown"


class VllmFacts(msgspec.Struct, kw_only=True):
    """What a vLLM diagnosis rests on, beyond the Signals: the settings and where each came from."""

    scrapes: int
    intervals: int
    busy_intervals: int
    iterations: int  # engine steps seen (iteration_tokens_total count)
    span_s: float
    settings: list[Setting]
    series: list[str]  # the vllm: series the recording had
    request_rate: float | None = None  # arrivals per second (finished + queue growth, while requests came)
    prefix_hit_rate: float | None = None
    kv_churn: float | None = None  # removed / stored blocks (KV events)
    kv_blocks_stored: int = 0
    kv_blocks_removed: int = 0


@dataclass
class Reading:
    signals: Signals
    config: dict  # engine-config keys (as a kvscope hello's) the rules and knobs read
    facts: VllmFacts
    evidence: dict[str, list[Evidence]]  # per bottleneck, naming vLLM series
    cannot: list[str]
    prompt_buckets: list[tuple[float, float]]  # request_prompt_tokens over the recording (for the what-if)
    gen_buckets: list[tuple[float, float]]
    figures: dict  # trace figures as the histograms give them


def _ev(name: str, value, op: str, threshold, text: str, series: str) -> Evidence:
    return Evidence(name=name, value=value, threshold=threshold, comparison=op or "=", text=f"{text} [{series}]",
                    series=series)


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1000:.1f} ms"


def _delta_buckets(a: Scrape, b: Scrape, name: str) -> list[tuple[float, float]]:
    base = dict(a.buckets.get(name, []))
    return [(le, max(0.0, c - base.get(le, 0.0))) for le, c in b.buckets.get(name, [])]


def _count(buckets: list[tuple[float, float]]) -> float:
    return buckets[-1][1] if buckets else 0.0


def _dc(a: Scrape, b: Scrape, name: str) -> float:
    return max(0.0, b.counters.get(name, 0.0) - a.counters.get(name, 0.0))


def _present(s: Scrape) -> float:
    """Requests in the engine at a scrape: running plus waiting."""
    return s.gauges.get("num_requests_running", 0.0) + s.gauges.get("num_requests_waiting", 0.0)


def _bool(v: str | None) -> bool | None:
    return None if v is None else v.strip().lower() in ("true", "1", "yes")


def _num(v: str | None) -> float | None:
    try:
        x = float(v) if v not in (None, "", "None") else None
    except ValueError:
        return None
    return x if x is not None and math.isfinite(x) else None


def _cache_info(scrapes: list[Scrape]) -> dict[str, str]:
    for s in reversed(scrapes):
        if "cache_config_info" in s.by_label:
            return info_labels(s.by_label["cache_config_info"])
    return {}


def _infer_budget(iter_buckets: list[tuple[float, float]]) -> int | None:
    """The upper bound of the highest iteration_tokens_total bucket that holds a step."""
    prev = 0.0
    top = None
    for le, c in iter_buckets:
        if c > prev and not math.isinf(le):
            top = le
        prev = c
    return int(top) if top else None


def settings_for(scrapes: list[Scrape], flags: VllmFlags, running_max: int, iter_buckets) -> tuple[dict, list[Setting]]:
    """The engine config the rules read, and each vLLM setting with where its value came from."""
    info = _cache_info(scrapes)
    out: list[Setting] = []
    cfg: dict = {"backend": "vllm", "device": "cuda"}

    def pick(flag: str, given, from_info: str | None, convert, default=None, default_note="vLLM default"):
        if given is not None:
            out.append(Setting(name=flag, value=given, source="flag"))
            return given
        if from_info is not None and from_info in info:
            v = convert(info[from_info])
            if v is not None:
                out.append(Setting(name=flag, value=v, source=S_CACHE_INFO))
                return v
        if default is not None:
            out.append(Setting(name=flag, value=default, source=default_note))
            return default
        out.append(Setting(name=flag, value=None, source="unknown"))
        return None

    model = flags.model or next((s.model for s in scrapes if s.model), None)
    cfg["model"] = model or ""
    out.append(Setting(name="--model", value=model, source="flag" if flags.model else "model_name label"
                       if model else "unknown"))
    gmu = pick("--gpu-memory-utilization", flags.gpu_memory_utilization, "gpu_memory_utilization", _num)
    dtype = pick("--kv-cache-dtype", flags.kv_cache_dtype, "cache_dtype", lambda v: v or None)
    pc = pick("--enable-prefix-caching", flags.enable_prefix_caching, "enable_prefix_caching", _bool)
    blocks = _num(info.get("num_gpu_blocks"))
    block_size = _num(info.get("block_size"))
    if flags.max_num_seqs is not None:
        seqs = flags.max_num_seqs
        out.append(Setting(name="--max-num-seqs", value=seqs, source="flag"))
    elif running_max > 0:
        seqs = running_max
        out.append(Setting(name="--max-num-seqs", value=seqs, source=f"inferred: the most requests {S_RUNNING} "
                           "showed (a lower bound; pass --vllm-max-num-seqs)"))
    else:
        seqs = None
        out.append(Setting(name="--max-num-seqs", value=None, source="unknown"))
    if flags.max_num_batched_tokens is not None:
        budget = flags.max_num_batched_tokens
        out.append(Setting(name="--max-num-batched-tokens", value=budget, source="flag"))
    else:
        budget = _infer_budget(iter_buckets)
        out.append(Setting(name="--max-num-batched-tokens", value=budget,
                           source=f"inferred: the upper bound of the largest {S_ITER} bucket with a step "
                                  "(pass --vllm-max-num-batched-tokens)" if budget else "unknown"))
    chunked = pick("--enable-chunked-prefill", flags.enable_chunked_prefill, None, None, True,
                   "vLLM V1 default (on)")
    if flags.scheduling_policy is not None:
        vllm_scheduling_policy(flags.scheduling_policy)  # a caller that skipped the CLI's check
    policy = pick("--scheduling-policy", flags.scheduling_policy, None, None, DEFAULT_POLICY, "vLLM default")
    tp = pick("--tensor-parallel-size", flags.tensor_parallel_size, None, None, 1, "assumed (not exposed)")
    if flags.gpu:
        out.append(Setting(name="--gpu", value=flags.gpu, source="flag"))
    cfg.update(mode="chunked" if chunked else "continuous", policy=policy, max_num_seqs=seqs,
               max_num_batched_tokens=budget, gpu_memory_utilization=gmu, kv_cache_dtype=dtype or "auto",
               prefix_caching=bool(pc), tp=tp)
    if blocks is not None:
        cfg["num_blocks"] = int(blocks)
    if block_size is not None:
        cfg["block_size"] = int(block_size)
    if flags.gpu:
        cfg["gpu"] = flags.gpu
    return cfg, out


def read(scrapes: list[Scrape], flags: VllmFlags | None = None, cache=None) -> Reading:
    """The Signals, config and per-bottleneck evidence of a run of scrapes (oldest first)."""
    flags = flags or VllmFlags()
    scrapes = [s for s in scrapes if s is not None]
    cannot: list[str] = []
    pairs = list(zip(scrapes, scrapes[1:]))
    rows = []  # per interval
    for a, b in pairs:
        dt = b.t - a.t
        if dt <= 0:
            continue
        it = _delta_buckets(a, b, "iteration_tokens_total")
        iters = _count(it)
        tok = _dc(a, b, "iteration_tokens_total_sum")
        running = b.gauges.get("num_requests_running", 0.0)
        waiting = b.gauges.get("num_requests_waiting", 0.0)
        reasons = b.by_label.get("num_requests_waiting_by_reason", {})
        capacity = reasons.get("capacity", waiting)
        kv = b.gauges.get("kv_cache_usage_perc", b.gauges.get("gpu_cache_usage_perc", 0.0))
        # arrivals: what finished plus what the queues grew by (vLLM counts no arrivals)
        arrived = max(0.0, _dc(a, b, "request_success") + _present(b) - _present(a))
        rows.append((dt, iters, tok, running, waiting, capacity, kv, _dc(a, b, "num_preemptions"),
                     _dc(a, b, "prompt_tokens"), _dc(a, b, "generation_tokens"), arrived, b.t))
    arr = np.array(rows, dtype=float).reshape(-1, 12)
    dt, iters, tok, running, waiting, capacity, kv, pre, prompt, gen, arrived, t_end = arr.T
    busy = (iters > 0) | (running > 0) | (gen > 0)
    nb = int(busy.sum())
    first, last = (scrapes[0], scrapes[-1]) if scrapes else (Scrape(0.0), Scrape(0.0))
    iter_all = _delta_buckets(first, last, "iteration_tokens_total")
    running_max = int(running.max()) if len(running) else 0
    cfg, settings = settings_for(scrapes, flags, running_max, iter_all)
    seqs, budget = cfg.get("max_num_seqs"), cfg.get("max_num_batched_tokens")

    mean_tok = np.divide(tok, iters, out=np.zeros_like(tok), where=iters > 0)
    step_dur = np.divide(dt, iters, out=np.zeros_like(dt), where=iters > 0)
    waits = capacity > 0
    kv_blocked = busy & waits & ((kv >= KV_FULL) | (pre > 0))
    pinned = (mean_tok >= PINNED * budget) if budget else np.zeros(len(rows), dtype=bool)
    budget_blocked = busy & waits & pinned & ~kv_blocked
    seqs_blocked = busy & waits & (running >= seqs) & ~kv_blocked & ~pinned if seqs else np.zeros(len(rows), bool)
    if seqs and flags.max_num_seqs is None:
        # inferred as the largest batch seen: only a batch held there while requests waited counts
        held = busy & (running >= seqs)
        if held.sum() < max(2, 0.3 * nb):
            seqs_blocked = np.zeros(len(rows), dtype=bool)

    def frac(mask) -> float:
        return float((mask & busy).sum()) / nb if nb else 0.0

    requests = _dc(first, last, "request_success")
    e2e_count = _count(_delta_buckets(first, last, "e2e_request_latency_seconds"))
    requests = int(max(requests, e2e_count))
    preempt = int(round(_dc(first, last, "num_preemptions")))
    # vLLM 0.32 on: each finished request's own preemption count (a histogram): an exact mean per request
    per_req = _count(_delta_buckets(first, last, "request_num_preemptions"))
    per_req_mean = _dc(first, last, "request_num_preemptions_sum") / per_req if per_req else None
    span = float(last.t - first.t) if len(scrapes) > 1 else 0.0
    ttft_b = _delta_buckets(first, last, "time_to_first_token_seconds")
    itl_name = "inter_token_latency_seconds" if "inter_token_latency_seconds" in last.buckets else \
        "time_per_output_token_seconds"
    itl_b = _delta_buckets(first, last, itl_name)
    queue_b = _delta_buckets(first, last, "request_queue_time_seconds")
    prefill_b = _delta_buckets(first, last, "request_prefill_time_seconds")
    decode_b = _delta_buckets(first, last, "request_decode_time_seconds")
    itl_p50, itl_p99 = quantile(itl_b, 0.5), quantile(itl_b, 0.99)
    tail_share = _itl_tail_prefill_share(pairs, itl_name, itl_p99)
    busy_steps_dur = step_dur[busy & (iters > 0)]
    step_p50 = float(np.median(busy_steps_dur)) if len(busy_steps_dur) else None
    fixed = None
    if budget:
        m = busy & (iters > 0)
        fixed = _fixed_share(mean_tok[m], step_dur[m], float(budget))
    total_iters = float(iters.sum())
    queue_p50, queue_p99 = quantile(queue_b, 0.5), quantile(queue_b, 0.99)
    came = np.nonzero(arrived > 0)[0]
    rate = None
    if len(came):  # over the intervals from the first to the last that saw an arrival
        lo, hi = came[0], came[-1]
        window = float(t_end[hi] - (t_end[lo] - dt[lo]))
        rate = float(arrived[lo:hi + 1].sum()) / window if window > 0 else None
    queue_from = S_QUEUE
    if queue_p50 is None and rate and nb:  # no queue histogram: Little's law, mean waiting / arrival rate
        queue_p50 = float(capacity[busy].mean()) / rate
        queue_from = f"{S_BY_REASON} / arrival rate (Little's law: no {S_QUEUE})"
    s = Signals(
        steps=len(rows), busy_steps=nb, span_s=span,
        busy_time_frac=nb / len(rows) if len(rows) else 0.0,
        requests=requests, finished=requests,
        blocked_kv=frac(kv_blocked), blocked_budget=frac(budget_blocked), blocked_seqs=frac(seqs_blocked),
        blocked_static=0.0,
        queued_frac=frac(waiting > 0), mean_queued=float(waiting[busy].mean()) if nb else 0.0,
        preemptions_kv=preempt, preemptions_priority=0,
        preempted_per_request=per_req_mean if per_req_mean is not None else preempt / max(1, requests),
        recompute_frac=0.0,
        kv_use_p90=float(np.percentile(kv[busy], 90)) if nb else 0.0,
        kv_use_mean=float(kv[busy].mean()) if nb else 0.0,
        running_mean=float(running[busy].mean()) / seqs if nb and seqs else 0.0,
        running_max=running_max,
        tokens_fill=float(tok.sum()) / total_iters / budget if total_iters and budget else 0.0,
        padding_frac=0.0, step_dur_p50=step_p50, fixed_share=fixed,
        ttft_p50=quantile(ttft_b, 0.5), ttft_p99=quantile(ttft_b, 0.99),
        queue_p50=queue_p50, queue_p99=queue_p99,
        itl_p50=itl_p50, itl_p99=itl_p99, itl_tail_prefill_share=tail_share, itl_p99_prefill=None,
        itl_p50_clean=None, prefill_step_dur_p99=quantile(prefill_b, 0.99),
        decode_step_dur_p99=quantile(decode_b, 0.99), overtaken_frac=0.0, wait_ratio=None, priorities=1,
    )
    queries, hits = _dc(first, last, "prefix_cache_queries"), _dc(first, last, "prefix_cache_hits")
    facts = VllmFacts(scrapes=len(scrapes), intervals=len(rows), busy_intervals=nb, iterations=int(total_iters),
                      span_s=span, settings=settings, series=sorted(_series(last)), request_rate=rate,
                      prefix_hit_rate=hits / queries if queries > 0 else None)
    if cache is not None:
        facts.kv_blocks_stored, facts.kv_blocks_removed = cache.stored_total, cache.removed_total
        facts.kv_churn = cache.removed_total / cache.stored_total if cache.stored_total else None
    if len(scrapes) < 2:
        cannot.append("fewer than two scrapes: no rates, no intervals to judge")
    if not budget:
        cannot.append(f"max_num_batched_tokens unknown (no {S_ITER} and no --vllm-max-num-batched-tokens): "
                      "the token budget cannot be judged")
    if not seqs:
        cannot.append("max_num_seqs unknown: the batch limit cannot be judged")
    if "num_requests_waiting_by_reason" not in last.by_label:
        cannot.append(f"no {S_BY_REASON}: every waiting request counted as waiting for capacity")
    cannot.append("vLLM exposes no per-request order: policy_starvation cannot be judged from metrics")
    if "time_to_first_token_seconds" not in last.buckets:
        cannot.append(f"no {S_TTFT}: TTFT unknown")
    ev = _evidence(s, cfg, facts, pinned, busy, mean_tok, budget, seqs, settings, queue_from)
    figures = dict(output_tok_per_s=float(gen.sum()) / span if span > 0 else 0.0, ttft_p50_s=s.ttft_p50,
                   ttft_p99_s=s.ttft_p99, itl_p99_s=s.itl_p99, preemptions=preempt)
    return Reading(s, cfg, facts, ev, cannot, _delta_buckets(first, last, "request_prompt_tokens"),
                   _delta_buckets(first, last, "request_generation_tokens"), figures)


def _series(s: Scrape) -> set[str]:
    names = set(s.gauges) | set(s.buckets) | {k for k in s.counters if not k.endswith("_sum")}
    return {f"vllm:{n}" for n in names}


def _itl_tail_prefill_share(pairs, itl_name: str, cut: float | None) -> float | None:
    """Of the ITL samples in buckets at or above the one holding p99, the share that landed in an
    interval in which prompt tokens were processed (vLLM's gaps carry no step, so the interval does)."""
    if cut is None:
        return None
    tail = with_prefill = 0.0
    for a, b in pairs:
        d = _delta_buckets(a, b, itl_name)
        lower = 0.0  # samples in the buckets below the one holding the cut
        for le, c in d:
            if le >= cut:
                break
            lower = c
        n = _count(d) - lower
        tail += n
        if _dc(a, b, "prompt_tokens") > 0:
            with_prefill += n
    return with_prefill / tail if tail > 0 else None


def _evidence(s: Signals, cfg: dict, facts: VllmFacts, pinned, busy, mean_tok, budget, seqs,
              settings: list[Setting], queue_from: str) -> dict[str, list[Evidence]]:
    src = {x.name: x.source for x in settings}
    budget_src = src.get("--max-num-batched-tokens", "unknown")
    seqs_src = src.get("--max-num-seqs", "unknown")
    ratio = s.itl_p99 / s.itl_p50 if s.itl_p99 and s.itl_p50 else 0.0
    queue_steps = (s.queue_p50 or 0.0) / s.step_dur_p50 if s.step_dur_p50 else 0.0
    pinned_frac = float((pinned & busy).sum()) / max(1, int(busy.sum()))
    mean_iter = float(mean_tok[busy].mean()) if busy.any() else 0.0
    churn = facts.kv_churn
    w = V.wait_weight(s)
    q = s.queue_p99 if s.queue_p99 is not None else s.queue_p50
    wait = _ev("wait_weight", None if w is None else round(w, 2), ">=", 1.0,
               f"queue time p99 {V.dur(q)} against the larger of ITL p99 {V.dur(s.itl_p99)} and {V.QUEUE_STEPS_MIN:g} "
               f"iteration times ({_ms(s.step_dur_p50)} each): " + (
                   "unknown, not weighed" if w is None else f"{w:.2f} (under 1: requests barely wait, so admission "
                   "is not what hurts)" if w < 1 else f"{w:.2f}: requests really wait"),
               f"{queue_from}, {S_ITL}")
    kv = [
        _ev("blocked_kv_frac", s.blocked_kv, ">=", V.BLOCKED_KV_MIN,
            f"requests waited for capacity with the KV cache >= {_pct(KV_FULL)} full or preempting in "
            f"{_pct(s.blocked_kv)} of busy intervals (threshold {_pct(V.BLOCKED_KV_MIN)})",
            f'{S_BY_REASON}{{reason="capacity"}}, {S_KV}'),
        _ev("preemptions_kv", s.preemptions_kv, ">=", round(V.PREEMPT_PER_REQ_MIN * s.requests, 1),
            f"{s.preemptions_kv:,} preemptions over {s.requests:,} finished requests (threshold 1 per "
            f"{round(1 / V.PREEMPT_PER_REQ_MIN)})", f"{S_PREEMPT}, {S_SUCCESS}"),
        _ev("kv_use_p90", round(s.kv_use_p90, 3), ">=", KV_FULL, f"KV cache {_pct(s.kv_use_p90)} used at p90", S_KV),
    ]
    if S_REQ_PREEMPT in facts.series:
        kv.append(_ev("preempted_per_request", round(s.preempted_per_request, 3), None, None,
                      f"{s.preempted_per_request:.2f} preemptions per finished request (each request's own count)",
                      S_REQ_PREEMPT))
    if churn is not None:
        kv.append(_ev("kv_churn", round(churn, 3), ">=", None,
                      f"{facts.kv_blocks_removed:,} blocks evicted for {facts.kv_blocks_stored:,} stored "
                      f"(churn {churn:.2f}): cached prefixes do not survive", "KV events BlockStored/BlockRemoved"))
    if facts.prefix_hit_rate is not None:
        kv.append(_ev("prefix_hit_rate", round(facts.prefix_hit_rate, 3), None, None,
                      f"prefix cache hit rate {_pct(facts.prefix_hit_rate)}", f"{S_HITS} / {S_QUERIES}"))
    kv.append(wait)
    return {
        V.KV_CAPACITY: kv,
        V.MAX_NUM_SEQS: [
            _ev("blocked_seqs_frac", s.blocked_seqs, ">=", V.BLOCKED_SEQS_MIN,
                f"requests waited for capacity with {s.running_max} running (max_num_seqs {seqs}, {seqs_src}) "
                f"and the KV cache not full in {_pct(s.blocked_seqs)} of busy intervals "
                f"(threshold {_pct(V.BLOCKED_SEQS_MIN)})", f"{S_BY_REASON}, {S_RUNNING}"),
            _ev("kv_use_p90", round(s.kv_use_p90, 3), "<", KV_FULL, f"KV cache only {_pct(s.kv_use_p90)} used at p90",
                S_KV),
            wait,
        ],
        V.TOKEN_BUDGET: [
            _ev("blocked_budget_frac", s.blocked_budget, ">=", V.BLOCKED_BUDGET_MIN,
                f"requests waited for capacity with iterations pinned at >= {_pct(PINNED)} of the "
                f"{budget}-token budget ({budget_src}) in {_pct(s.blocked_budget)} of busy intervals "
                f"(threshold {_pct(V.BLOCKED_BUDGET_MIN)})", f"{S_ITER}, {S_BY_REASON}"),
            _ev("iteration_tokens_mean", round(mean_iter, 1), ">=", None,
                f"{mean_iter:,.0f} tokens per iteration on average; {_pct(pinned_frac)} of busy intervals pinned",
                f"{S_ITER} (sum / count)"),
            _ev("queue_p50_steps", round(queue_steps, 1), ">=", V.QUEUE_STEPS_MIN,
                f"queue time p50 {_ms(s.queue_p50)} = {queue_steps:.1f} iteration times "
                f"(threshold {V.QUEUE_STEPS_MIN:g})", f"{queue_from}, {S_ITER}"),
            _ev("fixed_share", s.fixed_share, ">=", V.FIXED_SHARE_MIN,
                f"{_pct(s.fixed_share)} of a full iteration's time is fixed cost (threshold {_pct(V.FIXED_SHARE_MIN)})",
                f"{S_ITER} against the scrape interval"),
            wait,
        ],
        V.PREFILL_INTERFERENCE: [
            _ev("itl_p99_over_p50", round(ratio, 2), ">=", V.ITL_RATIO_MIN,
                f"ITL p99 {_ms(s.itl_p99)} = {ratio:.1f}x p50 {_ms(s.itl_p50)} (threshold {V.ITL_RATIO_MIN:g}x)",
                S_ITL),
            _ev("itl_tail_prefill_share", s.itl_tail_prefill_share, ">=", V.ITL_TAIL_PREFILL_MIN,
                f"{_pct(s.itl_tail_prefill_share)} of the ITL tail fell in intervals that processed prompt tokens "
                f"(threshold {_pct(V.ITL_TAIL_PREFILL_MIN)})", f"{S_ITL}, {S_PROMPT}"),
            _ev("prefill_time_p99", s.prefill_step_dur_p99, None, None,
                f"prefill time p99 {_ms(s.prefill_step_dur_p99)}, decode time p99 {_ms(s.decode_step_dur_p99)}",
                f"{S_PREFILL}, {S_DECODE}"),
        ],
        V.BATCHING_MODE: [
            _ev("mode", None, "in", None, "vLLM batches continuously: batching_mode does not apply",
                "--enable-chunked-prefill"),
        ],
        V.POLICY_STARVATION: [
            _ev("overtaken_frac", None, ">=", V.OVERTAKEN_MIN, "vLLM exposes no per-request order", S_QUEUE),
        ],
        "saturation": [
            _ev("tokens_fill", round(s.tokens_fill, 3), ">=", V.FULL_TOKENS,
                f"iterations carry {_pct(s.tokens_fill)} of the {budget}-token budget on average "
                f"(threshold {_pct(V.FULL_TOKENS)})", S_ITER),
            _ev("running_mean", round(s.running_mean, 3), ">=", V.FULL_RUNNING,
                f"{_pct(s.running_mean)} of max_num_seqs ({seqs}) running on average "
                f"(threshold {_pct(V.FULL_RUNNING)})", S_RUNNING),
            _ev("kv_use_mean", round(s.kv_use_mean, 3), ">=", V.FULL_KV,
                f"KV cache {_pct(s.kv_use_mean)} used on average (threshold {_pct(V.FULL_KV)})", S_KV),
            _ev("queued_frac", round(s.queued_frac, 3), ">=", V.BACKLOG_MIN,
                f"requests waiting in {_pct(s.queued_frac)} of busy intervals (threshold {_pct(V.BACKLOG_MIN)})",
                S_WAITING),
            _ev("request_rate", None if facts.request_rate is None else round(facts.request_rate, 3), None, None,
                f"{facts.request_rate or 0:.2f} requests/s arrived (finished + queue growth) over "
                f"{facts.span_s:.0f} s", f"{S_SUCCESS}, {S_RUNNING}, {S_WAITING}"),
        ],
    }
