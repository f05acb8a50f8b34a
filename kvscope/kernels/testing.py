"""Random paged-attention cases for the kernel tests and benchmarks/gpu_check.py (not used by the engine)."""

from __future__ import annotations

import random

import torch

from kvscope.kernels.metadata import AttentionMetadata


def make_case(query_lens, seq_lens, *, heads, kv_heads, head_dim, block_size, dtype, device="cpu", seed=0,
              spare_blocks=3):
    """Random caches, shuffled block tables (so blocks are not in order), metadata and queries.

    Sequence s has seq_lens[s] tokens of context, the last query_lens[s] of them new this step.
    Returns (query [T, H, D], k_cache, v_cache, meta), all on device.
    """
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    nblocks = [-(-n // block_size) for n in seq_lens]
    total = sum(nblocks) + spare_blocks
    perm = list(range(total))
    rng.shuffle(perm)
    tables, at = [], 0
    for nb in nblocks:
        tables.append(perm[at : at + nb])
        at += nb
    width = max(nblocks)
    shape = (total, block_size, kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    v_cache = torch.randn(shape, generator=gen).to(device=device, dtype=dtype)
    qsl = [0]
    for q in query_lens:
        qsl.append(qsl[-1] + q)
    slots = []
    for q, n, t in zip(query_lens, seq_lens, tables):
        for pos in range(n - q, n):
            slots.append(t[pos // block_size] * block_size + pos % block_size)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=device),
        block_size=block_size, query_lens_host=list(query_lens), seq_lens_host=list(seq_lens),
    )
    query = torch.randn(qsl[-1], heads, head_dim, generator=gen).to(device=device, dtype=dtype)
    return query, k_cache, v_cache, meta


def poison_outside_window(k_cache, v_cache, meta: AttentionMetadata, window: int) -> None:
    """Point every block that no query of its sequence can see (wholly before the first query's
    window) at one NaN-filled block, as the engine's freed blocks are: a kernel that reads any
    of them, even masked, turns its output into NaN. Uses a spare block of make_case."""
    bs = meta.block_size
    held = {int(b) for s, n in enumerate(meta.seq_lens_host) for b in meta.block_tables[s, : -(-n // bs)].tolist()}
    nan_block = min(set(range(k_cache.shape[0])) - held)
    k_cache[nan_block] = float("nan")
    v_cache[nan_block] = float("nan")
    for s, (q, n) in enumerate(zip(meta.query_lens_host, meta.seq_lens_host)):
        dead = max(0, n - q - window + 1) // bs
        meta.block_tables[s, :dead] = nan_block
