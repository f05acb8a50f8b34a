"""How big the KV cache is: bytes per block, and the CPU budget from available memory (torch-free; the GPU
budget, which profiles a step, and the CPU pool's allocation are the worker's: engine/worker/kv_sizing.py).

- CPU: `kv_cache_space` GiB if given (an error if it is more than the memory available), else
  CPU_KV_CACHE_FRACTION of MemAvailable (read after the weights are loaded), capped at
  CPU_KV_CACHE_CAP_BYTES and at what max_num_seqs sequences of max_model_len tokens could ever use.
  vLLM's CPU backend takes the same knob as VLLM_CPU_KVCACHE_SPACE.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from kvscope.errors import KvscopeError

GiB = 1 << 30
CPU_KV_CACHE_FRACTION = 0.5  # of MemAvailable: leaves room for activations, watchers and other programs
CPU_KV_CACHE_CAP_BYTES = 4 * GiB  # vLLM's long-standing VLLM_CPU_KVCACHE_SPACE default


@dataclass(frozen=True)
class KvBudget:
    """Bytes the KV cache may take, and how that figure was chosen (for the start-up line)."""

    bytes: int
    how: str


def kv_bytes_per_block(num_layers: int, num_kv_heads: int, head_dim: int, block_size: int, elem_bytes: int) -> int:
    """K and V of every layer for block_size tokens."""
    return num_layers * 2 * block_size * num_kv_heads * head_dim * elem_bytes


def available_memory_bytes() -> int:
    """Memory the kernel says a new allocation can get without swapping (MemAvailable)."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    try:  # not Linux: free pages, an underestimate (it leaves out reclaimable cache)
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, AttributeError):
        return CPU_KV_CACHE_CAP_BYTES


def cpu_kv_budget(space_gib: float | None, *, need_bytes: int, available: int) -> KvBudget:
    """The CPU KV budget: kv_cache_space if given, else a capped share of `available`."""
    if space_gib is not None:
        wanted = int(space_gib * GiB)
        if wanted > available:
            raise KvscopeError(f"kv_cache_space {space_gib:g} GiB does not fit: "
                               f"{available / GiB:.1f} GiB of memory is available")
        return KvBudget(wanted, f"kv_cache_space {space_gib:g} GiB")
    share = int(available * CPU_KV_CACHE_FRACTION)
    budget = min(share, CPU_KV_CACHE_CAP_BYTES, need_bytes)
    if budget == need_bytes:
        how = "enough for max_num_seqs x max_model_len"
    elif budget == share:
        how = f"{CPU_KV_CACHE_FRACTION:.0%} of {available / GiB:.1f} GiB available"
    else:
        how = f"capped at {CPU_KV_CACHE_CAP_BYTES / GiB:g} GiB ({available / GiB:.1f} GiB available)"
    return KvBudget(budget, how)


def num_blocks_for(budget: KvBudget, block_bytes: int) -> int:
    n = int(budget.bytes // block_bytes)
    if n < 1:
        raise KvscopeError(f"the KV cache ({budget.how}) holds no block: one block of KV takes "
                           f"{block_bytes / (1 << 20):.2f} MiB")
    return n
