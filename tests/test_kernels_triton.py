"""Triton kernels against their torch references, on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here
at import time; nothing in kvscope imports triton outside kvscope.kernels.triton_*.
Shapes are tiny: interpreter time grows with grid size x loop trips. fp32 and
fp16 only (the interpreter's bf16 tl.dot is wrong); bf16 is checked on the GPU
by benchmarks/gpu_check.py.
"""

from __future__ import annotations

import os
import random

import torch  # noqa: E402  (torch does not import triton)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

from kvscope.kernels import reference  # noqa: E402
from kvscope.kernels import testing  # noqa: E402

from kvscope.kernels.triton import attention as triton_attention  # noqa: E402
from kvscope.kernels.triton import decode as triton_decode  # noqa: E402
from kvscope.kernels.triton import kv as triton_kv  # noqa: E402
from kvscope.kernels.triton import prefill as triton_prefill  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 2e-4, torch.float16: 2e-2}


def make_case(query_lens, seq_lens, **kw):
    return testing.make_case(query_lens, seq_lens, device=DEVICE, **kw)


def check(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_matches_reference_with_strided_input(dtype):
    gen = torch.Generator().manual_seed(1)
    t, kvh, d, bs, n = 7, 2, 16, 4, 6
    # [1, KVH, T, D] transposed to [T, KVH, D], as attention.py passes it
    key = torch.randn(1, kvh, t, d, generator=gen).to(dtype)[0].transpose(0, 1)
    value = torch.randn(1, kvh, t, d, generator=gen).to(dtype)[0].transpose(0, 1)
    slots = torch.tensor(random.Random(1).sample(range(n * bs), t), dtype=torch.long)
    caches = [torch.zeros(n, bs, kvh, d, dtype=dtype) for _ in range(4)]
    reference.write_kv(key, value, caches[0], caches[1], slots)
    triton_kv.write_kv(key, value, caches[2], caches[3], slots)
    assert torch.equal(caches[0], caches[2]) and torch.equal(caches[1], caches[3])


def test_write_kv_skips_negative_slots():
    key = torch.ones(3, 1, 16)
    k_cache, v_cache = torch.zeros(2, 4, 1, 16), torch.zeros(2, 4, 1, 16)
    triton_kv.write_kv(key, key * 2, k_cache, v_cache, torch.tensor([5, -1, 0]))
    assert k_cache.view(-1, 16).sum(1).tolist() == [16, 0, 0, 0, 0, 16, 0, 0]
    assert v_cache.view(-1, 16)[5].tolist() == [2.0] * 16


DECODE_CASES = [
    # (heads, kv_heads, head_dim, block_size, seq_lens, num_splits)
    (4, 4, 16, 16, [1, 17, 40], 1),  # GQA ratio 1, lengths off the block size
    (8, 2, 32, 16, [33, 5, 70], 3),  # ratio 4, split-KV with an empty split for the short sequence
    (8, 1, 16, 32, [45, 64, 3], 2),  # ratio 8, block 32
    (4, 1, 64, 16, [19], 4),  # head dim 64, one sequence split four ways
    (4, 2, 24, 16, [10, 33], 2),  # head dim not a power of two (padded, masked)
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens,num_splits", DECODE_CASES)
def test_decode_matches_reference(dtype, heads, kv_heads, head_dim, block_size, seq_lens, num_splits):
    query, k_cache, v_cache, meta = make_case([1] * len(seq_lens), seq_lens, heads=heads, kv_heads=kv_heads,
                                              head_dim=head_dim, block_size=block_size, dtype=dtype)
    scale = head_dim ** -0.5
    expected = reference.paged_attention(query, k_cache, v_cache, meta, scale)
    out = torch.empty_like(query)
    triton_decode.decode_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale, len(seq_lens), meta.max_seq_len,
                                   num_splits=num_splits, block_n=16)
    check(out, expected, dtype)


def test_num_splits_heuristic():
    cpu = torch.device("cpu")
    assert triton_decode.choose_num_splits(256, 8, 4096, cpu) == 1
    assert triton_decode.choose_num_splits(1, 1, 100, cpu) == 1  # too short to split
    assert 1 < triton_decode.choose_num_splits(1, 1, 4096, cpu) <= triton_decode.MAX_SPLITS


PREFILL_CASES = [
    # (heads, kv_heads, head_dim, block_size, query_lens, seq_lens)
    (2, 2, 16, 16, [20], [20]),  # whole prompt, ratio 1, two query tiles
    (4, 1, 16, 16, [9, 13], [30, 13]),  # extend over a cached prefix + a fresh prompt, ratio 4
    (8, 1, 32, 32, [5, 17], [41, 50]),  # ratio 8, block 32
    (4, 2, 24, 16, [7], [19]),  # head dim not a power of two
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,query_lens,seq_lens", PREFILL_CASES)
def test_prefill_matches_reference(dtype, heads, kv_heads, head_dim, block_size, query_lens, seq_lens):
    query, k_cache, v_cache, meta = make_case(query_lens, seq_lens, heads=heads, kv_heads=kv_heads,
                                              head_dim=head_dim, block_size=block_size, dtype=dtype, seed=3)
    scale = head_dim ** -0.5
    expected = reference.paged_attention(query, k_cache, v_cache, meta, scale)
    out = torch.empty_like(query)
    triton_prefill.prefill_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, scale, len(seq_lens), meta.max_query_len,
                                     block_m=16, block_n=16)
    check(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_mixed_step_write_then_attend(dtype):
    """A packed step as the engine builds it: a prefill chunk between decodes, K/V written first, strided query."""
    query_lens, seq_lens = [1, 11, 1], [23, 27, 6]
    heads, kv_heads, d, bs = 4, 2, 16, 16
    query, k_cache, v_cache, meta = make_case(query_lens, seq_lens, heads=heads, kv_heads=kv_heads, head_dim=d,
                                              block_size=bs, dtype=dtype, seed=5)
    gen = torch.Generator().manual_seed(6)
    t = sum(query_lens)
    key = torch.randn(t, kv_heads, d, generator=gen).to(dtype)
    value = torch.randn(t, kv_heads, d, generator=gen).to(dtype)
    strided_q = query.transpose(0, 1).contiguous().transpose(0, 1)  # [T, H, D] with head-major strides
    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    reference.write_kv(key, value, ref_k, ref_v, meta.slot_mapping)
    expected = reference.paged_attention(query, ref_k, ref_v, meta, d ** -0.5)
    triton_attention.write_kv(key, value, k_cache, v_cache, meta.slot_mapping)
    out = triton_attention.paged_attention(strided_q, k_cache, v_cache, meta, d ** -0.5)
    assert torch.equal(k_cache, ref_k) and torch.equal(v_cache, ref_v)
    check(out, expected, dtype)


WINDOW_DECODE_CASES = [
    # (heads, kv_heads, head_dim, block_size, seq_lens, window, num_splits)
    (4, 2, 16, 16, [1, 17, 40, 70], 24, 1),  # window not a multiple of the block; shorter and longer contexts
    (8, 2, 32, 16, [33, 5, 90], 16, 3),  # window = one block, split-KV over the window only
    (4, 1, 16, 8, [24, 25, 23], 24, 2),  # context equal to, one past and one short of the window
    (4, 4, 16, 16, [50, 9], 1, 1),  # window 1: each query sees only itself
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens,window,num_splits", WINDOW_DECODE_CASES)
def test_windowed_decode_matches_reference_and_skips_blocks_outside(dtype, heads, kv_heads, head_dim, block_size,
                                                                    seq_lens, window, num_splits):
    query, k_cache, v_cache, meta = make_case([1] * len(seq_lens), seq_lens, heads=heads, kv_heads=kv_heads,
                                              head_dim=head_dim, block_size=block_size, dtype=dtype, seed=9)
    scale = head_dim ** -0.5
    full = reference.paged_attention(query, k_cache, v_cache, meta, scale)
    testing.poison_outside_window(k_cache, v_cache, meta, window)
    expected = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    assert not expected.isnan().any(), "the reference read a block outside the window"
    if max(seq_lens) > window:
        assert not torch.allclose(expected.float(), full.float(), atol=TOL[dtype]), "the window changed nothing"
    out = torch.empty_like(query)
    triton_decode.decode_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale, len(seq_lens), meta.max_seq_len,
                                   num_splits=num_splits, block_n=16, window=window)
    check(out, expected, dtype)


def test_windowed_reference_equals_dense_sliding_mask():
    """The reference's window is transformers' rule: query p sees keys p-w+1 .. p (kv > q - w)."""
    heads, d, bs, w = 2, 16, 4, 6
    query, k_cache, v_cache, meta = make_case([9], [14], heads=heads, kv_heads=heads, head_dim=d, block_size=bs,
                                              dtype=torch.float32, seed=2)
    out = reference.paged_attention(query, k_cache, v_cache, meta, d ** -0.5, w)
    table = meta.block_tables[0].long()
    k = k_cache[table].reshape(-1, heads, d)[:14].transpose(0, 1)
    v = v_cache[table].reshape(-1, heads, d)[:14].transpose(0, 1)
    q_pos = torch.arange(5, 14)[:, None]
    kv_pos = torch.arange(14)[None, :]
    mask = (kv_pos <= q_pos) & (kv_pos > q_pos - w)
    dense = torch.nn.functional.scaled_dot_product_attention(query.transpose(0, 1), k, v, attn_mask=mask,
                                                             scale=d ** -0.5)
    torch.testing.assert_close(out, dense.transpose(0, 1), atol=1e-5, rtol=1e-5)


WINDOW_PREFILL_CASES = [
    # (heads, kv_heads, head_dim, block_size, query_lens, seq_lens, window)
    (2, 2, 16, 16, [40], [40], 24),  # whole prompt longer than the window
    (4, 1, 16, 16, [12, 10], [30, 10], 24),  # a chunk straddling the window edge + a prompt inside it
    (4, 2, 16, 8, [20, 7], [70, 24], 13),  # chunk far past the window (prefix blocks freed); window 13
    (2, 1, 16, 16, [17], [33], 16),  # chunk across a block boundary, window = block size
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,query_lens,seq_lens,window", WINDOW_PREFILL_CASES)
def test_windowed_prefill_matches_reference(dtype, heads, kv_heads, head_dim, block_size, query_lens, seq_lens,
                                            window):
    query, k_cache, v_cache, meta = make_case(query_lens, seq_lens, heads=heads, kv_heads=kv_heads,
                                              head_dim=head_dim, block_size=block_size, dtype=dtype, seed=4)
    scale = head_dim ** -0.5
    testing.poison_outside_window(k_cache, v_cache, meta, window)
    expected = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    assert not expected.isnan().any(), "the reference read a block outside the window"
    out = torch.empty_like(query)
    triton_prefill.prefill_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                     meta.query_start_loc, scale, len(seq_lens), meta.max_query_len,
                                     block_m=16, block_n=16, window=window)
    check(out, expected, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_windowed_mixed_step_through_dispatch(dtype):
    """Decodes and a prefill chunk in one packed step, windowed, through triton_attention's dispatch."""
    query_lens, seq_lens = [1, 11, 1], [43, 37, 6]
    query, k_cache, v_cache, meta = make_case(query_lens, seq_lens, heads=4, kv_heads=2, head_dim=16,
                                              block_size=8, dtype=dtype, seed=8)
    testing.poison_outside_window(k_cache, v_cache, meta, 20)
    expected = reference.paged_attention(query, k_cache, v_cache, meta, 0.25, 20)
    check(triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.25, 20), expected, dtype)
