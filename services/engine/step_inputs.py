"""A step's model inputs in persistent device buffers, filled from reused pinned host buffers.

Every per-token and per-sequence index of a step (token ids, positions, KV slots,
query starts, sequence lengths, rows to sample) is int32 and packed back to back
into one region: the host fills its pinned twin with numpy slice assignments (no
`torch.tensor(list)` per step) and one asynchronous copy moves it. Block tables
travel in it too, concatenated with each entry's place in the device table (a row
with room for the longest sequence), and one scatter puts them there. So do the
step's LoRA indices (the tokens grouped by adapter slot, kernels/lora.py). The layout
depends only on the step's counts, so a decode CUDA graph captured for batch size B
reads exactly where a step of B rows was written.

Host buffers come in two sets used in turn: filling step N+1's never overwrites the
bytes of step N's copy, which may still be queued on the stream.

The device table persists between steps: a row that holds the same sequence's table as at the
last upload gets only the entries appended since (a decode step adds a block per sequence every
block_size steps, where writing every entry of every row cost a long-context batch of 256
sequences about a millisecond of host time a step). A sequence's block table only grows while
it is the same list (a preemption, a fork or a handoff gives it a new one), so the list's
identity and its length at the upload say which entries the device has. Off for a rank with
tensor-parallel followers (they upload what rank 0 packed, with tables of their own).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import torch

from tandem.engine.scheduler import ScheduledBatch
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.lora import LoRAMetadata

# What a decode graph reads comes first: its offsets depend on the batch size alone.
_FIELDS = (
    "input_ids",
    "positions",
    "slot_mapping",
    "query_start_loc",
    "seq_lens",
    "sample_rows",
    "lora_order",
    "lora_starts",
    "pending_rows",
    "pending_sources",
    "table_entries",
    "table_places",
)


_MAX_CACHED_REGIONS = 256  # InputBuffers' layouts and views by counts (~7 KB an entry)


def packed_layout(
    num_tokens: int,
    num_seqs: int,
    num_samples: int,
    num_pending: int = 0,
    num_table_entries: int = 0,
    num_lora_slots: int = 0,
) -> dict[str, tuple[int, int]]:
    """field -> (offset, length) in the packed int32 region of a step with these counts
    (num_lora_slots: the adapter pool's slots, 0 without LoRA)."""
    lora_order, lora_starts = (num_tokens, num_lora_slots + 1) if num_lora_slots else (0, 0)
    lengths = (
        num_tokens,
        num_tokens,
        num_tokens,
        num_seqs + 1,
        num_seqs,
        num_samples,
        lora_order,
        lora_starts,
        num_pending,
        num_pending,
        num_table_entries,
        num_table_entries,
    )
    layout, offset = {}, 0
    for name, length in zip(_FIELDS, lengths):
        layout[name] = (offset, length)
        offset += length
    return layout


def _slots(table: list[int], start: int, end: int, block_size: int) -> np.ndarray:
    positions = np.arange(start, end)
    return (
        np.asarray(table, dtype=np.int64)[positions // block_size] * block_size
        + positions % block_size
    )


@dataclass(frozen=True)
class _Regions:
    """A step's packed region for one set of counts: packed_layout's fields, their total length,
    and each field as a view of the device buffer."""

    layout: dict[str, tuple[int, int]]
    used: int
    views: dict[str, torch.Tensor]


@dataclass
class StepInputs:
    input_ids: torch.Tensor  # [T] (padded rows included when graph_size is set)
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # rows of the model's output whose logits are sampled
    sample_indices: list[int]  # their sequences' indices in the batch
    graph_size: int | None  # the decode graph this step replays (None: eager)
    # Rows of input_ids whose token the previous step drew and the host has not read yet, and
    # that token's row among the previous step's draws (see ModelRunner.execute).
    pending_rows: torch.Tensor
    pending_sources: torch.Tensor
    # The tokens grouped by adapter slot; None when no token of the step uses an adapter.
    lora_meta: LoRAMetadata | None = None


@dataclass
class PackedStep:
    """A step's inputs on the host, as one int32 region plus the counts that lay it out
    (packed_layout's arguments): what rank 0 sends its tensor-parallel followers each step."""

    host: torch.Tensor  # int32 [used]
    counts: tuple[
        int, int, int, int, int
    ]  # num_tokens, num_rows, num_samples, num_pending, num_table_entries
    max_query_len: int
    max_seq_len: int
    starts: list[int]  # query_start_loc, padding rows included
    seq_lens: list[int]
    sample_indices: list[int]
    graph_size: int | None
    has_lora: bool
    # The device table's rows after this step's upload: (the row's block-table list, its length);
    # and the table state the entries were packed against (InputBuffers._tables_epoch).
    table_rows: list[tuple[list[int], int]] | None = None
    tables_epoch: int = 0


class InputBuffers:
    def __init__(
        self,
        max_num_tokens: int,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        block_size: int,
        device: torch.device,
        num_lora_slots: int = 0,
        max_num_samples: int = 0,
    ):
        """max_num_samples: rows a step samples at most (0: one per sequence)."""
        self.num_lora_slots = num_lora_slots
        self.max_num_tokens = max_num_tokens
        self.max_num_seqs = max_num_seqs
        self.max_num_samples = max(max_num_samples, max_num_seqs)
        self.max_blocks_per_seq = max_blocks_per_seq
        self.block_size = block_size
        self.device = device
        size = sum(
            length
            for _, length in packed_layout(
                max_num_tokens,
                max_num_seqs,
                self.max_num_samples,
                max_num_seqs,
                max_num_seqs * max_blocks_per_seq,
                num_lora_slots,
            ).values()
        )
        self.packed = torch.zeros(size, dtype=torch.int32, device=device)
        self.block_tables = torch.zeros(
            max_num_seqs, max_blocks_per_seq, dtype=torch.int32, device=device
        )
        pin = device.type == "cuda"
        self._host = [torch.zeros(size, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._turn = 0
        # Pack only the entries a row's table gained since the last upload (see the module's
        # docstring); what each row of the device table holds, and a count of the times the
        # device table was written by anything else (which makes the rows unknown).
        self.incremental_tables = True
        self._table_rows: list[tuple[list[int], int]] = []
        self._tables_epoch = 0
        # A step's layout and device views by its counts (_regions): a decode stream repeats a
        # few of them step after step, and a dozen slices cost a step's upload ~0.04 ms of host
        # time on an H100's host (step_host.py).
        self._regions: dict[tuple[int, ...], _Regions] = {}

    def host_buffer(self) -> torch.Tensor:
        """The next of the two host buffers (a tensor-parallel follower fills it with rank 0's step)."""
        host = self._host[self._turn]
        self._turn ^= 1
        return host

    def views(
        self,
        num_tokens: int,
        num_seqs: int,
        num_samples: int,
        num_pending: int = 0,
        num_table_entries: int = 0,
    ) -> dict[str, torch.Tensor]:
        """The packed region's fields for a step with these counts (packed_layout's arguments), as
        views of the device buffer: made once per counts and shared (read them, never rebind)."""
        return self._regions_for(
            (num_tokens, num_seqs, num_samples, num_pending, num_table_entries)
        ).views

    def _regions_for(self, counts: tuple[int, ...]) -> _Regions:
        regions = self._regions.get(counts)
        if regions is None:
            if len(self._regions) >= _MAX_CACHED_REGIONS:
                self._regions.clear()
            layout = packed_layout(*counts, self.num_lora_slots)
            views = {
                name: self.packed[offset : offset + length]
                for name, (offset, length) in layout.items()
            }
            used = sum(length for _, length in layout.values())
            regions = self._regions[counts] = _Regions(layout, used, views)
        return regions

    def graph_metadata(
        self, batch_size: int, num_kv_splits: int | None, max_seq_len: int
    ) -> tuple[dict, AttentionMetadata]:
        """The views and metadata a decode graph of batch_size rows is captured with."""
        views = self.views(batch_size, batch_size, batch_size)
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=self.block_tables[:batch_size],
            max_query_len=1,
            max_seq_len=max_seq_len,
            num_kv_splits=num_kv_splits,
        )
        return views, meta

    def graph_lora_metadata(self, batch_size: int) -> LoRAMetadata:
        """The LoRA indices a decode graph of batch_size rows is captured with."""
        views = self.views(batch_size, batch_size, batch_size)
        return LoRAMetadata(views["lora_order"], views["lora_starts"])

    def fill_dummy(self, batch_size: int) -> None:
        """Safe inputs for a decode forward of batch_size rows (graph warm-up and capture): token 0
        at position 0 attending to one key of block 0, storing no KV."""
        views = self.views(batch_size, batch_size, batch_size)
        for name in ("input_ids", "positions", "sample_rows"):
            views[name].zero_()
        views["slot_mapping"].fill_(-1)
        views["seq_lens"].fill_(1)
        views["query_start_loc"].copy_(torch.arange(batch_size + 1, dtype=torch.int32))
        self.block_tables[:batch_size].zero_()
        self._forget_tables()
        if self.num_lora_slots:  # no token uses an adapter
            views["lora_order"].copy_(torch.arange(batch_size, dtype=torch.int32))
            views["lora_starts"].zero_()

    def prepare(
        self,
        batch: ScheduledBatch,
        graph_size: int | None = None,
        pending_sources: dict | None = None,
    ) -> StepInputs:
        """Copies the batch's inputs to the device (pack() then upload())."""
        return self.upload(self.pack(batch, graph_size, pending_sources))

    def pack(
        self,
        batch: ScheduledBatch,
        graph_size: int | None = None,
        pending_sources: dict | None = None,
    ) -> PackedStep:
        """Fills a host buffer with the batch's inputs. With graph_size (a decode batch: one new token
        per sequence, or a sequence's last token and its drafts as rows of their own, all
        sampling), rows past the batch are padding: they store no KV and attend
        to one key of block 0, and their logits are ignored. A sequence whose next token is still
        in flight (num_pending_tokens) gets a placeholder id and its row in pending_sources."""
        host = self.host_buffer()
        bs = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        starts = [0]
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_indices: list[int] = []
        pending_rows: list[int] = []
        sources: list[int] = []
        tables = []
        table_lengths: list[int] = []
        seq_slots: list[int] = []  # each sequence's adapter slot, -1 for none
        pending_sources = pending_sources or {}
        row = 0  # the batch's tokens so far: this sequence's first row
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            table = seq.block_table
            num_known = seq.num_tokens  # a property: read once per sequence of the step
            drafts = seq.draft_token_ids
            if drafts:  # its last token, then the drafts the step verifies: every row samples
                input_ids += seq.token_slice(start, num_known)
                input_ids += drafts
            elif end > num_known:
                source = pending_sources.get(seq)
                if num_new != 1 or end != num_known + 1 or source is None:
                    raise RuntimeError(
                        f"{seq.request_id}: only the one token the previous step drew can be in flight"
                    )
                pending_rows.append(row)
                sources.append(source)
                input_ids.append(0)
            else:
                input_ids += seq.token_slice(start, end)
            if num_new == 1:
                positions.append(start)
                slots.append(table[start // bs] * bs + start % bs)
            else:
                positions += range(start, end)
                slots += _slots(table, start, end, bs).tolist()
            row += num_new
            if drafts and graph_size:
                # Verified in a decode graph: each row is a query of its own over the keys up to
                # its position (the rows before it stored theirs first), as a plain decode step
                # of that position computes it.
                starts += range(row - num_new + 1, row + 1)
                seq_lens += range(start + 1, end + 1)
                tables += [table] * num_new
                table_lengths += [len(table)] * num_new
            else:
                starts.append(row)
                seq_lens.append(end)
                tables.append(table)
                table_lengths.append(len(table))
            if drafts:
                sample_rows += range(row - num_new, row)
                sample_indices += [i] * num_new
            elif end == num_known + seq.num_pending_tokens:
                sample_rows.append(row - 1)
                sample_indices.append(i)
            lora_slot = seq.lora_slot
            seq_slots.append(-1 if lora_slot is None else lora_slot)
        num_seqs = len(tables)  # in a decode graph a drafted sequence's rows count one each
        num_rows = graph_size or num_seqs
        num_tokens = graph_size or starts[-1]
        num_samples = graph_size or len(sample_rows)
        if (
            num_tokens > self.max_num_tokens
            or num_rows > self.max_num_seqs
            or num_samples > self.max_num_samples
        ):
            raise ValueError(
                f"a step of {num_tokens} tokens / {num_rows} sequences / {num_samples} sampled rows "
                f"exceeds the input buffers ({self.max_num_tokens} / {self.max_num_seqs} / "
                f"{self.max_num_samples})"
            )
        has_lora = max(seq_slots) >= 0
        if has_lora and not self.num_lora_slots:
            raise ValueError("a sequence has a LoRA slot but the input buffers have no LoRA fields")
        width = max(table_lengths)
        if width > self.max_blocks_per_seq:
            raise ValueError(
                f"a block table of {width} blocks exceeds max_blocks_per_seq={self.max_blocks_per_seq}"
            )

        # Entry j of row i goes to the flat place i * max_blocks_per_seq + j of the device table;
        # a row that holds the same table as at the last upload gets only its new entries.
        table_rows = list(zip(tables, table_lengths))
        known = self._known_entries(table_rows)
        if known is None:
            first = np.zeros(num_seqs, dtype=np.int64)
            entries = list(itertools.chain.from_iterable(tables))
        else:
            first = np.asarray(known, dtype=np.int64)
            entries = list(
                itertools.chain.from_iterable(t[k:] for t, k in zip(tables, known) if k < len(t))
            )
        lengths = np.asarray(table_lengths, dtype=np.int64) - first
        num_entries = len(entries)
        row_starts = np.cumsum(lengths) - lengths
        places = np.arange(num_entries) + np.repeat(
            np.arange(num_seqs) * self.max_blocks_per_seq + first - row_starts, lengths
        )
        counts = (num_tokens, num_rows, num_samples, len(pending_rows), num_entries)
        regions = self._regions_for(counts)
        buf = host.numpy()
        num_real = starts[-1]
        if graph_size:
            pad = graph_size - num_seqs
            input_ids += [0] * pad
            positions += [0] * pad
            slots += [-1] * pad  # padding stores no KV
            starts += range(num_real + 1, num_real + pad + 1)
            seq_lens += [1] * pad  # one key (block 0, position 0): finite, ignored
            sample_rows = list(range(graph_size))
        fields = [
            ("input_ids", input_ids),
            ("positions", positions),
            ("slot_mapping", slots),
            ("query_start_loc", starts),
            ("seq_lens", seq_lens),
            ("sample_rows", sample_rows),
            ("pending_rows", pending_rows),
            ("pending_sources", sources),
            ("table_entries", entries),
            ("table_places", places),
        ]
        # Only a step with an adapter reads the LoRA fields (its eager metadata, the LoRA graphs);
        # without one they are left as they are. Padding rows use no adapter.
        if has_lora:
            token_slots = np.repeat(np.asarray(seq_slots, dtype=np.int64), batch.num_new_tokens)
            token_slots = np.concatenate(
                [token_slots, np.full(num_tokens - num_real, -1, dtype=np.int64)]
            )
            fields += zip(
                ("lora_order", "lora_starts"),
                LoRAMetadata.host_arrays(token_slots, self.num_lora_slots),
            )
        for name, values in fields:
            offset, length = regions.layout[name]
            buf[offset : offset + length] = values
        return PackedStep(
            host[: regions.used],
            counts,
            max(batch.num_new_tokens),
            max(seq_lens),
            starts,
            seq_lens,
            sample_indices,
            graph_size,
            has_lora,
            table_rows,
            self._tables_epoch,
        )

    def _known_entries(self, table_rows: list[tuple[list[int], int]]) -> list[int] | None:
        """Per row, how many of its table's entries the device table holds already (None: write
        every entry)."""
        if not self.incremental_tables or not self._table_rows:
            return None
        uploaded = self._table_rows
        num_uploaded = len(uploaded)
        known = [0] * len(table_rows)
        for i, (table, length) in enumerate(table_rows[:num_uploaded]):
            held, num_held = uploaded[i]
            if held is table and num_held <= length:
                known[i] = num_held
        return known

    def _forget_tables(self) -> None:
        """The device table was written by something else: every row is unknown."""
        self._table_rows = []
        self._tables_epoch += 1

    def _write_whole_tables(self, table_rows: list[tuple[list[int], int]]) -> None:
        width = self.max_blocks_per_seq
        entries = [b for table, n in table_rows for b in table[:n]]
        places = [i * width + j for i, (_, n) in enumerate(table_rows) for j in range(n)]
        self.block_tables.view(-1).index_copy_(
            0,
            torch.tensor(places, dtype=torch.int64).to(self.device),
            torch.tensor(entries, dtype=torch.int32).to(self.device),
        )

    def upload(self, step: PackedStep) -> StepInputs:
        """Moves a packed step to the device: one asynchronous copy and one block-table scatter."""
        self.packed[: step.host.numel()].copy_(step.host, non_blocking=True)
        views = self.views(*step.counts)
        # Entries past a table's length (and padding rows) keep older block ids: never read, always valid.
        self.block_tables.view(-1).index_copy_(
            0, views["table_places"].long(), views["table_entries"]
        )
        if step.table_rows is not None:
            if step.tables_epoch != self._tables_epoch:
                # Packed against rows that were overwritten since (a graph capture between the
                # pack and this upload): every entry of every row, from the tables themselves.
                self._write_whole_tables(step.table_rows)
            self._table_rows = step.table_rows if self.incremental_tables else []
        meta = AttentionMetadata(
            slot_mapping=views["slot_mapping"],
            query_start_loc=views["query_start_loc"],
            seq_lens=views["seq_lens"],
            block_tables=self.block_tables[: step.counts[1]],
            max_query_len=step.max_query_len,
            max_seq_len=step.max_seq_len,
            _host_query_start_loc=step.starts,
            _host_seq_lens=step.seq_lens,
        )
        lora_meta = (
            LoRAMetadata(views["lora_order"], views["lora_starts"]) if step.has_lora else None
        )
        return StepInputs(
            views["input_ids"],
            views["positions"],
            meta,
            views["sample_rows"],
            step.sample_indices,
            step.graph_size,
            views["pending_rows"],
            views["pending_sources"],
            lora_meta,
        )
