"""Torch reference kernels. The Triton kernels keep the same signatures.

Shapes: query [T, H, D]; key/value [T, KVH, D]; k_cache/v_cache [num_blocks, block_size, KVH, D].
Query heads h use KV head h // (H // KVH), as in grouped-query attention.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass
class _DecodeGroup:
    rows: torch.Tensor | slice  # the group's query rows (a slice where they are contiguous: no gather)
    block_ids: torch.Tensor  # [G * nb] int64: the blocks to gather, row by row (from each row's window start)
    span: int  # keys gathered per row (the longest row's span; the rest masked)
    visible: torch.Tensor  # [G, 1, 1, span] bool


@dataclass
class _Prefill:
    rows: slice
    block_ids: torch.Tensor
    span: int
    mask: torch.Tensor | None  # [qlen, span] bool; None: plain causal over the whole context


def _block_ids(block_tables: torch.Tensor, span: int, bs: int, first_block: torch.Tensor | None) -> torch.Tensor:
    nb = -(-span // bs)
    if first_block is None:
        ids = block_tables[:, :nb]
    else:
        cols = first_block[:, None] + torch.arange(nb, device=block_tables.device)[None, :]
        # past a row's last block: any valid id (those positions are masked)
        ids = block_tables.gather(1, cols.clamp_max(block_tables.shape[1] - 1))
    return ids.reshape(-1).long()


def _first_key(meta: AttentionMetadata, s: int, window: int | None) -> int:
    """The block-aligned position of the first key any query of sequence s reads."""
    if window is None:
        return 0
    start = meta.seq_lens_host[s] - meta.query_lens_host[s]  # first query position
    return max(0, start - window + 1) // meta.block_size * meta.block_size


def _decode_groups(meta: AttentionMetadata, window: int | None, dev: torch.device) -> list[_DecodeGroup]:
    """Decodes: batched, in groups of similar span (context, or window, length).

    Each step's plan (here and in _prefill_chunks) is worked out once and cached on the metadata, as the
    Triton path's is: which decodes go together, which blocks each gathers, and the masks. Layers
    differ only in their K/V."""
    plans = meta.__dict__.setdefault("_reference_decode_plans", {})
    if window in plans:
        return plans[window]
    qsl = meta.query_start_loc.tolist()
    decodes = [s for s in range(meta.num_seqs) if meta.query_lens_host[s] == 1]

    def first_key(s: int) -> int:
        return _first_key(meta, s, window)

    groups = []
    span = {s: meta.seq_lens_host[s] - first_key(s) for s in decodes}
    decodes.sort(key=lambda s: span[s])
    while decodes:
        group = [decodes.pop()]
        longest = span[group[0]]
        # A new group starts where padding to `longest` would more than double the work.
        while (decodes and (len(group) + 1) * longest <= _DECODE_GROUP_TOKENS
               and 2 * span[decodes[-1]] >= longest):
            group.append(decodes.pop())
        group.sort()
        groups.append(_decode_group(meta, group, longest, qsl, first_key, window, dev))
    plans[window] = groups
    return groups


def _prefill_chunks(meta: AttentionMetadata, window: int | None, dev: torch.device) -> list[_Prefill]:
    """Prefill chunks: one at a time, over the cached prefix (or its window) plus the causal chunk."""
    plans = meta.__dict__.setdefault("_reference_prefill_plans", {})
    if window in plans:
        return plans[window]
    qsl = meta.query_start_loc.tolist()
    bs = meta.block_size
    chunks = []
    for s in range(meta.num_seqs):
        if meta.query_lens_host[s] <= 1:
            continue
        start, qlen, ctx = qsl[s], meta.query_lens_host[s], meta.seq_lens_host[s]
        first = _first_key(meta, s, window)
        first_block = torch.tensor([first // bs], device=dev) if first else None
        mask = None
        if not (ctx == qlen and window is None):
            q_pos = torch.arange(ctx - qlen, ctx, device=dev)[:, None]
            key_pos = torch.arange(first, ctx, device=dev)[None, :]
            mask = key_pos <= q_pos
            if window is not None:
                mask &= key_pos > q_pos - window
        chunks.append(_Prefill(slice(start, start + qlen),
                               _block_ids(meta.block_tables[s : s + 1], ctx - first, bs, first_block), ctx - first,
                               mask))
    plans[window] = chunks
    return chunks


def _decode_group(meta: AttentionMetadata, group: list[int], longest: int, qsl: list[int], first_key,
                  window: int | None, dev: torch.device) -> _DecodeGroup:
    bs = meta.block_size
    idx = torch.tensor(group, device=dev)
    row_list = [qsl[s] for s in group]
    rows = (slice(row_list[0], row_list[-1] + 1) if row_list == list(range(row_list[0], row_list[-1] + 1))
            else torch.tensor(row_list, device=dev))
    firsts = torch.tensor([first_key(s) for s in group], device=dev)
    first_block = firsts // bs if window is not None else None
    lens = meta.seq_lens[idx].to(dev)
    key_pos = firsts[:, None] + torch.arange(longest, device=dev)[None, :]  # [G, longest]
    visible = key_pos < lens[:, None]
    if window is not None:
        visible &= key_pos > (lens[:, None] - 1) - window
    return _DecodeGroup(rows, _block_ids(meta.block_tables[idx], longest, bs, first_block), longest,
                        visible[:, None, None, :])


def _gather_blocks(cache: torch.Tensor, block_ids: torch.Tensor, rows: int, span: int) -> torch.Tensor:
    """The blocks' keys or values as [rows, KVH, span, D] (a strided view of one copy)."""
    _, bs, kvh, d = cache.shape
    # index_select on the block dimension copies whole blocks in one pass (several times
    # faster on CPU than advanced indexing with a 2-D index).
    return cache.index_select(0, block_ids).view(rows, -1, kvh, d)[:, :span].transpose(1, 2)


def paged_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    meta: AttentionMetadata, scale: float, window: int | None = None) -> torch.Tensor:
    """Causal attention of each sequence's new queries over its paged context, or over a sliding window of it.

    Query i of sequence s sits at position p = seq_len - query_len + i and sees keys 0..p, or with
    a window w only keys p-w+1..p (transformers' sliding_window_overlay). Blocks wholly before
    the window are never read, so their table entries may be anything (freed blocks).
    Call after write_kv, so the new tokens' own K/V are in the cache.
    """
    out = torch.empty_like(query)
    kvh, d = k_cache.shape[2], query.shape[2]
    g = query.shape[1] // kvh
    for grp in _decode_groups(meta, window, query.device):
        rows = grp.visible.shape[0]
        k = _gather_blocks(k_cache, grp.block_ids, rows, grp.span).to(query.dtype)
        v = _gather_blocks(v_cache, grp.block_ids, rows, grp.span).to(query.dtype)
        # Each KV head's query group is folded into the query length: [G, KVH, H // KVH, D]. A decode
        # query sees every visible key, so the group's rows share one mask. On a CPU this is several
        # times faster than enable_gqa's one query row per head in bf16 (about 5x at Qwen3-0.6B's
        # shape: the flash kernel's per-row set-up dominates a single row) and equal in float32.
        q = query[grp.rows].view(rows, kvh, g, d)
        o = F.scaled_dot_product_attention(q, k, v, attn_mask=grp.visible, scale=scale)
        out[grp.rows] = o.reshape(rows, kvh * g, d)
    attend_prefills(query, k_cache, v_cache, meta, scale, window, out)
    return out


def attend_prefills(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                    scale: float, window: int | None, out: torch.Tensor) -> None:
    """paged_attention's rows of sequences with more than one query (prefill chunks), written into out.
    Also used by the CPU kernel's path, which reads decodes in place but leaves chunks to SDPA."""
    for chunk in _prefill_chunks(meta, window, query.device):
        k = _gather_blocks(k_cache, chunk.block_ids, 1, chunk.span).to(query.dtype)
        v = _gather_blocks(v_cache, chunk.block_ids, 1, chunk.span).to(query.dtype)
        q = query[chunk.rows].transpose(0, 1).unsqueeze(0)  # [1, H, qlen, D]
        if chunk.mask is None:
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        else:
            o = F.scaled_dot_product_attention(q, k, v, attn_mask=chunk.mask, scale=scale, enable_gqa=True)
        out[chunk.rows] = o[0].transpose(0, 1)
