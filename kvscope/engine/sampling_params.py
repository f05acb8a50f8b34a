"""Per-request sampling settings (vLLM's names and meanings).

Checked once where a request enters (`validate`), so the sampler never sees a value
that can make it fail: a temperature under the floor is greedy, as in vLLM.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvscope.errors import KvscopeError

# Below this temperature sampling is greedy (vLLM's _SAMPLING_EPS): dividing logits by a
# smaller number overflows float32 to inf, and softmax then yields NaN.
TEMPERATURE_FLOOR = 1e-5
MAX_LOGPROBS = 20  # top-k logprobs a request may ask for (vLLM's default max_logprobs)
MAX_STOP_TOKEN_IDS = 1024
MAX_N = 64  # parallel samples of one prompt


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 (or under TEMPERATURE_FLOOR) means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    min_p: float = 0.0  # drop tokens below min_p x the top token's probability; 0 disables
    seed: int | None = None  # per-request generator seed for reproducible sampling
    ignore_eos: bool = False
    min_tokens: int = 0  # EOS and stop_token_ids cannot be sampled (nor stop strings match) before this many
    stop: list[str] = field(default_factory=list)  # stop strings: the text ends before the first one
    stop_token_ids: list[int] = field(default_factory=list)  # tokens that end the request (reason "stop")
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob and the top k
    detokenize: bool = True  # keep the output text (incrementally); off for token-id-only workloads
    n: int = 1  # sequences sampled from one prompt; they share its KV blocks (copy-on-write)

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or not 1 <= self.max_tokens < 1 << 63:  # an int64 in events
            raise KvscopeError(f"max_tokens must be an integer in [1, 2^63), got {self.max_tokens!r}")
        if not _finite(self.temperature) or self.temperature < 0:
            raise KvscopeError(f"temperature must be >= 0 (and finite), got {self.temperature!r}")
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise KvscopeError(f"top_k must be an integer >= 0, got {self.top_k!r}")
        if not _finite(self.top_p) or not 0.0 < self.top_p <= 1.0:
            raise KvscopeError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not _finite(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise KvscopeError(f"min_p must be in [0, 1], got {self.min_p!r}")
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise KvscopeError(f"min_tokens must be an integer in [0, max_tokens={self.max_tokens}], "
                               f"got {self.min_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or not 0 <= self.seed < 1 << 63):
            raise KvscopeError(f"seed must be an integer in [0, 2^63), got {self.seed!r}")
        if self.logprobs is not None and (not isinstance(self.logprobs, int) or
                                          not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise KvscopeError(f"logprobs must be an integer in [0, {MAX_LOGPROBS}], got {self.logprobs!r}")
        if not isinstance(self.stop, list) or not all(isinstance(s, str) for s in self.stop):
            raise KvscopeError("stop must be a list of strings")
        if (not isinstance(self.stop_token_ids, list) or len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS
                or not all(isinstance(t, int) and t >= 0 for t in self.stop_token_ids)):
            raise KvscopeError(f"stop_token_ids must be a list of at most {MAX_STOP_TOKEN_IDS} token ids")
        if isinstance(self.n, bool) or not isinstance(self.n, int) or not 1 <= self.n <= MAX_N:
            raise KvscopeError(f"n must be an integer in 1..{MAX_N}, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < TEMPERATURE_FLOOR


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
