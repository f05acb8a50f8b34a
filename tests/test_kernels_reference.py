"""The CPU attention path (kvscope.kernels.reference) against attention written out per query.

The engine's CPU path plans each step once (decode groups, masks, blocks to gather) and folds each KV
head's query group into the query length for decodes; whatever the plan, every query must get
softmax(q K^T * scale) V over exactly the keys it may see.
"""

from __future__ import annotations

import pytest
import torch

from kvscope.kernels import reference, testing


def attention_per_query(query, k_cache, v_cache, meta, scale, window=None):
    """Each query of each sequence over its visible keys, one at a time, in float32."""
    out = torch.empty(query.shape, dtype=torch.float32)
    qsl = meta.query_start_loc.tolist()
    bs = meta.block_size
    group = query.shape[1] // k_cache.shape[2]
    for s, (qlen, ctx) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        table = meta.block_tables[s].tolist()
        slots = [table[p // bs] * bs + p % bs for p in range(ctx)]
        keys = k_cache.reshape(-1, *k_cache.shape[2:])[slots].float()  # [ctx, KVH, D]
        values = v_cache.reshape(-1, *v_cache.shape[2:])[slots].float()
        for i in range(qlen):
            pos = ctx - qlen + i
            first = 0 if window is None else max(0, pos - window + 1)
            for h in range(query.shape[1]):
                q = query[qsl[s] + i, h].float()
                k, v = keys[first : pos + 1, h // group], values[first : pos + 1, h // group]
                weights = torch.softmax((k @ q) * scale, dim=0)
                out[qsl[s] + i, h] = weights @ v
    return out


CASES = [
    # (query_lens, seq_lens, heads, kv_heads, head_dim, block_size, window)
    ([1, 1, 1, 1], [17, 40, 33, 9], 4, 2, 16, 16, None),  # decodes only, spans a group apart
    ([5, 1, 1, 12, 1], [5, 70, 64, 30, 3], 8, 2, 16, 16, None),  # prefills between decodes: rows not contiguous
    ([1, 1, 1], [45, 64, 3], 8, 1, 16, 32, None),  # GQA ratio 8, block 32
    ([1, 7, 1, 1], [50, 20, 61, 38], 4, 2, 16, 8, 24),  # a sliding window, decodes and a prefill chunk
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("query_lens,seq_lens,heads,kv_heads,head_dim,block_size,window", CASES)
def test_every_query_attends_to_exactly_its_visible_keys(dtype, query_lens, seq_lens, heads, kv_heads, head_dim,
                                                         block_size, window):
    query, k_cache, v_cache, meta = testing.make_case(query_lens, seq_lens, heads=heads, kv_heads=kv_heads,
                                                      head_dim=head_dim, block_size=block_size, dtype=dtype)
    scale = head_dim ** -0.5
    got = reference.paged_attention(query, k_cache, v_cache, meta, scale, window)
    want = attention_per_query(query, k_cache, v_cache, meta, scale, window)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_a_step_is_planned_once_for_all_its_layers(monkeypatch):
    """Layers share the step's metadata, so the plan (groups, masks, blocks) is built on the first call only."""
    query, k_cache, v_cache, meta = testing.make_case([1, 6, 1], [30, 6, 20], heads=4, kv_heads=2, head_dim=16,
                                                      block_size=16, dtype=torch.float32)
    built = []
    real = reference._decode_group
    monkeypatch.setattr(reference, "_decode_group", lambda *a: built.append(a[1]) or real(*a))
    first = reference.paged_attention(query, k_cache, v_cache, meta, 0.25)
    groups, chunks = meta._reference_decode_plans[None], meta._reference_prefill_plans[None]
    assert built == [[0, 2]], "the two decodes go together, around the prefill between them"
    again = reference.paged_attention(query, k_cache * 2, v_cache, meta, 0.25)  # the next layer's K
    assert built == [[0, 2]], "the second layer reuses the plan"
    assert meta._reference_decode_plans == {None: groups} and meta._reference_prefill_plans == {None: chunks}
    assert not torch.equal(first, again) and [c.rows for c in chunks] == [slice(1, 7)]
