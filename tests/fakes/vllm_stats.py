"""vLLM's per-step stats classes, mirrored field for field from vllm 0.33.0 (vllm/v1/metrics/stats.py).

The wheel (`pip download --no-deps vllm==0.33.0`) cannot be imported here: stats.py imports
vllm.envs, vllm.compilation and torch-backed modules. So these are the same dataclasses
with the same fields, defaults and the IterationStats attributes its __init__ sets;
tests/test_vllm_plugin.py checks them against the wheel's source (by AST) when
KVSCOPE_VLLM_STATS_PY names that file. What the plugin reads is what vLLM's own
PrometheusStatLogger.record reads.
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

VLLM_VERSION = "0.33.0"


class FinishReason(enum.IntEnum):  # vllm/v1/engine/__init__.py
    STOP = 0
    LENGTH = 1
    ABORT = 2
    ERROR = 3
    REPETITION = 4


@dataclass
class BaseCacheStats:
    reset: bool = False
    requests: int = 0
    queries: int = 0
    hits: int = 0


@dataclass
class PrefixCacheStats(BaseCacheStats):
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    hits_by_source: dict = field(default_factory=dict)


@dataclass
class SchedulerIterationDetails:
    iteration_index: int
    num_ctx_requests: int
    num_ctx_tokens: int
    num_generation_requests: int
    num_generation_tokens: int
    elapsed_ms: float
    num_encoder_inputs: int = 0
    num_encoder_output_tokens: int = 0
    is_dummy: bool = False


@dataclass
class SchedulerStats:
    num_running_reqs: int = 0
    num_waiting_reqs: int = 0
    num_skipped_waiting_reqs: int = 0
    num_kv_fetch_reqs_by_stage: dict[str, int] = field(default_factory=dict)
    step_counter: int = 0
    current_wave: int = 0
    kv_cache_usage: float = 0.0
    iteration_details: SchedulerIterationDetails | None = None
    prefix_cache_stats: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    connector_prefix_cache_stats: PrefixCacheStats | None = None
    kv_cache_eviction_events: list = field(default_factory=list)
    spec_decoding_stats: Any = None
    kv_connector_stats: dict[str, Any] | None = None
    ec_connector_stats: dict[str, Any] | None = None
    waiting_lora_adapters: dict[str, int] = field(default_factory=dict)
    running_lora_adapters: dict[str, int] = field(default_factory=dict)
    cudagraph_stats: Any = None
    perf_stats: Any = None


@dataclass
class FinishedRequestStats:
    finish_reason: FinishReason
    request_id: str | None = None
    e2e_latency: float = 0.0
    num_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_generation_tokens: int = 0
    max_tokens_param: int | None = None
    queued_time: float = 0.0
    prefill_time: float = 0.0
    inference_time: float = 0.0
    decode_time: float = 0.0
    mean_time_per_output_token: float = 0.0
    is_corrupted: bool = False
    num_cached_tokens: int = 0


@dataclass
class PromptTokenStats:
    computed: int = 0
    local_cache_hit: int = 0
    external_kv_transfer: int = 0
    cached_tokens: int = 0
    total: int = 0


class IterationStats:
    """Not a dataclass in vLLM either: __init__ sets these attributes."""

    def __init__(self) -> None:
        self.iteration_timestamp = time.time()
        self.compute_nans_in_logits = False
        self.num_generation_tokens = 0
        self.prompt_token_stats = PromptTokenStats()
        self.num_preempted_reqs = 0
        self.finished_requests: list[FinishedRequestStats] = []
        self.max_num_generation_tokens_iter: list[int] = []
        self.n_params_iter: list[int] = []
        self.time_to_first_tokens_iter: list[float] = []
        self.inter_token_latencies_iter: list[float] = []
        self.num_corrupted_reqs: int = 0
        self.num_watermarked_reqs: int = 0
        self.num_watermark_skipped_reqs: int = 0
        self.num_not_watermarked_reqs: int = 0

    @property
    def num_prompt_tokens(self) -> int:
        return self.prompt_token_stats.total


@dataclass
class SchedulerConfig:  # the VllmConfig parts the plugin reads (vllm/config/scheduler.py, cache.py, ...)
    max_num_seqs: int = 256
    max_num_batched_tokens: int = 2048
    enable_chunked_prefill: bool = True
    policy: str = "fcfs"


@dataclass
class CacheConfig:
    block_size: int = 16
    gpu_memory_utilization: float = 0.92
    cache_dtype: str = "auto"
    num_gpu_blocks: int | None = 4096
    enable_prefix_caching: bool = True


@dataclass
class ModelConfig:
    model: str = "Qwen/Qwen3-8B"
    served_model_name: str | None = None
    max_model_len: int = 8192


@dataclass
class ParallelConfig:
    tensor_parallel_size: int = 1


@dataclass
class VllmConfig:
    scheduler_config: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache_config: CacheConfig = field(default_factory=CacheConfig)
    model_config: ModelConfig = field(default_factory=ModelConfig)
    parallel_config: ParallelConfig = field(default_factory=ParallelConfig)
