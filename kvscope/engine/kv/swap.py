"""Swap-to-CPU preemption's bookkeeping: the CPU block pool the scheduler owns (torch-free).

The scheduler owns a :class:`CpuBlockPool`: swapping a victim out takes CPU blocks
for the KV it has computed and pairs them with its GPU blocks
(``SchedulerOutput.blocks_to_swap_out``, (gpu, cpu) pairs); swapping it back in
takes fresh GPU blocks and returns the CPU ones (``blocks_to_swap_in``, (cpu, gpu)
pairs). :class:`KvSwapper` performs the copies each step before the forward, in
the order that keeps every source intact: swap out, then copy-on-write copies, then
swap in. KvSwapper (engine/worker/swapper.py) does the copies with torch; this module stays torch-free.
"""

from __future__ import annotations

from collections import deque



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
