"""Triton paged attention for a packed step: decodes to the decode kernel, prefill chunks to the prefill kernel.

Same signature as reference.paged_attention. Which sequences are decodes is read
from the metadata's host lists, once per step (the plan is cached on the
metadata object and reused by every layer).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvscope.kernels.metadata import AttentionMetadata
from kvscope.kernels.triton.decode import decode_attention
from kvscope.kernels.triton.kv import write_kv
from kvscope.kernels.triton.prefill import prefill_attention

__all__ = ["paged_attention", "write_kv"]


@dataclass
class _Plan:
    num_decodes: int
    decode_ids: torch.Tensor | None  # None: the decodes are exactly sequences 0..num_decodes-1
    decode_max_len: int
    num_prefills: int
    prefill_ids: torch.Tensor | None
    prefill_max_q: int


def _plan(meta: AttentionMetadata, device: torch.device) -> _Plan:
    plan = getattr(meta, "_triton_plan", None)
    if plan is not None:
        return plan
    qlens = meta.query_lens_host
    decodes = [s for s, n in enumerate(qlens) if n == 1]
    prefills = [s for s, n in enumerate(qlens) if n > 1]

    def ids(seqs: list[int]) -> torch.Tensor | None:
        if not seqs or seqs == list(range(len(seqs))):
            return None
        return torch.tensor(seqs, dtype=torch.int32, device=device)

    plan = _Plan(
        num_decodes=len(decodes), decode_ids=ids(decodes),
        decode_max_len=max((meta.seq_lens_host[s] for s in decodes), default=0),
        num_prefills=len(prefills), prefill_ids=ids(prefills),
        prefill_max_q=max((qlens[s] for s in prefills), default=0),
    )
    meta._triton_plan = plan
    return plan


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context (or the last `window`
    keys of each query); call after write_kv."""
    if query.stride(-1) != 1:
        query = query.contiguous()
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    plan = _plan(meta, query.device)
    if plan.num_decodes:
        decode_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                         scale, plan.num_decodes, plan.decode_max_len, seq_ids=plan.decode_ids, window=window)
    if plan.num_prefills:
        prefill_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens, meta.query_start_loc,
                          scale, plan.num_prefills, plan.prefill_max_q, seq_ids=plan.prefill_ids, window=window)
    return out
