"""The worker's side of KV sizing: the GPU budget from a profiled step, and the CPU pool's allocation.
Bytes per block and the CPU budget are torch-free (kvscope.engine.kv.budget).

- CUDA: run the real runner over one worst-case step of max_num_batched_tokens tokens, note the
  activation peak, and give the KV cache what remains of gpu_memory_utilization x total memory after
  everything already resident (weights, CUDA context, other processes) and that peak.
"""

from __future__ import annotations

import mmap

from kvscope.engine.kv.block_manager import blocks_needed
from kvscope.engine.kv.budget import GiB, KvBudget

GRAPH_MEMORY_RESERVE = 256 << 20  # bytes kept back for the CUDA graphs' private memory pool


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
