"""Swap-to-CPU preemption's block copies (torch): the CPU cache, and each step's copies out and in before the
forward. The bookkeeping is the scheduler's (kvscope.engine.kv.swap.CpuBlockPool)."""

from __future__ import annotations

from kvscope.engine.worker.kv_sizing import zeroed_cpu_tensor


class KvSwapper:
    """Applies a step's swap and copy-on-write lists to the KV cache tensors."""

    def __init__(self, gpu_cache, num_cpu_blocks: int) -> None:
        import torch

        self.gpu_cache = gpu_cache  # [layers, 2, blocks, block_size, kv_heads, head_dim]
        shape = list(gpu_cache.shape)
        shape[2] = max(0, num_cpu_blocks)
        if gpu_cache.device.type == "cuda":  # pinned, for fast copies over the host link
            self.cpu_cache = torch.zeros(shape, dtype=gpu_cache.dtype, device="cpu", pin_memory=True)
        else:  # pages committed as blocks are swapped out, not swap_space GiB at start-up
            self.cpu_cache = zeroed_cpu_tensor(tuple(shape), gpu_cache.dtype)

    def apply(self, swap_out: list[tuple[int, int]], copies: list[tuple[int, int]],
              swap_in: list[tuple[int, int]]) -> None:
        import torch

        gpu, cpu = self.gpu_cache, self.cpu_cache
        dev = gpu.device
        if swap_out:
            src = torch.tensor([g for g, _ in swap_out], dtype=torch.long, device=dev)
            dst = torch.tensor([c for _, c in swap_out], dtype=torch.long)
            cpu[:, :, dst] = gpu[:, :, src].to("cpu")
        if copies:
            src = torch.tensor([s for s, _ in copies], dtype=torch.long, device=dev)
            dst = torch.tensor([d for _, d in copies], dtype=torch.long, device=dev)
            gpu[:, :, dst] = gpu[:, :, src]
        if swap_in:
            src = torch.tensor([c for c, _ in swap_in], dtype=torch.long)
            dst = torch.tensor([g for _, g in swap_in], dtype=torch.long, device=dev)
            gpu[:, :, dst] = cpu[:, :, src].to(dev, non_blocking=False)

