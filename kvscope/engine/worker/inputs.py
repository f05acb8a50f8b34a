"""The forward's inputs for one step, built with array ops: no Python loop per token.

All scheduled tokens go into one packed row (varlen, no padding). Per token the
runner needs its id, its position and the cache slot its K/V is written to; per
sequence, where its queries start, its context length and its block table. A loop
per token costs about a microsecond each (8,192 of them for one full chunked step),
so positions and slots come from numpy over the whole batch instead; what is left
per sequence is reading its four fields.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch

from kvscope.engine.kv.block_manager import blocks_needed
from kvscope.engine.sched.output import SchedulerOutput
from kvscope.kernels import AttentionMetadata

PAD_TOKEN_ID = 0


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [1, T] long
    position_ids: torch.Tensor  # [1, T] long
    meta: AttentionMetadata
    sample_rows: list[int]  # packed row of each sampled sequence's last token, in batch order


class InputBuilder:
    """Builds StepInputs for a cache of num_blocks blocks, plus scratch blocks that static mode's
    padding rows share (what they compute is thrown away)."""

    def __init__(self, block_size: int, num_blocks: int, num_scratch_blocks: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.scratch = list(range(num_blocks, num_blocks + num_scratch_blocks))

    def build(self, out: SchedulerOutput) -> StepInputs:
        bs = self.block_size
        d = out.decodes  # one token each, all sampled, ahead of the other sequences
        seqs = out.other_seqs
        query_lens = [1] * len(d) + [len(s.token_ids) for s in seqs]
        starts = d.positions + [s.start_pos for s in seqs]
        tables = d.block_tables + [s.block_table for s in seqs]
        ids = d.token_ids + list(chain.from_iterable(s.token_ids for s in seqs))
        for n in out.pad_rows:
            query_lens.append(n)
            starts.append(0)
            tables.append(self.scratch[: blocks_needed(n, bs)])
            ids.extend([PAD_TOKEN_ID] * n)
        num_seqs = len(query_lens)
        qlen = np.array(query_lens, dtype=np.int64)
        start = np.array(starts, dtype=np.int64)
        qsl = np.zeros(num_seqs + 1, dtype=np.int64)
        np.cumsum(qlen, out=qsl[1:])
        seq_lens = start + qlen
        # token t of sequence s sits at start[s] + (t - qsl[s])
        row_of_token = np.repeat(np.arange(num_seqs), qlen)
        positions = np.arange(int(qsl[-1]), dtype=np.int64) + np.repeat(start - qsl[:-1], qlen)
        table_lens = np.array([len(t) for t in tables], dtype=np.int64)
        width = int(table_lens.max()) if num_seqs else 1
        block_tables = np.zeros((num_seqs, width), dtype=np.int32)
        # row-major mask order is the order the tables are concatenated in
        block_tables[np.arange(width) < table_lens[:, None]] = np.fromiter(
            chain.from_iterable(tables), dtype=np.int32, count=int(table_lens.sum()))
        slots = block_tables[row_of_token, positions // bs].astype(np.int64) * bs + positions % bs
        ends = qsl[1:].tolist()
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.from_numpy(slots).to(dev),
            query_start_loc=torch.from_numpy(qsl.astype(np.int32)).to(dev),
            seq_lens=torch.from_numpy(seq_lens.astype(np.int32)).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            block_size=bs,
            query_lens_host=query_lens,
            seq_lens_host=seq_lens.tolist(),
        )
        return StepInputs(
            input_ids=torch.tensor([ids], dtype=torch.long, device=dev),
            position_ids=torch.from_numpy(positions).to(dev)[None],
            meta=meta,
            sample_rows=list(range(len(d))) + [ends[i] - 1 for i, s in enumerate(seqs, start=len(d)) if s.sample],
        )

    def build_reference(self, out: SchedulerOutput) -> StepInputs:
        """The per-token loop that build() replaces (kept, as kernels keep their torch references,
        for tests/test_engine_inputs.py and `kvscope bench --host-overhead`)."""
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        qsl = [0]
        seq_lens: list[int] = []
        tables: list[list[int]] = []
        sample_rows: list[int] = []
        for seq in out.seqs:
            n = len(seq.token_ids)
            ids.extend(seq.token_ids)
            for pos in range(seq.start_pos, seq.start_pos + n):
                positions.append(pos)
                slots.append(seq.block_table[pos // bs] * bs + pos % bs)
            qsl.append(qsl[-1] + n)
            seq_lens.append(seq.start_pos + n)
            tables.append(seq.block_table)
            if seq.sample:
                sample_rows.append(qsl[-1] - 1)
        for n in out.pad_rows:
            ids.extend([PAD_TOKEN_ID] * n)
            positions.extend(range(n))
            slots.extend(self.scratch[p // bs] * bs + p % bs for p in range(n))
            qsl.append(qsl[-1] + n)
            seq_lens.append(n)
            tables.append(self.scratch[: blocks_needed(n, bs)])
        width = max((len(t) for t in tables), default=1)
        dev = self.device
        meta = AttentionMetadata(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=dev),
            query_start_loc=torch.tensor(qsl, dtype=torch.int32, device=dev),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=dev),
            block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32, device=dev),
            block_size=bs,
            query_lens_host=[qsl[i + 1] - qsl[i] for i in range(len(seq_lens))],
            seq_lens_host=seq_lens,
        )
        return StepInputs(torch.tensor([ids], dtype=torch.long, device=dev),
                          torch.tensor([positions], dtype=torch.long, device=dev), meta, sample_rows)
