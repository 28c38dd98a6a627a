"""Beam search over the paged KV cache, step for step as transformers' beam search decides
(generation/utils.py: _get_top_k_continuations, _get_running_beams_for_next_iteration,
_update_finished_beams, _check_early_stop_heuristic, _beam_search_has_unfinished_sequences),
with TensorRT-LLM's parameters (use_beam_search, best_of beams, n returned, length_penalty,
early_stopping: 1 stops once best_of beams are finished, 0 is the heuristic, other values never).

The beams of a request are sequences of the engine ("slots"), scheduled like any other. Each
step every live slot draws nothing itself: the sampler hands back the top K processed
log-probabilities of its next token, and once every slot has them the group picks the next
beams. A new beam forks its parent's KV: the parent's full blocks are shared (their reference
count grows) and its last, partial block is copied into a block of its own.
"""

from __future__ import annotations

from dataclasses import dataclass

from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence import FinishReason, Sequence, Status

_NEG = -1.0e9  # transformers' "very large negative value"


@dataclass
class BeamResult:
    """One returned beam: its generated tokens, the sum of their log-probabilities (the beam
    score before the length penalty) and why it ended."""

    token_ids: list[int]
    cumulative_logprob: float
    finish_reason: FinishReason
    token_logprobs: list[float]


@dataclass
class _Finished:
    score: float  # the length-penalized score it competes with
    is_finished: bool
    result: BeamResult | None = None


@dataclass
class _Candidate:
    score: float  # accumulated log-probability
    parent: Sequence
    token: int
    logprob: float
    hits_stop: bool


class BeamGroup:
    def __init__(self, root: Sequence, eos_ids: frozenset[int], max_model_len: int):
        options: SamplingOptions = root.options
        self.request_id = root.request_id
        self.options = options
        self.width = options.beam_width
        self.eos_ids = eos_ids
        self.prompt_len = root.num_prompt_tokens
        self.max_new_tokens = min(options.max_tokens, max_model_len - self.prompt_len)
        self.slots: list[Sequence] = [root]
        self.scores: dict[Sequence, float] = {root: 0.0}
        self.token_logprobs: dict[Sequence, list[float]] = {root: []}
        self.candidates: dict[Sequence, list[tuple[float, int]]] = {}
        self.finished = [_Finished(_NEG, False) for _ in range(self.width)]
        self.improvable = True  # transformers' is_early_stop_heuristic_unsatisfied
        self.done = False
        # K = max(2, 1 + number of EOS ids) * beams (transformers' beams_to_keep).
        self.num_candidates = max(2, 1 + len(eos_ids)) * self.width

    @property
    def early_stopping(self) -> bool | str:
        """TensorRT-LLM's int in transformers' terms: 1 True, 0 False (the heuristic), else "never"."""
        return {1: True, 0: False}.get(self.options.early_stopping, "never")

    def record(self, seq: Sequence, values: list[float], ids: list[int]) -> None:
        """A slot's top-K next-token log-probabilities (processed: min_tokens, bad words, bias)."""
        self.candidates[seq] = list(zip(values, ids))
        seq.awaiting_beam = True

    @property
    def ready(self) -> bool:
        return all(s in self.candidates for s in self.slots)

    def step(self) -> list[tuple[Sequence, int, float, Sequence]]:
        """Picks the next beams from every slot's candidates. Returns the new beams as (parent,
        token, accumulated score, slot that will hold it); done is set when the search ends."""
        gen_len = len(self.slots[0].output_token_ids) + 1  # generated tokens once this one is in
        pool = [
            _Candidate(
                self.scores[s] + value,
                s,
                token,
                value,
                token in self.eos_ids or gen_len >= self.max_new_tokens,
            )
            for s in self.slots
            for value, token in self.candidates[s]
        ]
        # A stable sort by score: slots in order, each slot's candidates most likely first.
        pool.sort(key=lambda c: -c.score)
        pool = pool[: self.num_candidates]
        self.candidates.clear()
        running = sorted(pool, key=lambda c: -(c.score + (_NEG if c.hits_stop else 0.0)))[
            : self.width
        ]
        self._update_finished(pool, gen_len)
        lp = self.options.length_penalty
        running_top = running[0].score + (_NEG if running[0].hits_stop else 0.0)
        best_len = self.max_new_tokens if self.early_stopping == "never" and lp > 0.0 else gen_len
        best_possible = running_top / best_len**lp
        all_finished = all(f.is_finished for f in self.finished)
        worst = min(f.score for f in self.finished) if all_finished else _NEG
        self.improvable = self.improvable and best_possible > worst
        self.done = (
            not self.improvable
            or (all_finished and self.early_stopping is True)
            or all(c.hits_stop for c in pool)
        )
        return [
            (c.parent, c.token, c.score, slot)
            for c, slot in zip(running, self._slots_for(len(running)))
        ]

    def advance(
        self, new: list[tuple[Sequence, int, float, Sequence]], block_manager
    ) -> list[tuple[int, int]]:
        """Puts the new beams in their slots: the first child of a parent takes over its blocks, the
        others fork them (full blocks shared, the partial one copied); a parent with no child gives
        its blocks back. Returns the block copies [(source, destination)] the device must make."""
        copies, contents, inherited = [], [], set()
        for parent, token, score, slot in new:
            if id(parent) in inherited:
                table, hashes, pairs = block_manager.fork(parent)
                copies += pairs
                computed = parent.num_computed_tokens if table or not parent.block_table else 0
            else:
                inherited.add(id(parent))
                table, hashes, computed = (
                    parent.block_table,
                    parent.block_hashes,
                    parent.num_computed_tokens,
                )
            contents.append(
                (
                    slot,
                    parent.output_token_ids + [token],
                    score,
                    self.token_logprobs[parent] + [score - self.scores[parent]],
                    table,
                    hashes,
                    computed,
                )
            )
        for parent in self.scores:
            if id(parent) not in inherited:
                block_manager.free(parent.block_table)
        self.scores, self.token_logprobs = {}, {}
        for slot, outputs, score, logprobs, table, hashes, computed in contents:
            slot.output_token_ids, slot.cumulative_logprob = outputs, score
            slot.block_table, slot.block_hashes, slot.num_computed_tokens = (
                list(table),
                list(hashes),
                computed,
            )
            slot.awaiting_beam = False
            self.scores[slot], self.token_logprobs[slot] = score, logprobs
        return copies

    def _update_finished(self, pool: list[_Candidate], gen_len: int) -> None:
        full = all(f.is_finished for f in self.finished) and self.early_stopping is True
        entries = list(self.finished)
        for rank, c in enumerate(pool):
            just_finished = c.hits_stop and rank < self.width
            score = c.score / gen_len**self.options.length_penalty
            if full or not self.improvable or not just_finished:
                score += _NEG
            result = None
            if just_finished:
                parent_ids = c.parent.output_token_ids
                reason = FinishReason.STOP if c.token in self.eos_ids else FinishReason.LENGTH
                result = BeamResult(
                    parent_ids + [c.token],
                    c.score,
                    reason,
                    self.token_logprobs[c.parent] + [c.logprob],
                )
            entries.append(_Finished(score, just_finished, result))
        self.finished = sorted(entries, key=lambda f: -f.score)[: self.width]

    def _slots_for(self, count: int) -> list[Sequence]:
        """The sequences that hold the next beams: the live slots, plus new ones after the first step."""
        while len(self.slots) < count:
            root = self.slots[0]
            self.slots.append(
                Sequence(
                    root.request_id,
                    root.prompt_token_ids,
                    root.options,
                    priority=root.priority,
                    cache_salt=root.cache_salt,
                    status=Status.RUNNING,
                    beam=self,
                )
            )
        return self.slots[:count]

    def results(self) -> list[BeamResult]:
        """The n best finished beams, best first (transformers' sequences[:num_return_sequences])."""
        return [f.result for f in self.finished[: self.options.n] if f.result is not None]
