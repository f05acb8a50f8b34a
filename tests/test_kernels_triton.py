"""Triton kernels against their torch references, on CPU through Triton's interpreter.

TRITON_INTERPRET must be set before triton is first imported, so it is set here
at import time; nothing in kvscope imports triton outside kvscope.kernels.triton_*.
Shapes are tiny: interpreter time grows with grid size x loop trips. fp32 and
fp16 only (the interpreter's bf16 tl.dot is wrong); bf16 is checked on the GPU
by bench/gpu_check.py.
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

from kvscope.kernels import triton_attention, triton_decode, triton_kv, triton_prefill  # noqa: E402

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
