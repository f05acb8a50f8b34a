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


@pytest.mark.parametrize("batch,ctx,splits", [
    (256, 4096, 1),  # 2,048 programs: the one-pass kernel
    (64, 4096, 2),  # 512 programs fill every SM; two 2k partitions bring ~4 per SM
    (64, 512, 1),  # every SM busy already: no partition under 512 keys
    (16, 4096, 5),  # 128 programs < 132 SMs: split to about 4 programs per SM
    (16, 512, 4),  # SMs idle: partitions as short as 128 keys
    (1, 512, 4),
    (1, 4096, 32),
    (1, 16384, 64),  # capped at MAX_SPLITS
    (1, 200, 1),  # too short for two 128-key partitions
])
def test_split_heuristic_on_an_h200_shape(batch, ctx, splits):
    """Qwen3-0.6B-shaped decodes (8 KV heads) on 132 SMs: the partitions chosen, and why."""
    assert triton_decode.choose_num_splits(batch, 8, ctx, torch.device("cpu"), sm_count=132) == splits


def test_split_heuristic_properties():
    for sms in (4, 78, 132):
        for batch in (1, 2, 3, 16, 64, 256):
            for kvh in (1, 8):
                for ctx in (1, 100, 513, 4096, 40960):
                    n = triton_decode.choose_num_splits(batch, kvh, ctx, torch.device("cpu"), sm_count=sms)
                    assert 1 <= n <= triton_decode.MAX_SPLITS
                    if batch * kvh >= triton_decode.PROGRAMS_PER_SM * sms:
                        assert n == 1  # large batches: one pass
                    if n > 1:
                        shortest = (triton_decode.MIN_PARTITION_TOKENS if batch * kvh < sms
                                    else triton_decode.MIN_PARTITION_TOKENS_BUSY)
                        assert ctx // n >= shortest


SPLITK_CASES = [
    # (heads, kv_heads, head_dim, block_size, seq_lens, num_splits); block_n is 16, so a tile is 16 keys
    (4, 4, 16, 16, [1], 4),  # B=1, one key: one live partition, three empty
    (8, 2, 16, 16, [16], 3),  # B=1, exactly one block and one tile
    (8, 2, 16, 8, [77], 3),  # B=1, 5 tiles over 3 partitions (2, 2, 1), ragged last block of 8
    (8, 1, 32, 16, [130], 8),  # B=1, GQA 8: 9 tiles over 8 partitions of 2: 5 live, 3 empty
    (4, 2, 16, 16, [1, 37, 100], 4),  # B=3: 1, 3 and 4 live partitions
    (8, 2, 24, 32, [64, 65, 3], 2),  # B=3, a tile boundary on either side, head dim padded, block 32
    (4, 1, 16, 16, [300, 40], 20),  # 19 live partitions, read by the reduce in two chunks; 3 live beside it
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("heads,kv_heads,head_dim,block_size,seq_lens,num_splits", SPLITK_CASES)
def test_split_k_decode_matches_reference_and_the_one_pass_kernel(dtype, heads, kv_heads, head_dim, block_size,
                                                                  seq_lens, num_splits, monkeypatch):
    query, k_cache, v_cache, meta = make_case([1] * len(seq_lens), seq_lens, heads=heads, kv_heads=kv_heads,
                                              head_dim=head_dim, block_size=block_size, dtype=dtype, seed=11)
    scale = head_dim ** -0.5
    expected = reference.paged_attention(query, k_cache, v_cache, meta, scale)

    def run(splits):
        out = torch.full_like(query, float("nan"))
        triton_decode.decode_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                       meta.query_start_loc, scale, len(seq_lens), meta.max_seq_len,
                                       num_splits=splits, block_n=16)
        return out

    one_pass = run(1)
    # partial buffers start as NaN: a partition without keys is neither written nor read by the reduce
    real_empty = torch.empty
    monkeypatch.setattr(triton_decode.torch, "empty",
                        lambda *a, **kw: real_empty(*a, **kw).fill_(float("nan")))
    split = run(num_splits)
    check(split, expected, dtype)
    check(split, one_pass, dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_k_decode_with_window_and_seq_ids(dtype):
    """Sliding window over partitions, blocks outside it NaN, and a sequence subset (a mixed step's decodes)."""
    seq_lens, window = [90, 5, 41], 37
    query, k_cache, v_cache, meta = make_case([1] * 3, seq_lens, heads=8, kv_heads=2, head_dim=16, block_size=8,
                                              dtype=dtype, seed=12)
    scale = 16 ** -0.5
    testing.poison_outside_window(k_cache, v_cache, meta, window)
    expected = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    ids = torch.tensor([2, 0], dtype=torch.int32)
    out = torch.zeros_like(query)
    triton_decode.decode_attention(query, k_cache, v_cache, out, meta.block_tables, meta.seq_lens,
                                   meta.query_start_loc, scale, 2, 90, seq_ids=ids, num_splits=3, block_n=16,
                                   window=window)
    check(out[[2, 0]], expected[[2, 0]], dtype)
    assert not out[1].any()  # sequence 1 was not asked for


def test_dispatch_takes_the_split_path_for_a_small_batch(monkeypatch):
    """paged_attention with one long sequence chooses partitions itself and matches the reference."""
    query, k_cache, v_cache, meta = make_case([1], [300], heads=4, kv_heads=1, head_dim=16, block_size=16,
                                              dtype=torch.float32, seed=13)
    chosen = []
    real = triton_decode.choose_num_splits
    monkeypatch.setattr(triton_decode, "choose_num_splits", lambda *a, **kw: chosen.append(real(*a, **kw))
                        or chosen[-1])
    out = triton_attention.paged_attention(query, k_cache, v_cache, meta, 0.25)
    assert chosen == [2]  # 1 program on the interpreter's 4 "SMs"; 300 keys make two 128-key partitions
    check(out, reference.paged_attention(query, k_cache, v_cache, meta, 0.25), torch.float32)


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
