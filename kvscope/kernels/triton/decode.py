"""Triton paged decode attention: one query token per sequence, read over its block table.

Design (see docs/KERNELS.md):
- GQA sharing: one program serves all query heads of one KV head, so each K/V
  tile is read once per group, not once per query head. The group's heads are
  the rows of a [G_PAD, D] query tile (padded to 16 rows for tl.dot).
- Wide tiles: a program walks its context BLOCK_N tokens at a time (several
  cache blocks per tile), gathering each token's row through the block table.
- Split-KV (flash-decoding): the grid is (sequences, KV heads, splits). Each
  split takes an equal share of its sequence's tiles, decided on the device from
  that sequence's length, so a fixed split count also works inside a CUDA graph.
  Splits write a partial output and its log-sum-exp; a merge kernel combines them.
- Sliding window: with a window w, the query at position seq_len-1 sees keys
  seq_len-w .. seq_len-1. The tiles (and so the splits) cover only that span, so
  a tile wholly outside the window is never visited, not visited and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.triton.softmax import attend_tile

MAX_SPLITS = 64
MIN_SPLIT_TOKENS = 256  # a split shorter than this costs more to merge than it saves
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                   sm_scale_log2, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_co, stride_ch,
                   stride_bt,
                   H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, NUM_SPLITS: tl.constexpr,
                   HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if HAS_SEQ_IDS:
        s = tl.load(seq_ids_ptr + i)
    else:
        s = i
    seq_len = tl.load(seq_lens_ptr + s)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    tiles = tl.cdiv(seq_len - first, BLOCK_N)
    per_split = tl.cdiv(tiles, NUM_SPLITS)
    start = first + split * per_split * BLOCK_N
    end = tl.minimum(start + per_split * BLOCK_N, seq_len)

    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    offs_n = tl.arange(0, BLOCK_N)
    heads = kvh * G + offs_g
    gmask = offs_g < G
    dmask = offs_d < D
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
                mask=gmask[:, None] & dmask[None, :], other=0.0)

    m = tl.full([G_PAD], -1.0e30, dtype=tl.float32)
    l = tl.zeros([G_PAD], dtype=tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], dtype=tl.float32)
    bt_row = bt_ptr + s.to(tl.int64) * stride_bt
    for n0 in range(start, end, BLOCK_N):
        pos = n0 + offs_n
        nmask = pos < end
        blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
        base = blk * stride_cb + (pos % BLOCK_SIZE) * stride_co + kvh * stride_ch
        kv_off = base[:, None] + offs_d[None, :]
        kv_mask = nmask[:, None] & dmask[None, :]
        k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
        m, l, acc = attend_tile(q, k, v, nmask[None, :], m, l, acc, sm_scale_log2, IEEE)

    omask = gmask[:, None] & dmask[None, :]
    if NUM_SPLITS == 1:
        o = acc / l[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)
    else:
        o = acc / tl.maximum(l, 1.0e-30)[:, None]
        lse = tl.where(l > 0, m + tl.log2(tl.maximum(l, 1.0e-30)), float("-inf"))
        part = (i.to(tl.int64) * H + heads) * NUM_SPLITS + split
        tl.store(part_lse_ptr + part, lse, mask=gmask)
        tl.store(part_o_ptr + part[:, None] * D_PAD + offs_d[None, :], o, mask=omask)


@triton.jit
def _merge_kernel(part_o_ptr, part_lse_ptr, qsl_ptr, seq_ids_ptr, out_ptr, stride_ot, stride_oh,
                  H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, NUM_SPLITS: tl.constexpr,
                  SPLITS_PAD: tl.constexpr, HAS_SEQ_IDS: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_SEQ_IDS:
        s = tl.load(seq_ids_ptr + i)
    else:
        s = i
    row = tl.load(qsl_ptr + s).to(tl.int64)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, D_PAD)
    smask = offs_s < NUM_SPLITS
    base = (i.to(tl.int64) * H + h) * NUM_SPLITS
    lse = tl.load(part_lse_ptr + base + offs_s, mask=smask, other=float("-inf"))
    w = tl.exp2(lse - tl.max(lse, 0))
    w = w / tl.sum(w, 0)
    o = tl.load(part_o_ptr + (base + offs_s)[:, None] * D_PAD + offs_d[None, :], mask=smask[:, None], other=0.0)
    res = tl.sum(o * w[:, None], 0)
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, res.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs on CPU: keep grids small
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device) -> int:
    """Enough programs to fill the GPU about four times over, but no split under MIN_SPLIT_TOKENS."""
    programs = max(1, num_seqs * num_kv_heads)
    by_parallelism = triton.cdiv(4 * _sm_count(device), programs)
    by_length = triton.cdiv(max(1, max_seq_len), MIN_SPLIT_TOKENS)
    return max(1, min(by_parallelism, by_length, MAX_SPLITS))


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     scale: float, num_seqs: int, max_seq_len: int, seq_ids: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int | None = None,
                     window: int | None = None) -> None:
    """Decode attention for num_seqs sequences (seq_ids, or 0..num_seqs-1), one query row each at qsl[s].

    query/out [T, H, D] with unit last stride; caches [N, block_size, KVH, D] contiguous.
    window: the sliding window (keys seq_len-window .. seq_len-1), or None for the whole context.
    """
    if num_seqs == 0:
        return
    _, h, d = query.shape
    _, block_size, kvh, _ = k_cache.shape
    g = h // kvh
    d_pad = max(16, triton.next_power_of_2(d))
    if block_n is None:
        block_n = 64 if d_pad <= 128 else 32
    if num_splits is None:
        span = max_seq_len if window is None else min(max_seq_len, window)
        num_splits = choose_num_splits(num_seqs, kvh, span, query.device)
    ieee = query.dtype == torch.float32
    if ieee and query.device.type == "cuda":
        block_n = min(block_n, 32)  # fp32 tiles take twice the shared memory
    if num_splits > 1:
        part_o = torch.empty(num_seqs, h, num_splits, d_pad, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, h, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out  # unused
    has_ids = seq_ids is not None
    ids = seq_ids if has_ids else seq_lens  # any pointer; unread without HAS_SEQ_IDS
    _decode_kernel[(num_seqs, kvh, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, ids, out, part_o, part_lse,
        scale * 1.4426950408889634, window or 0, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        H=h, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, NUM_SPLITS=num_splits, HAS_SEQ_IDS=has_ids,
        HAS_WINDOW=window is not None, IEEE=ieee, num_warps=4, num_stages=2,
    )
    if num_splits > 1:
        _merge_kernel[(num_seqs, h)](
            part_o, part_lse, query_start_loc, ids, out, out.stride(0), out.stride(1),
            H=h, D=d, D_PAD=d_pad, NUM_SPLITS=num_splits, SPLITS_PAD=max(2, triton.next_power_of_2(num_splits)),
            HAS_SEQ_IDS=has_ids, num_warps=4,
        )
