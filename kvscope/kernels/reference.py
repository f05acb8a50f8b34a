"""Torch reference kernels. The Triton kernels keep the same signatures.

Shapes: query [T, H, D]; key/value [T, KVH, D]; k_cache/v_cache [num_blocks, block_size, KVH, D].
Query heads h use KV head h // (H // KVH), as in grouped-query attention.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvscope.kernels.metadata import AttentionMetadata

# Cap on gathered K elements per decode group, so a batch mixing one long and many
# short contexts is not padded to the longest all at once.
_DECODE_GROUP_TOKENS = 1 << 18


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Scatter this step's K and V into their cache slots."""
    kvh, d = key.shape[1], key.shape[2]
    k_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, key.to(k_cache.dtype))
    v_cache.view(-1, kvh, d).index_copy_(0, slot_mapping, value.to(v_cache.dtype))


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int) -> torch.Tensor:
    """[S, nb] block ids -> [S, KVH, length, D] keys or values (a strided view of one copy)."""
    _, bs, kvh, d = cache.shape
    nb = -(-length // bs)
    ids = block_tables[:, :nb].reshape(-1).long()
    # index_select on the block dimension copies whole blocks in one pass (several times
    # faster on CPU than advanced indexing with a 2-D index).
    blocks = cache.index_select(0, ids).view(block_tables.shape[0], nb * bs, kvh, d)
    return blocks[:, :length].transpose(1, 2)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its whole paged context.

    Query i of sequence s sits at position seq_len - query_len + i and sees keys 0..that position.
    Call after write_kv, so the new tokens' own K/V are in the cache.
    """
    out = torch.empty_like(query)
    qsl = meta.query_start_loc.tolist()
    decodes = [s for s in range(meta.num_seqs) if meta.query_lens_host[s] == 1]
    prefills = [s for s in range(meta.num_seqs) if meta.query_lens_host[s] > 1]

    # Decodes: batched, in groups of similar context length.
    decodes.sort(key=lambda s: meta.seq_lens_host[s])
    while decodes:
        group = [decodes.pop()]
        longest = meta.seq_lens_host[group[0]]
        # A new group starts where padding to `longest` would more than double the work.
        while (decodes and (len(group) + 1) * longest <= _DECODE_GROUP_TOKENS
               and 2 * meta.seq_lens_host[decodes[-1]] >= longest):
            group.append(decodes.pop())
        idx = torch.tensor(group, device=query.device)
        rows = torch.tensor([qsl[s] for s in group], device=query.device)
        k = _gather(k_cache, meta.block_tables[idx], longest)
        v = _gather(v_cache, meta.block_tables[idx], longest)
        lens = meta.seq_lens[idx].to(query.device)
        mask = (torch.arange(longest, device=query.device)[None, :] < lens[:, None])[:, None, None, :]
        q = query[rows].unsqueeze(2)  # [G, H, 1, D]
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                           enable_gqa=True)
        out[rows] = o.squeeze(2)

    # Prefill chunks: one at a time, over the cached prefix plus the causal chunk.
    for s in prefills:
        start, qlen, ctx = qsl[s], meta.query_lens_host[s], meta.seq_lens_host[s]
        k = _gather(k_cache, meta.block_tables[s : s + 1], ctx)
        v = _gather(v_cache, meta.block_tables[s : s + 1], ctx)
        q = query[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
        if ctx == qlen:
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - qlen, ctx, device=query.device)
            mask = torch.arange(ctx, device=query.device)[None, :] <= q_pos[:, None]
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start : start + qlen] = o[0].transpose(0, 1)
    return out
