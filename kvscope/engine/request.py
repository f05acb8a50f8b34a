"""A request and its lifecycle: state, tokens, timestamps and the metrics derived from them."""

from __future__ import annotations

import enum
import numbers
from dataclasses import dataclass, field, replace

from kvscope.engine.sampling_params import SamplingParams


# A priority is an int64 whose negation is one too: vLLM's "lower first" becomes kvscope's
# "higher first" by negating it (HTTP), and every priority reaches events as an int64.
PRIORITY_MAX = (1 << 63) - 1
PRIORITY_MIN = -PRIORITY_MAX


def priority_problem(value: object) -> str | None:
    """Why ``value`` is not a priority, in one line (None when it is one)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        return f"priority must be an integer, got {type(value).__name__}"
    if not PRIORITY_MIN <= value <= PRIORITY_MAX:
        return f"priority must be in [-(2^63-1), 2^63-1], got {value}"
    return None


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    SWAPPED = "swapped"  # preempted with its KV copied to the CPU swap pool
    FINISHED = "finished"


@dataclass(slots=True)
class RequestMetrics:
    """What a user sees of one request, in seconds."""

    ttft: float | None
    queue_time: float | None
    e2e: float | None
    itl: list[float]
    num_preemptions: int
    num_prompt_tokens: int
    num_output_tokens: int
    num_cached_tokens: int = 0  # prompt tokens that were prefix-cache hits

    @property
    def tpot(self) -> float | None:
        return sum(self.itl) / len(self.itl) if self.itl else None


@dataclass(eq=False)
class Request:
    req_id: int
    prompt_token_ids: list[int]
    params: SamplingParams
    arrival: float
    priority: int = 0
    source: str = ""  # where it came from: "" (the engine's own workload) or "http"
    status: RequestStatus = RequestStatus.WAITING
    # prompt followed by every generated token; KV exists for the first num_computed_tokens
    token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_prefill_chunks: int = 0
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    num_recomputed_tokens: int = 0  # computed tokens thrown away by recompute preemptions
    arrival_step: int = 0  # scheduler step at which it was added (policies age by it)
    first_scheduled: float | None = None
    token_times: list[float] = field(default_factory=list)
    finish_time: float | None = None
    finish_reason: str | None = None  # "stop", "length", "max_model_len", "abort", "error"
    # static mode: generation ended but the row keeps its slot until the batch ends
    done_generating: bool = False
    # outputs beyond the tokens (engine/outputs.py): text, logprobs, and why it failed
    detokenizer: object | None = None  # an IncrementalDetokenizer when params.detokenize
    event_text_chars: int = 0  # characters of its completion the step events have carried so far
    logprobs: list | None = None  # a TokenLogprobs per output token, when params.logprobs is set
    error: str | None = None  # finish reason "error": what went wrong
    # KV blocks (kept by engine/kv/block_manager.py): logical block i holds positions i*bs ..; the
    # first num_released_blocks left a sliding window and hold the null block. block_hashes: the
    # prefix-cache keys of its full blocks so far (with prefix caching).
    block_table: list[int] = field(default_factory=list)
    num_released_blocks: int = 0
    block_hashes: list[bytes] = field(default_factory=list)
    # parallel sampling (SamplingParams.n): sample i of n forks from request fork_of (sample 0), whose
    # prompt blocks it shares; seq_ids, on sample 0, are the ids of all n
    fork_of: int | None = None
    sample_index: int = 0
    seq_ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        if not self.token_ids:
            self.token_ids = list(self.prompt_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - len(self.prompt_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[len(self.prompt_token_ids):]

    @property
    def num_remaining(self) -> int:
        """Tokens whose KV still has to be computed before the next sample."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def is_decode(self) -> bool:
        return self.num_remaining == 1 and self.num_output_tokens > 0

    @property
    def ttft(self) -> float | None:
        return self.token_times[0] - self.arrival if self.token_times else None

    def append_token(self, token_id: int, now: float) -> float | None:
        """Record a sampled token; returns the inter-token gap, None for the first."""
        self.token_ids.append(token_id)
        gap = now - self.token_times[-1] if self.token_times else None
        self.token_times.append(now)
        return gap

    def fork(self, req_id: int, index: int) -> Request:
        """Sample `index` of this request's n: the same prompt, its own sampling stream (seed + index)."""
        seed = None if self.params.seed is None else self.params.seed + index
        return Request(req_id, list(self.prompt_token_ids), replace(self.params, n=1, seed=seed), self.arrival,
                       self.priority, source=self.source, fork_of=self.req_id, sample_index=index)

    def metrics(self) -> RequestMetrics:
        times = self.token_times
        return RequestMetrics(
            ttft=self.ttft,
            queue_time=None if self.first_scheduled is None else self.first_scheduled - self.arrival,
            e2e=None if self.finish_time is None else self.finish_time - self.arrival,
            itl=[b - a for a, b in zip(times, times[1:])],
            num_preemptions=self.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_output_tokens=self.num_output_tokens,
            num_cached_tokens=self.num_cached_tokens,
        )
