"""Triton KV write: scatter this step's K and V rows into their paged cache slots.

Same signature as reference.write_kv. One program per new token copies all of
its KV heads (K and V) to slot_mapping[t]; a negative slot (a padding row of a
CUDA-graph batch) is skipped.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, k_cache_ptr, v_cache_ptr, slot_ptr,
                     stride_kt, stride_kh, stride_vt, stride_vh,
                     stride_cb, stride_co, stride_ch, block_size,
                     KVH: tl.constexpr, D: tl.constexpr, HD_PAD: tl.constexpr):
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t).to(tl.int64)
    if slot >= 0:
        offs = tl.arange(0, HD_PAD)
        h = offs // D
        d = offs % D
        mask = offs < KVH * D
        blk = slot // block_size
        off = slot % block_size
        dst = blk * stride_cb + off * stride_co + h * stride_ch + d
        k = tl.load(key_ptr + t.to(tl.int64) * stride_kt + h * stride_kh + d, mask=mask)
        v = tl.load(value_ptr + t.to(tl.int64) * stride_vt + h * stride_vh + d, mask=mask)
        tl.store(k_cache_ptr + dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_cache_ptr + dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """key/value [T, KVH, D] (any strides with a unit last stride); caches [N, block_size, KVH, D] contiguous."""
    t, kvh, d = key.shape
    if t == 0:
        return
    if key.stride(2) != 1:
        key = key.contiguous()
    if value.stride(2) != 1:
        value = value.contiguous()
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and k_cache.stride() == v_cache.stride()
    _write_kv_kernel[(t,)](
        key, value, k_cache, v_cache, slot_mapping,
        key.stride(0), key.stride(1), value.stride(0), value.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), k_cache.shape[1],
        KVH=kvh, D=d, HD_PAD=triton.next_power_of_2(kvh * d),
    )
