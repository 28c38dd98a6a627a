"""Per-step batch description shared by the model and the attention kernels."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flat batch and where its KV lives.

    Sequences are laid out back to back: sequence b owns query rows
    `query_start_loc[b]:query_start_loc[b+1]`, and those rows are the last tokens of
    its `seq_lens[b]` KV entries (the new tokens' KV is stored before attention runs).
    """

    slot_mapping: torch.Tensor  # int32 or int64 [T], -1 = do not store
    query_start_loc: torch.Tensor  # int32 [B+1]
    seq_lens: torch.Tensor  # int32 [B]
    block_tables: torch.Tensor  # int32 [B, max_num_blocks], padded with 0
    max_query_len: int
    max_seq_len: int
    # Key segments per sequence in the Triton kernel; fixed for a captured CUDA graph (None: per call).
    num_kv_splits: int | None = None
    # Host copies so the CPU path does not pay a device->host sync in every layer.
    _host_query_start_loc: list[int] | None = field(default=None, repr=False, compare=False)
    _host_seq_lens: list[int] | None = field(default=None, repr=False, compare=False)
    _fresh: bool | None = field(default=None, repr=False, compare=False)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    def host_query_start_loc(self) -> list[int]:
        if self._host_query_start_loc is None:
            self._host_query_start_loc = self.query_start_loc.tolist()
        return self._host_query_start_loc

    @property
    def fresh_prompts(self) -> bool:
        """Every sequence's new tokens are all its tokens (positions 0..len-1, none cached, no
        earlier chunk) and some sequence has more than one: the step attends only to the keys it
        computes. Known from the host copies only (False without them: a decode graph's); found
        once a step, asked by every layer."""
        if self._fresh is None:
            starts, seq_lens = self._host_query_start_loc, self._host_seq_lens
            self._fresh = (
                starts is not None
                and seq_lens is not None
                and self.max_query_len > 1
                and all(end - start == n for start, end, n in zip(starts, starts[1:], seq_lens))
            )
        return self._fresh

    def host_seq_lens(self) -> list[int]:
        if self._host_seq_lens is None:
            self._host_seq_lens = self.seq_lens.tolist()
        return self._host_seq_lens

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        block_tables: list[list[int]],
        block_size: int,
        device: torch.device | str = "cpu",
    ) -> AttentionMetadata:
        """Builds metadata for sequences whose last `query_lens[b]` of `seq_lens[b]` tokens are new."""
        if not (len(query_lens) == len(seq_lens) == len(block_tables)):
            raise ValueError(
                "query_lens, seq_lens and block_tables must have one entry per sequence"
            )
        slots: list[int] = []
        for query_len, seq_len, table in zip(query_lens, seq_lens, block_tables):
            if not 0 < query_len <= seq_len:
                raise ValueError(f"need 0 < query_len <= seq_len, got {query_len} and {seq_len}")
            if len(table) * block_size < seq_len:
                raise ValueError(
                    f"{len(table)} blocks of {block_size} cannot hold {seq_len} tokens"
                )
            for pos in range(seq_len - query_len, seq_len):
                slots.append(table[pos // block_size] * block_size + pos % block_size)
        starts = [0]
        for query_len in query_lens:
            starts.append(starts[-1] + query_len)
        max_blocks = max(len(t) for t in block_tables)
        padded = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        return cls(
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(padded, dtype=torch.int32, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            _host_query_start_loc=starts,
            _host_seq_lens=list(seq_lens),
        )
