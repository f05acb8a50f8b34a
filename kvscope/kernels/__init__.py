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
    """Triton kernels on CUDA; on a CPU the C++ kernel that reads the KV pages in place
    (cpu_attention.py: compiled once per machine, here on first use where no cached build
    exists); torch references where that did not build, with KVSCOPE_CPU_ATTENTION=reference,
    and on any other device.

    The Triton modules are imported only here and only for CUDA, so the CPU path
    never imports triton (and tests can switch on its interpreter first).
    """
    if device_type == "cuda":
        from kvscope.kernels.triton import attention as triton_attention

        return AttentionOps("triton", triton_attention.write_kv, triton_attention.paged_attention)
    if device_type == "cpu":
        from kvscope.kernels.cpu import library as cpu_attention

        if not cpu_attention.forced_reference() and cpu_attention.load() is not None:
            return AttentionOps("cpu-paged", cpu_attention.write_kv, cpu_attention.paged_attention)
    return AttentionOps("torch-reference", reference.write_kv, reference.paged_attention)


__all__ = ["AttentionMetadata", "AttentionOps", "select_attention_ops"]
