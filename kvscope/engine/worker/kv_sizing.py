"""How big the KV cache is: bytes per block, the CPU budget from available memory, the GPU budget
from a profiled step, and the CPU pool's allocation.

- CPU: `kv_cache_space` GiB if given (an error if it is more than the memory available), else
  CPU_KV_CACHE_FRACTION of MemAvailable (read after the weights are loaded), capped at
  CPU_KV_CACHE_CAP_BYTES and at what max_num_seqs sequences of max_model_len tokens could ever use.
  vLLM's CPU backend takes the same knob as VLLM_CPU_KVCACHE_SPACE.
- CUDA: run the real runner over one worst-case step of max_num_batched_tokens tokens, note the
  activation peak, and give the KV cache what remains of gpu_memory_utilization x total memory after
  everything already resident (weights, CUDA context, other processes) and that peak.
"""

from __future__ import annotations

import mmap
import os
from dataclasses import dataclass

from kvscope.engine.kv.block_manager import blocks_needed
from kvscope.errors import KvscopeError

GiB = 1 << 30
CPU_KV_CACHE_FRACTION = 0.5  # of MemAvailable: leaves room for activations, watchers and other programs
CPU_KV_CACHE_CAP_BYTES = 4 * GiB  # vLLM's long-standing VLLM_CPU_KVCACHE_SPACE default
GRAPH_MEMORY_RESERVE = 256 << 20  # bytes kept back for the CUDA graphs' private memory pool


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


def zeroed_cpu_tensor(shape: tuple[int, ...], dtype):
    """A zero tensor whose pages the OS commits only when first written (anonymous mmap), so a large
    KV pool costs memory as blocks are used, not at start-up. torch.zeros would touch every page.

    Private, not shared: a shared anonymous map is shmem, whose first write of a page cost 1.5x a private
    one's here (0.65 against 0.42 s a GiB), paid in the steps that first fill the pool. No huge pages: with
    the kernel's usual defrag=madvise, MADV_HUGEPAGE made a first write 0.13-2.5 s a GiB (direct
    compaction), a stall a step cannot afford."""
    import math

    import torch

    elem = torch.empty((), dtype=dtype).element_size()
    nbytes = math.prod(shape) * elem
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    buf = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)  # zero-filled, lazily committed
    return torch.frombuffer(buf, dtype=dtype).view(shape)


def cuda_kv_budget(make_runner, device, *, max_len: int, block_size: int, max_num_batched_tokens: int,
                   max_num_seqs: int, gpu_memory_utilization: float, cuda_graphs: bool) -> KvBudget:
    """util x total, less what is resident and the activation peak of one worst-case step, run by
    make_runner(num_blocks) (the engine's own runner class over a KV cache just big enough)."""
    import torch

    from kvscope.engine.sampling_params import SamplingParams

    n = max(1, min(max_num_batched_tokens, max_len))
    out, nblocks = profile_step(n, min(n, max_num_seqs), block_size)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    runner = make_runner(nblocks)
    greedy = SamplingParams(temperature=0.0)
    runner.run(out, {s.req_id: greedy for s in out.seqs})
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - base
    del runner
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    resident = total - free  # weights, CUDA context, library workspaces, other processes
    reserve = GRAPH_MEMORY_RESERVE if cuda_graphs else 0
    budget = int(total * gpu_memory_utilization) - resident - peak - reserve
    return KvBudget(max(0, budget), f"gpu_memory_utilization {gpu_memory_utilization:g} of "
                                    f"{total / GiB:.0f} GiB, less {resident / GiB:.1f} GiB resident and a "
                                    f"{peak / GiB:.2f} GiB activation peak")


def profile_step(num_tokens: int, num_seqs: int, block_size: int):
    """The worst step the scheduler can hand the runner: num_tokens in all, num_seqs sequences that all
    sample (one long prefill plus single tokens). Returns it and the blocks it covers."""
    from kvscope.engine.sched.output import ScheduledSeq, SchedulerOutput

    out = SchedulerOutput(step=0, budget=num_tokens)
    lengths = [num_tokens - (num_seqs - 1)] + [1] * (num_seqs - 1)
    first = 0
    for req_id, length in enumerate(lengths):
        nb = blocks_needed(length, block_size)
        out.add(ScheduledSeq(req_id, [0] * length, 0, list(range(first, first + nb)), True, True))
        first += nb
    return out, first
