"""Turns the last-position logits of each sampled sequence into one token."""

from __future__ import annotations

import torch

from kvscope.engine.sampling_params import SamplingParams


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

    def sample(self, logits: torch.Tensor, req_ids: list[int], params: list[SamplingParams]) -> list[int]:
        """logits [N, V] (float32); one token per row."""
        tokens = logits.argmax(dim=-1).tolist()
        for row, (req_id, p) in enumerate(zip(req_ids, params)):
            if p.greedy:
                continue
            tokens[row] = self._sample_row(logits[row], p, self._generator(req_id, p, logits.device))
        return tokens

    @staticmethod
    def _sample_row(logits: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        logits = logits / p.temperature
        if p.top_k > 0 and p.top_k < logits.shape[-1]:
            kth = torch.topk(logits, p.top_k).values[-1]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1)
        if p.top_p < 1.0:
            sorted_probs, order = torch.sort(probs, descending=True)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            drop = sorted_probs.cumsum(-1) - sorted_probs >= p.top_p
            sorted_probs = sorted_probs.masked_fill(drop, 0.0)
            probs = torch.zeros_like(probs).scatter(0, order, sorted_probs)
        return int(torch.multinomial(probs, 1, generator=gen).item())
