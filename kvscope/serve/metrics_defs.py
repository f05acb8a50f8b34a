"""The metric definitions: vLLM V1's (names, help, buckets as in vllm/v1/metrics/loggers.py) and kvscope's own.

Every metric carries the labels model_name and engine, as vLLM's do.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

LABELS = ["model_name", "engine"]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                40.0, 80.0, 160.0, 640.0, 2560.0]
ITL_BUCKETS = [0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0,
               80.0]
REQUEST_LATENCY_BUCKETS = [0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                           240.0, 480.0, 960.0, 1920.0, 7680.0]
ITERATION_TOKEN_BUCKETS = [1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384]
N_BUCKETS = [1, 2, 5, 10, 20]
STEP_DURATION_BUCKETS = [0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0]
STEP_KINDS = ("prefill", "decode", "mixed", "idle")
KV_BLOCK_STATES = ("used", "cached", "free", "shared")


def build_1_2_5_buckets(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's buckets for token counts)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class VllmMetrics:
    def __init__(self, reg: CollectorRegistry, labels: tuple[str, str], max_model_len: int,
                 finish_reasons: tuple[str, ...]) -> None:
        def gauge(name, doc):
            return Gauge(name, doc, LABELS, registry=reg).labels(*labels)

        def counter(name, doc):
            return Counter(name, doc, LABELS, registry=reg).labels(*labels)

        def hist(name, doc, buckets):
            return Histogram(name, doc, LABELS, buckets=buckets, registry=reg).labels(*labels)

        self.running = gauge("vllm:num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.")
        by_reason = Gauge("vllm:num_requests_waiting_by_reason", "Number of waiting requests by reason. Reason "
                          "labels: 'capacity' = waiting for scheduling capacity; 'deferred' = deferred by transient "
                          "constraints. Sum of all reasons equals vllm:num_requests_waiting.", LABELS + ["reason"],
                          registry=reg)
        self.waiting_capacity = by_reason.labels(*labels, "capacity")
        by_reason.labels(*labels, "deferred").set(0)
        self.kv_usage = gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_cache_usage = gauge("vllm:gpu_cache_usage_perc", "GPU KV-cache usage. 1 means 100 percent usage."
                                     "DEPRECATED: Use vllm:kv_cache_usage_perc instead.")
        self.prefix_queries = counter("vllm:prefix_cache_queries",
                                      "Prefix cache queries, in terms of number of queried tokens.")
        self.prefix_hits = counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.")
        self.preemptions = counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.")
        self.prompt_tokens = counter("vllm:prompt_tokens", "Number of prefill tokens processed.")
        # vLLM's split of each request's prompt (a sample of n counts its prompt in vllm:prompt_tokens, as each of
        # vLLM's n child requests does): computed here, or found in KV another request holds (prefix cache, a fork)
        by_source = Counter("vllm:prompt_tokens_by_source", "Number of prompt tokens by source.", LABELS + ["source"],
                            registry=reg)
        self.prompt_tokens_by_source = {s: by_source.labels(*labels, s)
                                        for s in ("local_compute", "local_cache_hit", "external_kv_transfer")}
        self.prompt_tokens_cached = counter("vllm:prompt_tokens_cached",
                                            "Number of cached prompt tokens (local + external).")
        self.generation_tokens = counter("vllm:generation_tokens", "Number of generation tokens processed.")
        success = Counter("vllm:request_success", "Count of successfully processed requests.",
                          LABELS + ["finished_reason"], registry=reg)
        self.success = {r: success.labels(*labels, r) for r in finish_reasons}
        token_buckets = build_1_2_5_buckets(max_model_len)
        self.prompt_tokens_request = hist("vllm:request_prompt_tokens", "Number of prefill tokens processed.",
                                          token_buckets)
        self.generation_tokens_request = hist("vllm:request_generation_tokens",
                                              "Number of generation tokens processed.", token_buckets)
        self.iteration_tokens = hist("vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.",
                                     ITERATION_TOKEN_BUCKETS)
        self.max_generation_tokens_request = hist("vllm:request_max_num_generation_tokens",
                                                  "Histogram of maximum number of requested generation tokens.",
                                                  token_buckets)
        self.n_param = hist("vllm:request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.max_tokens_param = hist("vllm:request_params_max_tokens",
                                     "Histogram of the max_tokens request parameter.", token_buckets)
        self.ttft = hist("vllm:time_to_first_token_seconds", "Histogram of time to first token in seconds.",
                         TTFT_BUCKETS)
        self.tpot_deprecated = hist("vllm:time_per_output_token_seconds", "Histogram of time per output token in "
                                    "seconds.DEPRECATED: Use vllm:inter_token_latency_seconds instead.", ITL_BUCKETS)
        self.itl = hist("vllm:inter_token_latency_seconds", "Histogram of inter-token latency in seconds.",
                        ITL_BUCKETS)
        self.request_tpot = hist("vllm:request_time_per_output_token_seconds",
                                 "Histogram of time_per_output_token_seconds per request.", ITL_BUCKETS)
        self.e2e = hist("vllm:e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.",
                        REQUEST_LATENCY_BUCKETS)
        self.queue_time = hist("vllm:request_queue_time_seconds",
                               "Histogram of time spent in WAITING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.inference_time = hist("vllm:request_inference_time_seconds",
                                   "Histogram of time spent in RUNNING phase for request.", REQUEST_LATENCY_BUCKETS)
        self.prefill_time = hist("vllm:request_prefill_time_seconds",
                                 "Histogram of time spent in PREFILL phase for request.", REQUEST_LATENCY_BUCKETS)
        self.decode_time = hist("vllm:request_decode_time_seconds",
                                "Histogram of time spent in DECODE phase for request.", REQUEST_LATENCY_BUCKETS)


class KvscopeMetrics:
    def __init__(self, reg: CollectorRegistry, labels: tuple[str, str], block_reasons: tuple[str, ...]) -> None:
        self.labels = labels
        steps = Counter("kvscope:steps", "Scheduler steps by kind: prefill, decode, mixed (both) or idle (nothing "
                        "computed).", LABELS + ["kind"], registry=reg)
        self.steps = {kind: steps.labels(*labels, kind) for kind in STEP_KINDS}
        blocked = Counter("kvscope:blocked_steps", "Steps whose head of WAITING could not be admitted, by reason.",
                          LABELS + ["reason"], registry=reg)
        self.blocked = {r: blocked.labels(*labels, r) for r in block_reasons}
        self.preemptions = Counter("kvscope:preemptions", "Preemptions by reason (kv_blocks, priority) and mode "
                                   "(recompute, swap).", LABELS + ["reason", "mode"], registry=reg)
        self.swapped_blocks = Counter("kvscope:swapped_blocks", "KV blocks copied to (out) or from (in) the CPU swap "
                                      "pool.", LABELS + ["direction"], registry=reg)
        for direction in ("out", "in"):
            self.swapped_blocks.labels(*labels, direction)
        self.cow_copies = Counter("kvscope:cow_copies", "Shared KV blocks copied before a write (copy-on-write).",
                                  LABELS, registry=reg).labels(*labels)
        self.padding_tokens = Counter("kvscope:padding_tokens", "Padded tokens computed for nothing (static mode).",
                                      LABELS, registry=reg).labels(*labels)
        self.rejected = Counter("kvscope:rejected_requests", "Requests the engine refused.", LABELS,
                                registry=reg).labels(*labels)
        self.dropped_events = Counter("kvscope:dropped_events", "Events the publisher lost (slow subscriber).", LABELS,
                                      registry=reg).labels(*labels)
        self.step_duration = Histogram("kvscope:step_duration_seconds", "Duration of one scheduler step.", LABELS,
                                       buckets=STEP_DURATION_BUCKETS, registry=reg).labels(*labels)
        self.preempted = Gauge("kvscope:num_requests_preempted", "Waiting requests that were preempted (recompute).",
                               LABELS, registry=reg).labels(*labels)
        self.swapped = Gauge("kvscope:num_requests_swapped", "Waiting requests whose KV is in the CPU swap pool.",
                             LABELS, registry=reg).labels(*labels)
        kv_blocks = Gauge("kvscope:kv_blocks", "GPU KV blocks by state: used (held by a live request), cached (free, "
                          "holding a reusable prefix), free (cached included), shared (held by more than one).",
                          LABELS + ["state"], registry=reg)
        self.kv_blocks = {s: kv_blocks.labels(*labels, s) for s in KV_BLOCK_STATES}
        self.swap_used = Gauge("kvscope:swap_pool_used_blocks", "CPU swap pool blocks holding swapped-out KV.", LABELS,
                               registry=reg).labels(*labels)
        self.swap_total = Gauge("kvscope:swap_pool_blocks", "Blocks in the CPU swap pool (0 without swapping).",
                                LABELS, registry=reg).labels(*labels)
        self.swap_usage = Gauge("kvscope:swap_pool_usage_perc", "CPU swap pool usage. 1 means 100 percent usage.",
                                LABELS, registry=reg).labels(*labels)


class GoodputMetrics:
    """Goodput and SLO attainment (docs/GOODPUT.md): made only when the run has an SLO."""

    def __init__(self, reg: CollectorRegistry, labels: tuple[str, str], slo_targets: dict[str, float]) -> None:
        def counter(name, doc, extra=()):
            return Counter(name, doc, LABELS + list(extra), registry=reg)

        self.judged = counter("kvscope:slo_judged_requests", "Finished requests judged against the SLO.").labels(
            *labels)
        self.good = counter("kvscope:goodput_requests", "Finished requests that met every SLO target (vLLM bench "
                            "serve's --goodput definition).").labels(*labels)
        self.good_tokens = counter("kvscope:goodput_tokens", "Output tokens of requests that met every SLO target "
                                   "(rate() of it is goodput in tok/s).").labels(*labels)
        met = counter("kvscope:slo_met_requests", "Finished requests meeting one SLO target, by slo (ttft, tpot, "
                      "e2el).", ["slo"])
        self.met = {k: met.labels(*labels, k) for k in slo_targets}
        target = Gauge("kvscope:slo_target_seconds", "The SLO targets the run judges by, in seconds.",
                       LABELS + ["slo"], registry=reg)
        for k, v in slo_targets.items():
            target.labels(*labels, k).set(v)
