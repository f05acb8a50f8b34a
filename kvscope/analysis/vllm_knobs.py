"""The knobs for a vLLM verdict, in vLLM's own `vllm serve` flags, with from -> to where the value is known.

The same rules as kvscope.analysis.knobs (which setting addresses which bottleneck, in which
order, the refusals), with vLLM's flag for each setting from the one table (knobs.FLAGS). ``from`` is None when vLLM
does not expose the current value and no flag gave it.
"""

from __future__ import annotations

from kvscope.analysis import knobs as K
from kvscope.analysis import verdicts as V
from kvscope.analysis.knobs import VLLM, Knob, budget_to, knob
from kvscope.analysis.signals import Signals

MEASURE_NEXT = {
    V.KV_CAPACITY: "vllm:num_preemptions (want its rate near 0) and vllm:kv_cache_usage_perc, then TTFT p99",
    V.MAX_NUM_SEQS: "vllm:num_requests_running against the new --max-num-seqs and vllm:kv_cache_usage_perc "
                    "(a bigger batch can start preempting), then ITL p99",
    V.TOKEN_BUDGET: "TTFT p50/p99 and vllm:request_queue_time_seconds; ITL p99, since bigger steps lengthen "
                    "every decode",
    V.PREFILL_INTERFERENCE: "ITL p99 against p50 (want under 3x) in vllm:inter_token_latency_seconds, and TTFT p99",
    V.BATCHING_MODE: K.MEASURE_NEXT[V.BATCHING_MODE],
    V.POLICY_STARVATION: "vllm:request_queue_time_seconds p99",
    V.COMPUTE_BOUND: "tokens/s per GPU (vllm:generation_tokens rate) against the roofline; only hardware or a "
                     "cheaper model moves it now",
    V.UNDERLOADED: "arrival rate against capacity: raise the load (vllm bench serve) to find where queues start",
}


CHUNKED_BUDGET = 2048  # vLLM's SchedulerConfig default max_num_batched_tokens (vllm 0.33), the chunk size


def _kv(cfg: dict, s: Signals) -> list[Knob]:
    out = []
    gmu = cfg.get("gpu_memory_utilization")
    if not isinstance(gmu, (int, float)) or gmu < K.GMU_HIGH:
        out.append(knob(VLLM["gpu_memory_utilization"], gmu, K.GMU_HIGH, "more of the GPU's memory for KV blocks"))
    seqs = cfg.get("max_num_seqs")
    if s.running_max > 2:
        out.append(knob(VLLM["max_num_seqs"], seqs, max(1, s.running_max // 2),
                         "fewer concurrent sequences fit the cache without preempting each other"))
    dtype = str(cfg.get("kv_cache_dtype") or "auto")
    if dtype in ("auto",) + K.WIDE_KV_DTYPES:
        out.append(knob(VLLM["kv_cache_dtype"], dtype, "fp8", "an FP8 KV cache holds twice the tokens per GiB"))
    if not cfg.get("prefix_caching"):
        out.append(knob(VLLM["prefix_caching"], False, True, "shared prompt prefixes take their blocks once"))
    return out


def candidates(verdict: str, cfg: dict, s: Signals) -> list[Knob]:
    seqs, budget = cfg.get("max_num_seqs"), cfg.get("max_num_batched_tokens")
    if verdict == V.KV_CAPACITY:
        return _kv(cfg, s)
    if verdict == V.MAX_NUM_SEQS and isinstance(seqs, int):
        return [knob(VLLM["max_num_seqs"], seqs, 2 * seqs, "the batch is capped by max_num_seqs while KV blocks "
                      "and the token budget are free")]
    if verdict == V.TOKEN_BUDGET and isinstance(budget, int):
        return [knob(VLLM["max_num_batched_tokens"], budget, budget_to(budget),
                      "a bigger per-step budget prefills waiting prompts sooner")]
    if verdict == V.PREFILL_INTERFERENCE:
        if cfg.get("mode") == "continuous":
            out = [knob(VLLM["chunked_prefill"], False, True, "chunked prefill interleaves prompt chunks with "
                         "decodes, so a long prompt no longer stalls every decode"
                         + (f" (chunks of at most {CHUNKED_BUDGET} tokens: see the next knob)"
                            if isinstance(budget, int) and budget > CHUNKED_BUDGET else ""))]
            if isinstance(budget, int) and budget > CHUNKED_BUDGET:
                out.append(knob(VLLM["max_num_batched_tokens"], budget, CHUNKED_BUDGET, "a chunk is at most the step's "
                                 "budget: vLLM's default with chunked prefill"))
            return out
        if isinstance(budget, int) and budget > 64:
            smaller = max(64, budget // 4 if budget > 1024 else budget // 2)
            return [knob(VLLM["max_num_batched_tokens"], budget, smaller,
                          "smaller prefill chunks per step keep each decode step short"),
                    knob(VLLM["long_prefill_token_threshold"], None, max(16, smaller // 2),
                          "a long prompt takes at most this many tokens of a step")]
    if verdict == V.POLICY_STARVATION and cfg.get("policy") not in (None, "fcfs"):
        return [knob(VLLM["policy"], cfg.get("policy"), "fcfs", "first come, first served passes nobody over")]
    if verdict == V.COMPUTE_BOUND:
        tp = cfg.get("tp") or 1
        return [knob(VLLM["tp"], tp, 2 * tp, "the scheduler knobs are exhausted: iterations are "
                      "full, so only more GPUs per replica shorten them")]
    return []


def choose(verdict: str, secondary: list[V.Ruling], cfg: dict, s: Signals) -> tuple[list[Knob], list[str]]:
    """Ordered knobs (at most K.MAX_KNOBS, one per flag) and the refusals that shaped them."""
    refusals: list[str] = []
    gmu = cfg.get("gpu_memory_utilization")
    if isinstance(gmu, (int, float)) and gmu < K.GMU_FLOOR:
        refusals.append(f"--gpu-memory-utilization {gmu:g} is below {K.GMU_FLOOR:g}: raise it first; "
                        "no other knob is advised until it is")
        return [knob(VLLM["gpu_memory_utilization"], gmu, K.GMU_TARGET, "below 0.7 most of the GPU's memory is "
                      "unused, so every other figure is measured on a starved KV cache")], refusals
    unique = K.with_runners_up(candidates, verdict, secondary, cfg, s)
    if verdict not in (V.COMPUTE_BOUND, V.UNDERLOADED):
        refusals.append("no more GPUs (--tensor-parallel-size) while scheduler knobs remain: try the knobs above "
                        "first")
    return unique[:K.MAX_KNOBS], refusals
