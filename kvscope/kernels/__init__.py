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
    """Torch references everywhere for now; the Triton kernels take over on CUDA once they land."""
    return AttentionOps("torch-reference", reference.write_kv, reference.paged_attention)


__all__ = ["AttentionMetadata", "AttentionOps", "select_attention_ops"]
