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


def _gather(cache: torch.Tensor, block_tables: torch.Tensor, length: int,
            first_block: torch.Tensor | None = None) -> torch.Tensor:
    """[S, nb] block ids -> [S, KVH, length, D] keys or values (a strided view of one copy).

    With first_block ([S] logical block indices), row s starts at its own block first_block[s]:
    token j of the result is at position first_block[s] * block_size + j.
    """
    _, bs, kvh, d = cache.shape
    nb = -(-length // bs)
    if first_block is None:
        ids = block_tables[:, :nb]
    else:
        cols = first_block.long()[:, None] + torch.arange(nb, device=block_tables.device)[None, :]
        # past a row's last block: any valid id (those positions are masked)
        ids = block_tables.gather(1, cols.clamp_max(block_tables.shape[1] - 1))
    # index_select on the block dimension copies whole blocks in one pass (several times
    # faster on CPU than advanced indexing with a 2-D index).
    ids = ids.reshape(-1).long()
    blocks = cache.index_select(0, ids).view(block_tables.shape[0], nb * bs, kvh, d)
    return blocks[:, :length].transpose(1, 2)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context, or over a sliding window of it.

    Query i of sequence s sits at position p = seq_len - query_len + i and sees keys 0..p, or with
    a window w only keys p-w+1..p (transformers' sliding_window_overlay). Blocks wholly before
    the window are never read, so their table entries may be anything (freed blocks).
    Call after write_kv, so the new tokens' own K/V are in the cache.
    """
    out = torch.empty_like(query)
    qsl = meta.query_start_loc.tolist()
    bs = meta.block_size
    dev = query.device
    decodes = [s for s in range(meta.num_seqs) if meta.query_lens_host[s] == 1]
    prefills = [s for s in range(meta.num_seqs) if meta.query_lens_host[s] > 1]

    def first_key(s: int) -> int:
        """The block-aligned position of the first key any query of s reads."""
        if window is None:
            return 0
        start = meta.seq_lens_host[s] - meta.query_lens_host[s]  # first query position
        return max(0, start - window + 1) // bs * bs

    # Decodes: batched, in groups of similar span (context, or window, length).
    span = {s: meta.seq_lens_host[s] - first_key(s) for s in decodes}
    decodes.sort(key=lambda s: span[s])
    while decodes:
        group = [decodes.pop()]
        longest = span[group[0]]
        # A new group starts where padding to `longest` would more than double the work.
        while (decodes and (len(group) + 1) * longest <= _DECODE_GROUP_TOKENS
               and 2 * span[decodes[-1]] >= longest):
            group.append(decodes.pop())
        idx = torch.tensor(group, device=dev)
        rows = torch.tensor([qsl[s] for s in group], device=dev)
        firsts = torch.tensor([first_key(s) for s in group], device=dev)
        first_block = firsts // bs if window is not None else None
        k = _gather(k_cache, meta.block_tables[idx], longest, first_block)
        v = _gather(v_cache, meta.block_tables[idx], longest, first_block)
        lens = meta.seq_lens[idx].to(dev)
        key_pos = firsts[:, None] + torch.arange(longest, device=dev)[None, :]  # [G, longest]
        visible = key_pos < lens[:, None]
        if window is not None:
            visible &= key_pos > (lens[:, None] - 1) - window
        # Each KV head's query group is folded into the query length: [G, KVH, H // KVH, D]. A decode
        # query sees every visible key, so the group's rows share one mask. On a CPU this is several
        # times faster than enable_gqa's one query row per head in bf16 (about 5x at Qwen3-0.6B's
        # shape: the flash kernel's per-row set-up dominates a single row) and equal in float32.
        kvh, d = k.shape[1], query.shape[2]
        g = query.shape[1] // kvh
        q = query[rows].view(len(group), kvh, g, d)
        o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=visible[:, None, None, :],
                                           scale=scale)
        out[rows] = o.reshape(len(group), kvh * g, d)

    # Prefill chunks: one at a time, over the cached prefix (or its window) plus the causal chunk.
    for s in prefills:
        start, qlen, ctx = qsl[s], meta.query_lens_host[s], meta.seq_lens_host[s]
        first = first_key(s)
        first_block = torch.tensor([first // bs], device=dev) if first else None
        k = _gather(k_cache, meta.block_tables[s : s + 1], ctx - first, first_block)
        v = _gather(v_cache, meta.block_tables[s : s + 1], ctx - first, first_block)
        q = query[start : start + qlen].transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
        if ctx == qlen and window is None:
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), is_causal=True, scale=scale,
                                               enable_gqa=True)
        else:
            q_pos = torch.arange(ctx - qlen, ctx, device=dev)[:, None]
            key_pos = torch.arange(first, ctx, device=dev)[None, :]
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
            o = F.scaled_dot_product_attention(q, k.to(q.dtype), v.to(q.dtype), attn_mask=mask, scale=scale,
                                               enable_gqa=True)
        out[start : start + qlen] = o[0].transpose(0, 1)
    return out
