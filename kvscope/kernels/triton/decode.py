"""Triton paged decode attention: one query token per sequence, read over its block table.

Two paths behind one entry point, decode_attention (see docs/KERNELS.md):

- One pass (large batches): the grid is (sequences, KV heads); each program walks its
  sequence's whole context and writes the output.
- Split-K, flash-decoding (small batches): the grid is (sequences, KV heads, partitions).
  Each partition program walks an equal share of its sequence's tiles and writes a
  partial output (normalised by its own softmax sum) and its log-sum-exp; _reduce_kernel
  then combines a sequence's partitions. The share is worked out on the device from that
  sequence's own length, and the partition count is a runtime argument, so one compiled
  kernel serves every count (no recompiles as contexts grow) and a fixed count also works
  inside a CUDA graph (short sequences just leave some partitions empty).
  choose_num_splits picks the count; 1 means the one-pass path.

Both paths share the inner walk:
- GQA sharing: one program serves all query heads of one KV head, so each K/V
  tile is read once per group, not once per query head. The group's heads are
  the rows of a [G_PAD, D] query tile (padded to 16 rows for tl.dot).
- Wide tiles: a program walks its keys BLOCK_N tokens at a time (several
  cache blocks per tile), gathering each token's row through the block table.
- Sliding window: with a window w, the query at position seq_len-1 sees keys
  seq_len-w .. seq_len-1. The tiles (and so the partitions) cover only that span, so
  a tile wholly outside the window is never visited, not visited and masked.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvscope.kernels.triton.softmax import attend_tile

MAX_SPLITS = 64
# choose_num_splits' constants (see its docstring for the reasoning):
PROGRAMS_PER_SM = 4  # split until the grid holds about this many programs per SM
MIN_PARTITION_TOKENS = 128  # shortest partition while the unsplit grid leaves SMs idle (two 64-token tiles)
MIN_PARTITION_TOKENS_BUSY = 512  # shortest partition once the unsplit grid already covers every SM
REDUCE_CHUNK = 16  # partitions the reduce reads per load: at most 4 loads for MAX_SPLITS
_SM_COUNT: dict[int, int] = {}


@triton.jit
def _span(seq_len, window, HAS_WINDOW: tl.constexpr):
    """The first key the query at position seq_len - 1 sees: 0, or seq_len - window with a window."""
    if HAS_WINDOW:
        first = tl.maximum(seq_len - window, 0)
    else:
        first = seq_len * 0
    return first


@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(q_ptr, k_ptr, v_ptr, bt_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr, out_ptr, part_o_ptr, part_lse_ptr,
                   sm_scale_log2, window, num_splits, stride_qt, stride_qh, stride_ot, stride_oh, stride_cb,
                   stride_co, stride_ch, stride_bt,
                   H: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
                   HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr, IEEE: tl.constexpr):
    i = tl.program_id(0)
    kvh = tl.program_id(1)
    if HAS_SEQ_IDS:
        s = tl.load(seq_ids_ptr + i)
    else:
        s = i
    seq_len = tl.load(seq_lens_ptr + s)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    first = _span(seq_len, window, HAS_WINDOW)
    if SPLIT:
        # partition `split` takes tiles [split * per_split, (split + 1) * per_split) of the span
        split = tl.program_id(2)
        per_split = tl.cdiv(tl.cdiv(seq_len - first, BLOCK_N), num_splits)
        start = first + split * per_split * BLOCK_N
        end = tl.minimum(start + per_split * BLOCK_N, seq_len)
    else:
        start = first
        end = seq_len

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
    if SPLIT:
        # A partition past the end of a short sequence has no keys: it writes nothing, and the reduce
        # reads only the partitions that hold keys (each has at least one, so l > 0 here).
        live = gmask & (start + offs_g * 0 < end)  # [G_PAD]: the group's heads, if the partition has keys
        o = acc / tl.maximum(l, 1.0e-30)[:, None]
        lse = m + tl.log2(tl.maximum(l, 1.0e-30))
        part = (i.to(tl.int64) * H + heads) * num_splits + split
        tl.store(part_lse_ptr + part, lse, mask=live)
        tl.store(part_o_ptr + part[:, None] * D_PAD + offs_d[None, :], o, mask=live[:, None] & dmask[None, :])
    else:
        o = acc / l[:, None]
        tl.store(out_ptr + row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=omask)


@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(part_o_ptr, part_lse_ptr, seq_lens_ptr, qsl_ptr, seq_ids_ptr, out_ptr, window, num_splits,
                   stride_ot, stride_oh,
                   H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr, BLOCK_N: tl.constexpr, CHUNK: tl.constexpr,
                   HAS_SEQ_IDS: tl.constexpr, HAS_WINDOW: tl.constexpr):
    """Combine one (sequence, query head)'s partitions: out = sum_j o_j 2^lse_j / sum_j 2^lse_j.

    Only the partitions that hold keys are read (the same share rule as _decode_kernel), so a count
    fixed for the longest context costs a short sequence nothing here. They are read CHUNK at a time
    (one load of CHUNK log-sum-exps and CHUNK partial rows), folded in by an online softmax."""
    i = tl.program_id(0)
    h = tl.program_id(1)
    if HAS_SEQ_IDS:
        s = tl.load(seq_ids_ptr + i)
    else:
        s = i
    seq_len = tl.load(seq_lens_ptr + s)
    row = tl.load(qsl_ptr + s).to(tl.int64)
    tiles = tl.cdiv(seq_len - _span(seq_len, window, HAS_WINDOW), BLOCK_N)
    per_split = tl.maximum(tl.cdiv(tiles, num_splits), 1)
    used = tl.cdiv(tiles, per_split)
    offs_s = tl.arange(0, CHUNK)
    offs_d = tl.arange(0, D_PAD)
    base = (i.to(tl.int64) * H + h) * num_splits
    m = tl.load(part_lse_ptr + base)  # partition 0 always holds keys: a finite start for the running max
    l = m * 0.0
    acc = tl.zeros([D_PAD], dtype=tl.float32)
    for c0 in range(0, used, CHUNK):
        idx = c0 + offs_s
        smask = idx < used
        lse = tl.load(part_lse_ptr + base + idx, mask=smask, other=float("-inf"))
        o = tl.load(part_o_ptr + (base + idx)[:, None] * D_PAD + offs_d[None, :], mask=smask[:, None], other=0.0)
        m_new = tl.maximum(m, tl.max(lse, 0))
        alpha = tl.exp2(m - m_new)
        w = tl.exp2(lse - m_new)  # 0 for the masked lanes
        acc = acc * alpha + tl.sum(o * w[:, None], 0)
        l = l * alpha + tl.sum(w, 0)
        m = m_new
    tl.store(out_ptr + row * stride_ot + h * stride_oh + offs_d, (acc / l).to(out_ptr.dtype.element_ty),
             mask=offs_d < D)


def _sm_count(device: torch.device) -> int:
    if device.type != "cuda":
        return 4  # interpreter runs on CPU: keep grids small
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def choose_num_splits(num_seqs: int, num_kv_heads: int, max_seq_len: int, device: torch.device,
                      sm_count: int | None = None) -> int:
    """Partitions per sequence for a decode launch; 1 means the one-pass kernel.

    The one-pass grid has num_seqs x num_kv_heads programs, and a decode reads memory, so it
    wants every SM busy with a few programs to hide the latency of the block-table gathers.
    - Parallelism: split until the grid holds about PROGRAMS_PER_SM programs per SM (the SM
      count from torch.cuda). From PROGRAMS_PER_SM x SMs programs up this is 1: large batches
      keep the one-pass kernel, with no partial outputs and no reduce.
    - Length: a partition costs a program's set-up, a partial output and a share of the
      reduce, so it must hold enough keys to pay for them. While the unsplit grid leaves SMs
      idle (num_seqs x num_kv_heads < SMs) a partition may be as short as MIN_PARTITION_TOKENS:
      the step is latency-bound and shortening each program's walk is what helps. Once the
      unsplit grid covers every SM, a partition must hold MIN_PARTITION_TOKENS_BUSY keys: on an
      H200, 256-token partitions read at 1.2-1.6 TB/s where 512-token-and-longer walks read at
      3.6-4.2 TB/s (benchmarks/results/gpu-check-h200.json).
    - At most MAX_SPLITS.
    max_seq_len is the longest span a sequence attends over (the window, when shorter).
    """
    sms = sm_count or _sm_count(device)
    programs = max(1, num_seqs * num_kv_heads)
    by_parallelism = triton.cdiv(PROGRAMS_PER_SM * sms, programs)
    shortest = MIN_PARTITION_TOKENS if programs < sms else MIN_PARTITION_TOKENS_BUSY
    by_length = max(1, max_seq_len // shortest)
    return max(1, min(by_parallelism, by_length, MAX_SPLITS))


def decode_attention(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, out: torch.Tensor,
                     block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                     scale: float, num_seqs: int, max_seq_len: int, seq_ids: torch.Tensor | None = None,
                     num_splits: int | None = None, block_n: int | None = None,
                     window: int | None = None) -> None:
    """Decode attention for num_seqs sequences (seq_ids, or 0..num_seqs-1), one query row each at qsl[s].

    query/out [T, H, D] with unit last stride; caches [N, block_size, KVH, D] contiguous.
    window: the sliding window (keys seq_len-window .. seq_len-1), or None for the whole context.
    num_splits: partitions per sequence (None: choose_num_splits); 1 runs the one-pass kernel,
    more the split-K kernel and its reduce.
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
    num_splits = max(1, min(num_splits, MAX_SPLITS))
    ieee = query.dtype == torch.float32
    if ieee and query.device.type == "cuda":
        block_n = min(block_n, 32)  # fp32 tiles take twice the shared memory
    split = num_splits > 1
    if split:
        part_o = torch.empty(num_seqs, h, num_splits, d_pad, dtype=torch.float32, device=query.device)
        part_lse = torch.empty(num_seqs, h, num_splits, dtype=torch.float32, device=query.device)
    else:
        part_o = part_lse = out  # unused
    has_ids = seq_ids is not None
    ids = seq_ids if has_ids else seq_lens  # any pointer; unread without HAS_SEQ_IDS
    _decode_kernel[(num_seqs, kvh, num_splits)](
        query, k_cache, v_cache, block_tables, seq_lens, query_start_loc, ids, out, part_o, part_lse,
        scale * 1.4426950408889634, window or 0, num_splits, query.stride(0), query.stride(1), out.stride(0),
        out.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), block_tables.stride(0),
        H=h, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, D_PAD=d_pad,
        BLOCK_SIZE=block_size, BLOCK_N=block_n, SPLIT=split, HAS_SEQ_IDS=has_ids,
        HAS_WINDOW=window is not None, IEEE=ieee, num_warps=4, num_stages=2,
    )
    if split:
        _reduce_kernel[(num_seqs, h)](
            part_o, part_lse, seq_lens, query_start_loc, ids, out, window or 0, num_splits, out.stride(0),
            out.stride(1), H=h, D=d, D_PAD=d_pad, BLOCK_N=block_n, CHUNK=REDUCE_CHUNK, HAS_SEQ_IDS=has_ids,
            HAS_WINDOW=window is not None, num_warps=4,
        )
