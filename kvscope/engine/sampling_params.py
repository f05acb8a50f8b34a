"""Per-request sampling settings."""

from __future__ import annotations

from dataclasses import dataclass

from kvscope.engine.errors import KvscopeError


@dataclass(slots=True)
class SamplingParams:
    max_tokens: int = 64
    temperature: float = 0.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0
    seed: int | None = None  # per-request generator seed for reproducible sampling
    ignore_eos: bool = False

    def validate(self) -> None:
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise KvscopeError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if self.temperature < 0:
            raise KvscopeError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise KvscopeError(f"top_k must be >= 0, got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise KvscopeError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
