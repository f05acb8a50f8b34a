"""Swap-to-CPU preemption: the CPU block pool (bookkeeping) and the block copies (torch).

The scheduler owns a :class:`CpuBlockPool`: swapping a victim out takes CPU blocks
for the KV it has computed and pairs them with its GPU blocks
(``SchedulerOutput.blocks_to_swap_out``, (gpu, cpu) pairs); swapping it back in
takes fresh GPU blocks and returns the CPU ones (``blocks_to_swap_in``, (cpu, gpu)
pairs). :class:`KvSwapper` performs the copies each step before the forward, in
the order that keeps every source intact: swap out, then copy-on-write copies, then
swap in. torch is imported only by KvSwapper, so the scheduler stays torch-free.
"""

from __future__ import annotations

from collections import deque

from kvscope.engine.kv_sizing import zeroed_cpu_tensor


class CpuBlockPool:
    """Fixed pool of CPU KV blocks with per-request tables; pure bookkeeping."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = max(0, num_blocks)
        self._free: deque[int] = deque(range(self.num_blocks))
        self.tables: dict[int, list[int]] = {}
        self.blocks_out = 0  # blocks copied GPU -> CPU since start
        self.blocks_in = 0  # blocks copied CPU -> GPU since start

    @property
    def num_free(self) -> int:
        return len(self._free)

    @property
    def num_used(self) -> int:
        return self.num_blocks - len(self._free)

    def can_hold(self, n: int) -> bool:
        return n <= len(self._free)

    def swap_out(self, req_id: int, gpu_blocks: list[int]) -> list[tuple[int, int]]:
        """Take CPU blocks for gpu_blocks; returns (gpu, cpu) copy pairs."""
        assert req_id not in self.tables, f"request {req_id} is already swapped out"
        assert len(gpu_blocks) <= len(self._free), "swap pool too small"
        cpu = [self._free.popleft() for _ in gpu_blocks]
        self.tables[req_id] = cpu
        self.blocks_out += len(cpu)
        return list(zip(gpu_blocks, cpu))

    def swap_in(self, req_id: int, gpu_blocks: list[int]) -> list[tuple[int, int]]:
        """Return req_id's CPU blocks to the pool; returns (cpu, gpu) copy pairs."""
        cpu = self.tables.pop(req_id)
        assert len(cpu) == len(gpu_blocks), "swap-in block count differs from swap-out"
        self._free.extend(cpu)
        self.blocks_in += len(cpu)
        return list(zip(cpu, gpu_blocks))

    def drop(self, req_id: int) -> None:
        """Forget a swapped request without copying back (it was aborted)."""
        self._free.extend(self.tables.pop(req_id, ()))

    def check_invariants(self) -> None:
        held = [b for t in self.tables.values() for b in t]
        assert len(set(held)) == len(held), "a CPU block is held twice"
        assert not set(held) & set(self._free), "a CPU block is both held and free"
        assert len(held) + len(self._free) == self.num_blocks, "swap pool leaked blocks"


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

