"""CUDA graphs for decode steps (KV sizing, the GPU path's other start-up job, is in kv_sizing.py and kv/budget.py).

A decode-only step launches a few hundred small
kernels per forward, so its CPU launch cost can exceed its GPU time. The whole
forward is captured once per batch size in CAPTURE_SIZES (up to max_num_seqs),
over static input and metadata buffers; a step pads its batch to the nearest
captured size, copies its inputs into the buffers and replays. Padding rows
write nowhere (slot -1) and attend over one token of block 0; their logits are
dropped. The decode kernel's split count is fixed at capture for the longest
context (each split then covers an equal share of its sequence's actual length).

Only imported on CUDA; nothing here runs on CPU.
"""

from __future__ import annotations

import sys

import torch

from kvscope.engine.worker import attention
from kvscope.engine.sched.output import SchedulerOutput
from kvscope.kernels import AttentionMetadata


def capture_sizes(max_batch: int) -> list[int]:
    """1, 2, 4, 8, then every 8 up to 256, then every 32; always ending at max_batch."""
    sizes = [s for s in (1, 2, 4) if s < max_batch]
    s = 8
    while s < max_batch:
        sizes.append(s)
        s += 8 if s < 256 else 32
    sizes.append(max_batch)
    return sizes


class DecodeGraphs:
    """CUDA graphs of the model's forward for decode-only steps, one per captured batch size."""

    def __init__(self, runner, max_batch: int, max_model_len: int) -> None:
        self.runner = runner
        dev = runner.device
        self.sizes = capture_sizes(max(1, max_batch))
        big = self.sizes[-1]
        self.block_size = runner.block_size
        self.max_model_len = max_model_len
        self.width = -(-max_model_len // self.block_size)
        self.input_ids = torch.zeros(1, big, dtype=torch.long, device=dev)
        self.positions = torch.zeros(1, big, dtype=torch.long, device=dev)
        self.slots = torch.full((big,), -1, dtype=torch.long, device=dev)
        self.seq_lens = torch.ones(big, dtype=torch.int32, device=dev)
        self.qsl = torch.arange(big + 1, dtype=torch.int32, device=dev)
        self.block_tables = torch.zeros(big, self.width, dtype=torch.int32, device=dev)
        self.keep = torch.arange(big, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        # One metadata object per size, over views of the static buffers. The split count is fixed for
        # the longest context (seq_lens_host), since it is baked into the captured launch.
        self.metas = {b: AttentionMetadata(
            slot_mapping=self.slots[:b], query_start_loc=self.qsl[: b + 1], seq_lens=self.seq_lens[:b],
            block_tables=self.block_tables[:b], block_size=self.block_size, query_lens_host=[1] * b,
            seq_lens_host=[max_model_len] * b) for b in self.sizes}

    def forward_static(self, b: int) -> torch.Tensor:
        """The forward a graph of size b captures: over the static buffers, logits [b, vocab]."""
        ctx = attention.ForwardContext(self.runner.kv_cache, self.metas[b], self.runner.ops)
        with attention.forward_context(ctx):
            return self.runner.model(input_ids=self.input_ids[:, :b], position_ids=self.positions[:, :b],
                                     use_cache=False, logits_to_keep=self.keep[:b]).logits[0]

    @torch.inference_mode()
    def capture(self) -> None:
        pool = None
        for b in reversed(self.sizes):  # largest first, so the smaller graphs fit in its pool
            self.forward_static(b)  # warm-up: compiles this size's kernels outside the capture
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.logits[b] = self.forward_static(b)
            pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.runner.device)

    def can_run(self, out: SchedulerOutput) -> bool:
        seqs = out.seqs
        return (0 < len(seqs) <= self.sizes[-1] and not out.pad_rows
                and all(len(s.token_ids) == 1 and s.sample and s.start_pos < self.max_model_len
                        and len(s.block_table) <= self.width for s in seqs))

    def run(self, out: SchedulerOutput) -> torch.Tensor:
        """Logits [n, vocab] of the step's n sequences, in order."""
        return self.replay(self.prepare(out), len(out.seqs))

    def replay(self, b: int, n: int) -> torch.Tensor:
        """Replay the graph of size b over the buffers prepare() filled; logits [n, vocab] of its first n rows."""
        self.graphs[b].replay()
        return self.logits[b][:n]

    def prepare(self, out: SchedulerOutput) -> int:
        """Copy a decode-only step into the static buffers; returns the captured size it pads to."""
        seqs = out.seqs
        n = len(seqs)
        b = next(size for size in self.sizes if size >= n)
        bs = self.block_size
        ids = [s.token_ids[0] for s in seqs]
        pos = [s.start_pos for s in seqs]
        slots = [s.block_table[p // bs] * bs + p % bs for s, p in zip(seqs, pos)]
        width = max(len(s.block_table) for s in seqs)
        tables = [s.block_table + [0] * (width - len(s.block_table)) for s in seqs]
        # One host tensor, one copy to the device, then split into the static buffers.
        host = torch.tensor(ids + pos + slots + [p + 1 for p in pos], dtype=torch.long)
        dev = host.to(self.runner.device)
        self.input_ids[0, :n].copy_(dev[:n])
        self.positions[0, :n].copy_(dev[n : 2 * n])
        self.slots[:n].copy_(dev[2 * n : 3 * n])
        self.seq_lens[:n].copy_(dev[3 * n :])
        if b > n:
            self.slots[n:b].fill_(-1)
            self.seq_lens[n:b].fill_(1)
        self.block_tables[:n, :width].copy_(torch.tensor(tables, dtype=torch.int32))
        return b


def try_capture(runner, max_batch: int, max_model_len: int) -> DecodeGraphs | None:
    """Capture the decode graphs; on any failure say so and run eagerly instead."""
    graphs = DecodeGraphs(runner, max_batch, max_model_len)
    try:
        graphs.capture()
    except Exception as e:  # a model op that cannot be captured must not stop the engine
        print(f"kvscope: CUDA graph capture failed, decode steps run eagerly ({type(e).__name__}: {e})",
              file=sys.stderr)
        graphs.graphs.clear()
        graphs.logits.clear()
        try:
            torch.cuda.synchronize(runner.device)
        except Exception:  # an error left on the stream by the failed capture; the next step would show it
            pass
        return None
    return graphs
