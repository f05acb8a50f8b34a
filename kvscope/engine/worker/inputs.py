"""The forward's inputs for one step, built with array ops: no Python loop per token.

All scheduled tokens go into one packed row (varlen, no padding). Per token the
runner needs its id, its position and the cache slot its K/V is written to; per
sequence, where its queries start, its context length and its block table. A loop
per token costs about a microsecond each (8,192 of them for one full chunked step),
so positions and slots come from numpy over the whole batch instead; what is left
per sequence is reading its four fields.

The decodes' block tables are kept from step to step (`BlockTableRows`, vLLM's persistent
block table): a request's row is written when its table is new and then only where it grew,
so a step copies a few new entries instead of every entry of every table.
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


class BlockTableRows:
    """Block tables kept as rows of one array across steps, one row per request.

    A row is rewritten when its request's table is a list it has not seen (a new request, or one
    that dropped its blocks and took new ones), and otherwise extended by what was appended since.
    Only for tables that change in no other way (SchedulerOutput.tables_grow_in_place)."""

    def __init__(self, rows: int = 64, width: int = 64) -> None:
        self.array = np.zeros((rows, width), dtype=np.int32)
        self.row_of: dict[int, int] = {}  # req_id -> row
        self.table_of: list[list[int] | None] = [None] * rows  # the list each row was written from
        self.written = [0] * rows  # entries of that list in the row
        self.free_rows = list(range(rows - 1, -1, -1))

    def gather(self, req_ids: list[int], tables: list[list[int]]) -> np.ndarray:
        """[len(req_ids), widest table] int32, zero-padded: the tables, in order."""
        if len(self.row_of) + len(req_ids) > len(self.table_of):
            self._reclaim(req_ids)
        rows = [0] * len(req_ids)
        width = 1
        array, row_of, table_of, written = self.array, self.row_of, self.table_of, self.written
        for i, (req_id, table) in enumerate(zip(req_ids, tables)):
            n = len(table)
            row = row_of.get(req_id)
            if row is None or table_of[row] is not table:  # a table this row has not seen: write it all
                if row is None:
                    row = row_of[req_id] = self.free_rows.pop()
                old = written[row]
                if n > array.shape[1]:
                    array = self._widen(n)
                array[row, :n] = table
                if old > n:
                    array[row, n:old] = 0
                table_of[row], written[row] = table, n
            elif n > written[row]:
                if n > array.shape[1]:
                    array = self._widen(n)
                array[row, written[row]:n] = table[written[row]:]
                written[row] = n
            rows[i] = row
            if n > width:
                width = n
        return array[rows, :width]

    def _widen(self, n: int) -> np.ndarray:
        width = self.array.shape[1]
        while width < n:
            width *= 2
        wider = np.zeros((self.array.shape[0], width), dtype=np.int32)
        wider[:, : self.array.shape[1]] = self.array
        self.array = wider
        return wider

    def _reclaim(self, keep: list[int]) -> None:
        """Free the rows of requests not in this step; grow the array if that is not enough."""
        wanted = set(keep)
        for req_id in [r for r in self.row_of if r not in wanted]:
            row = self.row_of.pop(req_id)
            self.array[row, : self.written[row]] = 0
            self.table_of[row], self.written[row] = None, 0
            self.free_rows.append(row)
        rows = len(self.table_of)
        if len(self.row_of) + len(keep) > rows:
            more = max(rows, len(keep))
            self.array = np.concatenate([self.array, np.zeros((more, self.array.shape[1]), dtype=np.int32)])
            self.table_of += [None] * more
            self.written += [0] * more
            self.free_rows += range(rows + more - 1, rows - 1, -1)


class InputBuilder:
    """Builds StepInputs for a cache of num_blocks blocks, plus scratch blocks that static mode's
    padding rows share (what they compute is thrown away)."""

    def __init__(self, block_size: int, num_blocks: int, num_scratch_blocks: int, device: torch.device) -> None:
        self.block_size = block_size
        self.device = device
        self.scratch = list(range(num_blocks, num_blocks + num_scratch_blocks))
        self.rows = BlockTableRows()

    @staticmethod
    def _pack(tables: list[list[int]]) -> np.ndarray:
        """[len(tables), widest] int32, zero-padded."""
        table_lens = np.array([len(t) for t in tables], dtype=np.int64)
        width = int(table_lens.max()) if tables else 1
        block_tables = np.zeros((len(tables), width), dtype=np.int32)
        # row-major mask order is the order the tables are concatenated in
        block_tables[np.arange(width) < table_lens[:, None]] = np.fromiter(
            chain.from_iterable(tables), dtype=np.int32, count=int(table_lens.sum()))
        return block_tables

    def _block_tables(self, out: SchedulerOutput, tables: list[list[int]]) -> np.ndarray:
        d = out.decodes
        if not (out.tables_grow_in_place and len(d)):
            return self._pack(tables)
        kept = self.rows.gather(d.req_ids, d.block_tables)  # the decodes' rows, copied only where they grew
        if len(tables) == len(d):
            return kept
        rest = self._pack(tables[len(d):])
        block_tables = np.zeros((len(tables), max(kept.shape[1], rest.shape[1])), dtype=np.int32)
        block_tables[: len(d), : kept.shape[1]] = kept
        block_tables[len(d):, : rest.shape[1]] = rest
        return block_tables

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
        block_tables = self._block_tables(out, tables)
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
