"""What attention needs to know about one packed step: where each sequence's queries and KV are."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: cache slot (block * block_size + offset) of each new token
    query_start_loc: torch.Tensor  # [S + 1] int32: sequence s owns query rows [qsl[s], qsl[s+1])
    seq_lens: torch.Tensor  # [S] int32: context length of s after this step (cached + new)
    block_tables: torch.Tensor  # [S, max_blocks] int32, padded with 0
    block_size: int
    # host copies, so reference code and launch decisions need no device sync
    query_lens_host: list[int]
    seq_lens_host: list[int]

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens_host)

    @property
    def max_query_len(self) -> int:
        return max(self.query_lens_host, default=0)

    @property
    def max_seq_len(self) -> int:
        return max(self.seq_lens_host, default=0)
