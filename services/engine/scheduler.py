"""Continuous batching: which sequences run this step and how many tokens each.

One token budget per step covers prefill chunks and decode tokens alike
(chunked prefill). Running sequences go first, by priority; waiting ones are
admitted while budget, sequence slots and blocks last. When blocks run out a
running sequence of the lowest priority is preempted by recompute: its blocks
are freed and it goes back to waiting with its tokens so far as the new prompt.
A decoding sequence with draft tokens (speculative decoding) computes them after its last token,
as far as the budget, the step's draft rows and the free blocks go (drafts never preempt). A sequence with a LoRA adapter also needs a slot of the adapter pool, pinned while it
runs; when every slot is pinned by other adapters it waits, and the sequences behind
it that fit go ahead.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.engine.block_manager import BlockManager
from tandem.engine.sequence import Sequence, Status

if TYPE_CHECKING:
    from tandem.engine.lora_pool import LoRAPool


@dataclass
class ScheduledBatch:
    seqs: list[Sequence]
    num_new_tokens: list[int]

    @property
    def is_empty(self) -> bool:
        return not self.seqs

    @property
    def num_tokens(self) -> int:
        return sum(self.num_new_tokens)


# _admit's answer for a sequence whose adapter finds no free slot (the blocks were there).
_NO_ADAPTER_SLOT = -1


def _order(seq: Sequence) -> tuple[float, int]:
    return (-seq.priority, seq.arrival_seq)


class Scheduler:
    def __init__(
        self,
        block_manager: BlockManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        lora_pool: LoRAPool | None = None,
        max_num_draft_tokens: int = 0,
    ):
        """max_num_draft_tokens: draft tokens a step verifies at most (speculative decoding)."""
        self.block_manager = block_manager
        self.max_num_draft_tokens = max_num_draft_tokens
        self.lora_pool = lora_pool
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: list[Sequence] = []
        self.running: list[Sequence] = []
        self._arrivals = itertools.count()
        self.num_preemptions = 0

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    def add(self, seq: Sequence) -> None:
        seq.arrival_seq = next(self._arrivals)
        seq.status = Status.WAITING
        self.waiting.append(seq)

    @property
    def num_active(self) -> int:
        """Running sequences that take a place in a step (a beam awaiting the others' does not)."""
        return sum(1 for s in self.running if not s.awaiting_beam)

    def add_forked(self, seq: Sequence) -> None:
        """A new beam with its KV forked: it runs next if there is room, else waits with its blocks."""
        if self.num_active < self.max_num_seqs:
            seq.status = Status.RUNNING
            self.running.append(seq)
        else:
            seq.arrival_seq = next(self._arrivals)
            seq.status = Status.WAITING
            self.waiting.append(seq)

    def remove(self, seq: Sequence, keep_blocks: bool = False) -> None:
        """Take a finished or aborted sequence out of the queues and free its blocks (unless
        keep_blocks: the caller frees them later)."""
        if seq in self.running:
            self.running.remove(seq)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        if not keep_blocks:
            self.block_manager.release(seq)
        self._release_adapter(seq)

    def schedule(self) -> ScheduledBatch:
        budget = self.max_num_batched_tokens
        draft_room = self.max_num_draft_tokens
        batch = ScheduledBatch([], [])
        self.running.sort(key=_order)
        # Membership in running is a list scan: it is only asked once this step has preempted.
        num_preemptions = self.num_preemptions
        for seq in list(self.running):
            # Beams forked past max_num_seqs run in turns: a step holds at most max_num_seqs.
            if budget == 0 or len(batch.seqs) == self.max_num_seqs:
                break
            # Preempted while making room for a higher-priority one, ending with its tokens in flight,
            # or a beam whose next token waits for the other beams.
            if (
                (self.num_preemptions != num_preemptions and seq not in self.running)
                or seq.finishes_when_pending_lands
                or seq.awaiting_beam
            ):
                continue
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not self._reserve(seq, num_new):
                continue
            if seq.draft_token_ids:
                num_drafts = self._fit_drafts(seq, num_new, budget, draft_room)
                num_new += num_drafts
                draft_room -= num_drafts
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        self.waiting.sort(key=_order)
        candidates = [s for s in self.waiting if not s.awaiting_beam]
        num_active = (
            self.num_active if candidates else 0
        )  # a pass over running: only when someone waits
        for seq in candidates:
            if budget <= 0 or num_active >= self.max_num_seqs:
                break
            if (
                seq.num_pending_tokens
            ):  # preempted with a draw in flight: its tokens are not all known yet
                break
            num_new = self._admit(seq, budget)
            if num_new is None:
                break
            if num_new == _NO_ADAPTER_SLOT:
                continue
            if seq.draft_token_ids:
                # Drafts handed over with a KV import (its first token follows the pulled
                # prompt): verified after that token, when the step computes nothing else of it.
                num_drafts = 0
                if num_new == seq.num_uncomputed_tokens == 1:
                    num_drafts = self._fit_drafts(seq, num_new, budget, draft_room)
                else:
                    seq.draft_token_ids = []
                num_new += num_drafts
                draft_room -= num_drafts
            self.waiting.remove(seq)
            seq.status = Status.RUNNING
            self.running.append(seq)
            num_active += 1
            batch.seqs.append(seq)
            batch.num_new_tokens.append(num_new)
            budget -= num_new
        return batch

    def _fit_drafts(self, seq: Sequence, num_new: int, budget: int, draft_room: int) -> int:
        """How many of seq's drafts the step verifies after its num_new tokens (the rest are
        dropped): as many as the token budget, the step's draft rows and the blocks seq holds or
        finds free allow. Drafts are guesses: they never preempt anything."""
        bm = self.block_manager
        drafts = seq.draft_token_ids
        capacity = (len(seq.block_table) + bm.num_free_blocks) * bm.block_size - (
            seq.num_computed_tokens + num_new
        )
        keep = max(0, min(len(drafts), budget - num_new, draft_room, capacity))
        del drafts[keep:]
        if keep:
            bm.grow(seq, num_new + keep)
        return keep

    def _admit(self, seq: Sequence, budget: int) -> int | None:
        """Gives a waiting sequence its blocks (reusing cached prefix blocks) and its adapter's slot,
        and returns how many of its tokens this step computes; None if the blocks are not free,
        _NO_ADAPTER_SLOT if every adapter slot is pinned by other adapters."""
        bm = self.block_manager
        if seq.block_table:  # a KV import: its prompt blocks are already there
            num_new = min(seq.num_uncomputed_tokens, budget)
            if not bm.can_allocate(bm.blocks_needed(seq, num_new)):
                return None
            if not self._acquire_adapter(seq):
                return _NO_ADAPTER_SLOT
            bm.grow(seq, num_new)
            return num_new
        # At least the last token is computed: its logits are what the step samples from. Prompt
        # logprobs and context logits need every prompt position's logits: nothing comes from the cache then.
        max_cached = 0 if seq.needs_prompt_rows else seq.num_tokens - 1
        cached, hashes = bm.match_prefix(
            seq.all_token_ids, seq.cache_salt, max_cached, seq.lora_fingerprint
        )
        num_cached = len(cached) * bm.block_size
        num_new = min(seq.num_tokens - num_cached, budget)
        if not bm.can_allocate(
            bm.num_free_needed(cached, bm.num_blocks_for(num_cached + num_new) - len(cached))
        ):
            return None
        if not self._acquire_adapter(seq):
            return _NO_ADAPTER_SLOT
        bm.take_cached(seq, cached, hashes, seq.num_tokens)
        if seq.num_output_tokens == 0:
            seq.num_cached_prompt_tokens = min(num_cached, seq.num_prompt_tokens)
        if seq.perf is not None:
            seq.perf.admitted(len(cached), bm.num_blocks_for(seq.num_tokens))
        bm.grow(seq, num_new)
        return num_new

    def _reserve(self, seq: Sequence, num_new: int) -> bool:
        """Make sure seq has blocks for num_new more tokens, preempting lower-priority sequences."""
        bm = self.block_manager
        num_needed = bm.blocks_needed(seq, num_new)
        if not num_needed:  # most decode steps: the token fits in the last block
            return True
        while not bm.can_allocate(num_needed):
            victim = max(self.running, key=_order)
            self._preempt(victim)
            if victim is seq:
                return False
        bm.grow(seq, num_new)
        return True

    def _acquire_adapter(self, seq: Sequence) -> bool:
        if seq.adapter is None:
            return True
        seq.lora_slot = self.lora_pool.acquire(seq.adapter)
        return seq.lora_slot is not None

    def _release_adapter(self, seq: Sequence) -> None:
        if seq.lora_slot is not None:
            self.lora_pool.release(seq.lora_slot)
            seq.lora_slot = None

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        seq.draft_token_ids = []
        self.block_manager.release(seq)
        self._release_adapter(seq)
        seq.num_computed_tokens = 0
        seq.status = Status.WAITING
        self.waiting.append(seq)
        self.num_preemptions += 1
