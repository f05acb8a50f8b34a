"""Attention kernels. The one place that chooses an implementation for a device."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvscope.kernels import reference
from kvscope.kernels.metadata import AttentionMetadata


@dataclass(frozen=True)
class AttentionOps:
    name: str
    write_kv: Callable
    paged_attention: Callable


def select_attention_ops(device_type: str) -> AttentionOps:
    """Triton kernels on CUDA, torch references everywhere else.

    The Triton modules are imported only here and only for CUDA, so the CPU path
    never imports triton (and tests can switch on its interpreter first).
    """
    if device_type == "cuda":
        from kvscope.kernels import triton_attention

        return AttentionOps("triton", triton_attention.write_kv, triton_attention.paged_attention)
    return AttentionOps("torch-reference", reference.write_kv, reference.paged_attention)


__all__ = ["AttentionMetadata", "AttentionOps", "select_attention_ops"]
