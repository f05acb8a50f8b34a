"""The plain data the scheduler hands the model runner each step (vLLM V1's boundary).

Most of a step's sequences are usually one-token decodes, so those travel as columns
(`DecodeBatch`) instead of one object each: building, reading and packing a few hundred
objects per step is most of the host time between two forwards. `SchedulerOutput.seqs`
still lists every sequence as a ScheduledSeq (decodes first), built on first use, for
code that wants one record per sequence.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvscope.protocol.events import VERDICT_IDLE, Admission


@dataclass(slots=True)
class ScheduledSeq:
    req_id: int
    token_ids: list[int]  # the tokens to compute this step (a prefill chunk or one decode token)
    start_pos: int  # position of token_ids[0]
    block_table: list[int]  # physical blocks covering positions [0, start_pos + len(token_ids))
    sample: bool  # this step reaches the end of the sequence: sample its next token
    is_prefill: bool


@dataclass(slots=True)
class DecodeBatch:
    """One-token decodes, column by column: each samples its next token.

    The block tables are the requests' own lists (``Request.block_table``), valid for this step
    (nothing changes them between schedule() and the end of the forward); copy one to keep it.
    """

    req_ids: list[int] = field(default_factory=list)
    positions: list[int] = field(default_factory=list)  # position of the token computed
    token_ids: list[int] = field(default_factory=list)  # the token computed (the last one sampled)
    block_tables: list[list[int]] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.req_ids)

    def drop(self, req_id: int) -> bool:
        if req_id not in self.req_ids:
            return False
        i = self.req_ids.index(req_id)
        for column in (self.req_ids, self.positions, self.token_ids, self.block_tables):
            del column[i]
        return True


@dataclass(init=False)
class SchedulerOutput:
    step: int
    budget: int
    decodes: DecodeBatch  # run before other_seqs
    other_seqs: list[ScheduledSeq]  # prefill chunks, and static mode's rows
    # static mode: rows computed only as padding (a prompt padded to the longest, or a finished row)
    pad_rows: list[int]
    preempted: list[int]
    admitted: list[int]
    finished_req_ids: list[int]  # released since the previous step
    admission: Admission
    # (req, reason, mode) for each entry of `preempted`; mode "recompute" or "swap"
    preemptions: list[tuple[int, str, str]]
    # block copies to apply before the forward, in this order (vLLM-style lists):
    blocks_to_swap_out: list[tuple[int, int]]  # (gpu, cpu)
    blocks_to_copy: list[tuple[int, int]]  # (src, dst) copy-on-write
    blocks_to_swap_in: list[tuple[int, int]]  # (cpu, gpu)
    hits: list[tuple[int, int, int]]  # (req, cached tokens, blocks) at admission
    swaps: list[tuple[int, str, int]]  # (req, "out"/"in", blocks)
    # the decodes' block tables changed since the last step only by growing (a table dropped and
    # taken again is a new list): the runner may keep them and copy only what was appended
    tables_grow_in_place: bool

    def __init__(self, step: int, budget: int, seqs: list[ScheduledSeq] | None = None,
                 pad_rows: list[int] | None = None, finished_req_ids: list[int] | None = None) -> None:
        self.step = step
        self.budget = budget
        self.decodes = DecodeBatch()
        self.other_seqs = []
        self.pad_rows = [] if pad_rows is None else pad_rows
        self.preempted = []
        self.admitted = []
        self.finished_req_ids = [] if finished_req_ids is None else finished_req_ids
        self.admission = Admission(VERDICT_IDLE)
        self.preemptions = []
        self.blocks_to_swap_out = []
        self.blocks_to_copy = []
        self.blocks_to_swap_in = []
        self.hits = []
        self.swaps = []
        self.tables_grow_in_place = False
        self._num_tokens = 0  # of other_seqs, kept by add() and drop(): read at every admission
        self._seqs: list[ScheduledSeq] | None = None
        for seq in seqs or ():
            self.add(seq)

    def add(self, seq: ScheduledSeq) -> None:
        self.other_seqs.append(seq)
        self._num_tokens += len(seq.token_ids)
        self._seqs = None

    def drop(self, req_id: int) -> None:
        """Unschedule a request preempted later in the same step."""
        self.decodes.drop(req_id)
        kept = [s for s in self.other_seqs if s.req_id != req_id]
        if len(kept) != len(self.other_seqs):
            self.other_seqs = kept
            self._num_tokens = sum(len(s.token_ids) for s in kept)
        self._seqs = None

    @property
    def seqs(self) -> list[ScheduledSeq]:
        """Every scheduled sequence, decodes first (built on first use; do not mutate)."""
        if self._seqs is None:
            d = self.decodes
            self._seqs = [ScheduledSeq(r, [t], p, table, True, False)
                          for r, p, t, table in zip(d.req_ids, d.positions, d.token_ids, d.block_tables)]
            self._seqs += self.other_seqs
        return self._seqs

    @property
    def num_seqs(self) -> int:
        return len(self.decodes) + len(self.other_seqs)

    @property
    def num_tokens(self) -> int:
        return len(self.decodes.req_ids) + self._num_tokens

    @property
    def num_padding_tokens(self) -> int:
        return sum(self.pad_rows)

    @property
    def has_copies(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        return not self.decodes.req_ids and not self.other_seqs and not self.pad_rows
