"""The plain data the scheduler hands the model runner each step (vLLM V1's boundary)."""

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


@dataclass
class SchedulerOutput:
    step: int
    budget: int
    seqs: list[ScheduledSeq] = field(default_factory=list)
    # static mode: rows computed only as padding (a prompt padded to the longest, or a finished row)
    pad_rows: list[int] = field(default_factory=list)
    preempted: list[int] = field(default_factory=list)
    admitted: list[int] = field(default_factory=list)
    finished_req_ids: list[int] = field(default_factory=list)  # released since the previous step
    admission: Admission = field(default_factory=lambda: Admission(VERDICT_IDLE))
    # (req, reason, mode) for each entry of `preempted`; mode "recompute" or "swap"
    preemptions: list[tuple[int, str, str]] = field(default_factory=list)
    # block copies to apply before the forward, in this order (vLLM-style lists):
    blocks_to_swap_out: list[tuple[int, int]] = field(default_factory=list)  # (gpu, cpu)
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # (src, dst) copy-on-write
    blocks_to_swap_in: list[tuple[int, int]] = field(default_factory=list)  # (cpu, gpu)
    hits: list[tuple[int, int, int]] = field(default_factory=list)  # (req, cached tokens, blocks) at admission
    swaps: list[tuple[int, str, int]] = field(default_factory=list)  # (req, "out"/"in", blocks)

    def add(self, seq: ScheduledSeq) -> None:
        self.seqs.append(seq)

    def drop(self, req_id: int) -> None:
        """Unschedule a request preempted later in the same step."""
        self.seqs = [s for s in self.seqs if s.req_id != req_id]

    @property
    def num_tokens(self) -> int:
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def num_padding_tokens(self) -> int:
        return sum(self.pad_rows)

    @property
    def has_copies(self) -> bool:
        return bool(self.blocks_to_swap_out or self.blocks_to_copy or self.blocks_to_swap_in)

    @property
    def is_empty(self) -> bool:
        return not self.seqs and not self.pad_rows
