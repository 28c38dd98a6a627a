"""Speculative decoding's eagle3 method: an EAGLE-3 head (engine/eagle3_head.py) drafts over the
states of three of the target's layers, greedily, k tokens a step for each drafting sequence.

Where the states come from: with eagle3 on, the target model keeps the residual stream entering
the head's three layers for every row it computes (model.CausalLM.aux_layer_ids) and the runner
hands them here after each forward (record), turned into the head's hidden size by fc at once.
Decode and verify steps still replay the decode CUDA graphs: the graphs, captured with eagle3 on,
also copy the states into one buffer of the runner's (graph_aux_states). The head itself runs
eagerly, k forwards a step for all drafting sequences at once (padded to the longest).

The head's own KV, per sequence: K/V for the positions whose target token is accepted (computed
from the target's states there and the token that followed), in a buffer of the sequence's own
that grows to at most max_model_len positions and is freed when the sequence ends (finished,
aborted, or reset). A step first extends it with the positions the target computed since the
last step (the accepted ones only: rows past the sequence's computed tokens were rejected drafts,
dropped), which gives the first draft; each later draft is one row over that KV and the step's
scratch K/V of the drafts before it, kept only in the step's padded copy of the sequences' KV
(dropped after the step: a rejected draft leaves nothing a later step reads). A sequence the
target recomputes (preemption) restarts its head KV where the recompute starts. So what the
head holds is bounded by max_model_len x (2 x kv heads x head dim) values per sequence the
engine holds. A step's padded copy holds every drafting sequence's head KV padded to the longest
(drafting sequences x the longest context: what long contexts at large batches pay; a paged head
KV is the way past it) and at most BATCHED_NEW_ROWS new positions each: a sequence with more (a
prompt just computed, or the steps of a batch too large to draft) adds them to its KV alone
first, FOLD_ROWS a forward, and so does one whose recorded states outgrow MAX_PENDING_ROWS.

Across the split: a generation_only request arrives with the target's KV and not its states for
the prompt. The prefill (which computed them) proposes the first drafts with its own head and
hands them over in draft_tokens; the decode verifies those at its first step and its head starts
its KV at the first position the decode computes itself, so the head attends to no prompt
position there (fewer drafts accepted in the first steps, the outputs unchanged: the target
verifies every draft). A prompt served from the prefix cache starts the head's KV after the cached
part in the same way.

Drafts are the head's greedy tokens; verification (engine/speculative.py) keeps greedy and seeded
outputs those of plain decoding. A tensor-parallel target is refused with eagle3 for now.
"""

from __future__ import annotations

import dataclasses

import torch

from tandem.engine.eagle3_head import aux_layer_ids, load_head, read_head_config
from tandem.engine.sequence import Phase

# A sequence with more new positions than this (a prompt, or the steps of a batch too large to
# draft) adds them to its head KV alone, FOLD_ROWS a forward, before the step's batched forward:
# that one pads every drafting sequence to the most new positions, so it must stay short.
BATCHED_NEW_ROWS = 32
FOLD_ROWS = 64
# Recorded states waiting for a draft step: past this many a sequence folds them into its KV
# at once (a batch above disable_by_batch_size records every step and drafts none).
MAX_PENDING_ROWS = 256


@dataclasses.dataclass
class _HeadState:
    """One sequence's head KV (positions [kv_start, kv_start + kv_len)) and the head-size target
    states of the positions after it not yet in the KV (from `pending_start` on)."""

    kv_start: int
    keys: torch.Tensor
    values: torch.Tensor
    kv_len: int
    pending_start: int
    pending: list[torch.Tensor]
    # The last step's first draft position's head outputs, reused when no new position came.
    first: tuple[int, torch.Tensor, torch.Tensor] | None = None

    @property
    def pending_end(self) -> int:
        return self.pending_start + sum(rows.shape[0] for rows in self.pending)


class Eagle3Proposer:
    """Drafts from an EAGLE-3 head (see the module's docstring)."""

    def __init__(self, spec, runner, max_model_len: int):
        if runner.tp.is_parallel or runner.config.tensor_parallel_size > 1:
            raise ValueError(
                "--speculative-config: method 'eagle3' runs on a single-rank target for now; give "
                "tensor_parallel_size 1 (or another method)"
            )
        if runner.model_config.impl != "tandem":
            raise ValueError(
                "--speculative-config: method 'eagle3' needs tandem's own model code for the "
                "target (the transformers path does not expose its layers' states)"
            )
        self.config = spec
        mc = runner.model_config
        raw = read_head_config(spec.model)
        if raw["vocab_size"] != mc.vocab_size:
            raise ValueError(
                f"--speculative-config: the EAGLE-3 head {spec.model!r} has a vocabulary of "
                f"{raw['vocab_size']} tokens, the target {mc.vocab_size}: the head must be "
                "trained for this target"
            )
        target_hidden = raw.get("target_hidden_size") or mc.hidden_size
        if target_hidden != mc.hidden_size:
            raise ValueError(
                f"--speculative-config: hidden-size mismatch: the EAGLE-3 head {spec.model!r} "
                f"reads a target of hidden size {target_hidden}, this target's is {mc.hidden_size}"
            )
        self.layer_ids = aux_layer_ids(raw, mc.num_layers)
        self.head = load_head(
            spec.model, raw, mc.hidden_size, max_model_len + 1, runner.dtype, runner.device
        )
        if self.head.embed_tokens is None and self.head.hidden_size != mc.hidden_size:
            raise ValueError(
                f"--speculative-config: hidden-size mismatch: the EAGLE-3 head {spec.model!r} has "
                f"hidden size {self.head.hidden_size} and no embed_tokens of its own, so it "
                f"needs the target's embeddings, whose size is {mc.hidden_size}"
            )
        self.runner = runner
        self.max_model_len = max_model_len
        self._states: dict = {}
        # Context phases that finished this step: their drafts for the handoff come next.
        self._just_finished: dict = {}
        self._sweep_at = 64
        runner.enable_aux_hidden_states(self.layer_ids, self.record)

    def _embed(self, ids: list[int] | torch.Tensor) -> torch.Tensor:
        table = self.head.embed_tokens
        if table is None:
            table = self.runner.model.embed_tokens.weight
        if not isinstance(ids, torch.Tensor):
            ids = torch.tensor(ids, device=table.device)
        return table[ids]

    def record(self, batch, aux: torch.Tensor) -> None:
        """A forward's aux states [T, 3 * H_target], rows in batch order (runner's hook)."""
        # Sequences that ended without finished() (aborted) and handoffs that drafted nothing:
        # swept once the states outnumber twice what the last sweep kept.
        self._just_finished.clear()
        if len(self._states) > self._sweep_at:
            self._forget_ended()
            self._sweep_at = 2 * len(self._states) + 64
        with torch.inference_mode():
            hidden = self.head.combine(aux)
        row = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            self._record(seq, seq.num_computed_tokens, hidden[row : row + num_new])
            row += num_new

    def _record(self, seq, start: int, rows: torch.Tensor) -> None:
        state = self._states.get(seq)
        if state is not None and state.kv_start + state.kv_len <= start <= state.pending_end:
            # Rows past `start` that were recorded earlier are rejected drafts: dropped.
            kept, end = [], state.pending_start
            for chunk in state.pending:
                if end >= start:
                    break
                kept.append(chunk[: start - end])
                end += kept[-1].shape[0]
            state.pending = kept + [rows]
            # Folded up to the last position whose next token is on the host (one drawn by a
            # step still in flight is not yet).
            upto = min(start, seq.num_tokens - 1)
            if upto - state.pending_start > MAX_PENDING_ROWS:
                self._fold(seq, state, upto)
            return
        if state is not None and state.kv_start < start <= state.kv_start + state.kv_len:
            state.kv_len = start - state.kv_start  # recomputed from here: later KV is stale
            state.pending_start, state.pending, state.first = start, [rows], None
            return
        # New, or restarted before its KV (recompute from an earlier position) or after a gap.
        head = self.head
        empty = torch.empty(
            (0, head.num_kv_heads, head.head_dim), dtype=rows.dtype, device=rows.device
        )
        self._states[seq] = _HeadState(start, empty, empty.clone(), 0, start, [rows])

    def _reserve(self, state: _HeadState, need: int) -> None:
        """Room for `need` positions in the state's K/V buffers (doubling, up to the context
        length)."""
        if need <= state.keys.shape[0]:
            return
        capacity = max(min(2 * state.keys.shape[0], self.max_model_len + 1), need, 16)
        for name in ("keys", "values"):
            old = getattr(state, name)
            grown = old.new_empty((capacity, *old.shape[1:]))
            grown[: state.kv_len] = old[: state.kv_len]
            setattr(state, name, grown)

    def _write_kv(self, state: _HeadState, at: int, k: torch.Tensor, v: torch.Tensor) -> None:
        self._reserve(state, at + k.shape[0])
        state.keys[at : at + k.shape[0]] = k
        state.values[at : at + k.shape[0]] = v

    @torch.inference_mode()
    def _fold(self, seq, state: _HeadState, upto: int) -> None:
        """Adds the state's pending positions before `upto` to its KV, this sequence alone,
        FOLD_ROWS rows a forward (what a forward holds is bounded by FOLD_ROWS x its context)."""
        start = state.kv_start + state.kv_len
        rows = torch.cat(state.pending)
        num = upto - start
        device = rows.device
        for a in range(0, num, FOLD_ROWS):
            b = min(num, a + FOLD_ROWS)
            past = state.kv_len
            _, _, k, v = self.head(
                self._embed(seq.token_slice(start + a + 1, start + b + 1))[None],
                rows[a:b][None],
                torch.arange(start + a, start + b, device=device)[None],
                state.keys[None, :past],
                state.values[None, :past],
                torch.ones((1, past), dtype=torch.bool, device=device),
            )
            self._write_kv(state, past, k[0], v[0])
            state.kv_len += b - a
        state.pending_start = upto
        state.pending = [rows[num:]] if rows.shape[0] > num else []
        state.first = None

    def propose(self, seq, k: int) -> list[int]:
        """Up to k drafts to follow seq's tokens (its last one not computed by the target yet)."""
        return self._draft([(seq, k)])[seq]

    @torch.inference_mode()
    def _draft(self, wants: list[tuple]) -> dict:
        """The drafts of every (sequence, k) in wants, all sequences in each head forward: first
        the positions each computed and kept since the last step (into its KV; the last one's
        output is its first draft), then the k - 1 later drafts a row per sequence, their scratch
        K/V in this step's padded copy of the sequences' KV only."""
        found = {seq: [] for seq, _ in wants}
        items = []  # (sequence, k, state, its computed tokens, its positions to add to the KV)
        for seq, k in wants:
            state = self._states.get(seq) or self._just_finished.get(seq)
            computed = seq.num_computed_tokens
            if state is None or k < 1 or seq.num_tokens != computed + 1:
                continue
            new_start = state.kv_start + state.kv_len
            if state.pending_start != new_start or state.pending_end < computed:
                continue  # a gap: the next forward restarts this sequence's state
            num_new = computed - new_start
            if num_new > BATCHED_NEW_ROWS:
                self._fold(seq, state, computed - 1)
                num_new = 1
            if num_new == 0 and (state.first is None or state.first[0] != computed):
                continue
            items.append((seq, k, state, computed, num_new))
        if not items:
            return found
        head = self.head
        some = items[0][2].keys
        batch, device = len(items), some.device
        lengths = [state.kv_len for _, _, state, _, _ in items]
        num_past, most_new = max(lengths), max(item[4] for item in items)
        most_k = max(item[1] for item in items)
        shape = (batch, num_past + most_new + most_k, head.num_kv_heads, head.head_dim)
        keys, values = some.new_zeros(shape), some.new_zeros(shape)
        for b, (_, _, state, _, _) in enumerate(items):
            keys[b, : state.kv_len] = state.keys[: state.kv_len]
            values[b, : state.kv_len] = state.values[: state.kv_len]
        if most_new:
            hidden = some.new_zeros((batch, most_new, head.hidden_size))
            embeds = torch.zeros_like(hidden)
            positions = torch.zeros((batch, most_new), dtype=torch.long, device=device)
            for b, (seq, _, state, computed, num_new) in enumerate(items):
                if num_new:
                    start = computed - num_new
                    hidden[b, :num_new] = torch.cat(state.pending)[:num_new]
                    embeds[b, :num_new] = self._embed(seq.token_slice(start + 1, computed + 1))
                    positions[b, :num_new] = torch.arange(start, computed, device=device)
            valid = (
                torch.arange(num_past, device=device)[None]
                < torch.tensor(lengths, device=device)[:, None]
            )
            normed, stream, new_k, new_v = head(
                embeds, hidden, positions, keys[:, :num_past], values[:, :num_past], valid
            )
            for b, (_, _, state, computed, num_new) in enumerate(items):
                if num_new:
                    at = state.kv_len
                    self._write_kv(state, at, new_k[b, :num_new], new_v[b, :num_new])
                    keys[b, at : at + num_new] = new_k[b, :num_new]
                    values[b, at : at + num_new] = new_v[b, :num_new]
                    state.kv_len += num_new
                    state.pending_start, state.pending = computed, []
                    state.first = (
                        computed,
                        normed[b, num_new - 1 : num_new],
                        stream[b, num_new - 1 : num_new],
                    )
        normed = torch.cat([state.first[1] for _, _, state, _, _ in items])  # [B, H]
        stream = torch.cat([state.first[2] for _, _, state, _, _ in items])[:, None]
        # Drafts stay on the device until the last one: one read back a step.
        drafts = [head.draft_ids(normed)]
        lengths = torch.tensor([state.kv_len for _, _, state, _, _ in items], device=device)
        last = torch.tensor([item[3] - 1 for item in items], device=device)
        rows = torch.arange(batch, device=device)
        width = int(lengths.max())
        for j in range(1, most_k):
            # Draft j's row sits at its sequence's kv_len + j - 1, in this copy only.
            past = width + j - 1
            valid = torch.arange(past, device=device)[None] < (lengths + j - 1)[:, None]
            normed, stream, new_k, new_v = head(
                self._embed(drafts[-1])[:, None],
                stream,
                (last + j)[:, None],
                keys[:, :past],
                values[:, :past],
                valid,
            )
            keys[rows, lengths + j - 1] = new_k[:, 0]
            values[rows, lengths + j - 1] = new_v[:, 0]
            drafts.append(head.draft_ids(normed[:, 0]))
        table = torch.stack(drafts, dim=1).tolist()
        for b, (seq, k, _, _, _) in enumerate(items):
            found[seq] = table[b][:k]
        return found

    def propose_all(self, wants: list[tuple]) -> dict:
        """wants: (sequence, k) pairs; each sequence's drafts (at most k tokens, maybe none)."""
        self._just_finished.clear()
        self._forget_ended()
        return self._draft(wants)

    def propose_once(self, wants: list[tuple]) -> dict:
        """Drafts for handed-off context phases (their state is kept until this step's end)."""
        found = self._draft(wants)
        self._just_finished.clear()
        return found

    def _forget_ended(self) -> None:
        for seq in [seq for seq in self._states if seq.is_finished]:  # aborted ones too
            del self._states[seq]

    def finished(self, seq) -> None:
        """seq ended: its head KV goes (a context phase's stays for its handoff drafts)."""
        state = self._states.pop(seq, None)
        if state is not None and seq.phase is Phase.CONTEXT_ONLY:
            self._just_finished[seq] = state

    def reset(self) -> None:
        self._states.clear()
        self._just_finished.clear()

    def release_memory(self, tags: list[str]) -> None:
        """The head's weights stay (they are small); its KV goes with the target's."""
        if "kv_cache" in tags:
            self.reset()

    def resume_memory(self, tags: list[str]) -> None:
        pass

    def close(self) -> None:
        self.reset()
