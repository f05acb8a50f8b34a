"""Triton paged prefill/extend attention over a packed varlen batch.

Each sequence brings query_len new tokens at positions seq_len - query_len ..
seq_len - 1; they attend over the cached prefix and the causal triangle of the
chunk itself, all read through the block table (the chunk's own K/V are already
written). Grid: (sequences, query heads, query tiles of BLOCK_M rows). Keys are
walked BLOCK_N at a time up to the tile's last query position; only the tiles
that touch the diagonal need the causal mask, but one masked loop keeps it short.
With a sliding window w, query position p sees keys p-w+1 .. p: the walk starts
at the tile's first query's window start, and the mask adds the lower bound.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.triton.softmax import attend_tile


@triton.jit
def _prefill_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr, out_ptr,
                    sm_scale_log2, window, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb, stride_co, stride_ch,
                    stride_bt,
                    G: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr,
                    IEEE: tl.constexpr):
    i = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    if HAS_SEQ_IDS:
        s = tl.load(seq_ids_ptr + i)
    else:
        s = i
    q_start = tl.load(qsl_ptr + s)
    q_len = tl.load(qsl_ptr + s + 1) - q_start
    if mt * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + s)
        prefix = seq_len - q_len
        kvh = h // G
        offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, D_PAD)
        offs_n = tl.arange(0, BLOCK_N)
        mmask = offs_m < q_len
        dmask = offs_d < D
        q_pos = prefix + offs_m
        rows = (q_start + offs_m).to(tl.int64)
        q = tl.load(q_ptr + rows[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                    mask=mmask[:, None] & dmask[None, :], other=0.0)
        m = tl.full([BLOCK_M], -1.0e30, dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], dtype=tl.float32)
        bt_row = bt_ptr + s.to(tl.int64) * stride_bt
        end = tl.minimum(seq_len, prefix + (mt + 1) * BLOCK_M)
        if HAS_WINDOW:
            first = tl.maximum(prefix + mt * BLOCK_M - window + 1, 0)
        else:
            first = end * 0
        for n0 in range(first, end, BLOCK_N):
            pos = n0 + offs_n
            nmask = pos < end
            blk = tl.load(bt_row + pos // BLOCK_SIZE, mask=nmask, other=0).to(tl.int64)
            kv_off = (blk * stride_cb + (pos % BLOCK_SIZE) * stride_co + kvh * stride_ch)[:, None] + offs_d[None, :]
            kv_mask = nmask[:, None] & dmask[None, :]
            k = tl.load(k_ptr + kv_off, mask=kv_mask, other=0.0)
            v = tl.load(v_ptr + kv_off, mask=kv_mask, other=0.0)
            visible = nmask[None, :] & (pos[None, :] <= q_pos[:, None])
            if HAS_WINDOW:
                visible = visible & (pos[None, :] > q_pos[:, None] - window)
            m, l, acc = attend_tile(q, k, v, visible, m, l, acc, sm_scale_log2, IEEE)
        o = acc / l[:, None]
        tl.store(out_ptr + rows[:, None] * stride_ot + h * stride_oh + offs_d[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=mmask[:, None] & dmask[None, :])


def prefill_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                      block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                      scale: float, num_seqs: int, max_query_len: int, seq_ids: torch.Tensor | None = None,
                      block_m: int | None = None, block_n: int | None = None, window: int | None = None) -> None:
    """Prefill/extend attention for num_seqs sequences (seq_ids, or 0..num_seqs-1) of the packed batch.

    window: the sliding window (query position p sees keys p-window+1 .. p), or None for causal attention.
    """
    if num_seqs == 0 or max_query_len == 0:
        return
    _, h, d = query.shape
    _, block_size, kvh, _ = k_cache.shape
    d_pad = max(16, triton.next_power_of_2(d))
    ieee = query.dtype == torch.float32
    on_gpu = query.device.type == "cuda"
    if block_m is None:
        block_m = 32 if (ieee and on_gpu) or d_pad > 128 else 64
    if block_n is None:
        block_n = 32 if (ieee and on_gpu) or d_pad > 128 else 64
    has_ids = seq_ids is not None
    grid = (num_seqs, h, triton.cdiv(max_query_len, block_m))
    _prefill_kernel[grid](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, seq_ids if has_ids else seq_lens, out,
        scale * 1.4426950408889634, window or 0, query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        G=h // kvh, D=d, D_PAD=d_pad, BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        HAS_SEQ_IDS=has_ids, HAS_WINDOW=window is not None, IEEE=ieee, num_warps=4, num_stages=2,
    )
