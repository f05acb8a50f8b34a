"""Turns the last-position logits of each sampled sequence into one token (and, if asked, logprobs).

One row's failure is that row's alone: it is reported in `SampleOutput.failures` and the
engine ends that request; every other row is sampled as if it were not there.
Logprobs are those of the raw model output (log-softmax of the logits before temperature,
top-k/top-p/min-p or the min_tokens mask), vLLM's default `raw_logprobs` mode.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Collection

import torch

from kvscope.engine.sampling_params import TEMPERATURE_FLOOR, SamplingParams


@dataclass(slots=True)
class TokenLogprobs:
    """The sampled token's log-probability and the k most likely tokens (best first)."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]]


@dataclass(slots=True)
class SampleOutput:
    tokens: dict[int, int] = field(default_factory=dict)
    logprobs: dict[int, TokenLogprobs] = field(default_factory=dict)
    failures: dict[int, str] = field(default_factory=dict)  # req_id -> why its row could not be sampled


# req_id -> token ids that must not be sampled this step (min_tokens), or None
Suppressed = Callable[[int], Collection[int] | None]


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._generators: dict[int, torch.Generator] = {}

    def forget(self, req_ids: list[int]) -> None:
        for req_id in req_ids:
            self._generators.pop(req_id, None)

    def _generator(self, req_id: int, params: SamplingParams, device: torch.device) -> torch.Generator:
        gen = self._generators.get(req_id)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(params.seed if params.seed is not None else self.seed * 1_000_003 + req_id)
            self._generators[req_id] = gen
        return gen

    def sample(self, logits: torch.Tensor, req_ids: list[int], params: list[SamplingParams],
               suppressed: Suppressed | None = None) -> SampleOutput:
        """logits [N, V] (float32); one token per row, each row isolated from the others."""
        out = SampleOutput()
        greedy = logits.argmax(dim=-1).tolist()
        for row, (req_id, p) in enumerate(zip(req_ids, params)):
            try:
                banned = suppressed(req_id) if suppressed is not None else None
                if p.greedy and not banned:
                    token = greedy[row]
                else:
                    token = self._sample_row(req_id, logits[row], p, banned)
                if p.logprobs is not None:
                    out.logprobs[req_id] = token_logprobs(logits[row], token, p.logprobs)
                out.tokens[req_id] = token
            except Exception as e:  # noqa: BLE001 - any fault in one row ends that request only
                out.failures[req_id] = f"sampling failed: {type(e).__name__}: {e}"
        return out

    def _sample_row(self, req_id: int, logits: torch.Tensor, p: SamplingParams,
                    banned: Collection[int] | None) -> int:
        if banned:
            logits = logits.clone()
            logits[list(banned)] = float("-inf")
        if p.greedy:
            return int(logits.argmax().item())
        logits = logits / max(p.temperature, TEMPERATURE_FLOOR)
        if 0 < p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.min_p > 0.0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p; the top token always stays, so a
            # top_p that rounds to 0 in float32 still leaves one token to draw
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            drop[0] = False
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=self._generator(req_id, p, logits.device)).item())


def token_logprobs(logits: torch.Tensor, token: int, k: int) -> TokenLogprobs:
    """Raw log-softmax of one row: the chosen token's value and the top k."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    top: list[tuple[int, float]] = []
    if k:
        values, ids = torch.topk(logp, k)
        top = list(zip(ids.tolist(), values.tolist()))
    return TokenLogprobs(token, float(logp[token].item()), top)
