"""What a request is checked against before it is queued: the engine's limits as plain data.
The worker's IO side checks a request against them without touching the engine, and the engine
checks what reaches it against the same ones (one check each, in one place)."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.common.exceptions import ResourceExhaustedError
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.speculative import MAX_SPECULATIVE_TOKENS


class PromptTooLongError(ValueError):
    """The prompt exceeds the model's context length (INVALID_ARGUMENT)."""


class PromptNeverFitsError(ResourceExhaustedError):
    """The prompt needs more KV blocks than the whole pool has (RESOURCE_EXHAUSTED)."""


@dataclass(frozen=True)
class EngineLimits:
    max_model_len: int
    block_size: int
    num_blocks: int
    vocab_size: int
    tensor_parallel_size: int = 1
    # Draft tokens a step verifies per sequence (speculative decoding); 0: the engine drafts and
    # verifies none.
    num_speculative_tokens: int = 0

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def check_prompt(self, num_prompt_tokens: int, vocab_ids: list[int] | None = None) -> None:
        """Raises the error a prompt of that length (and, given, of those ids) would meet."""
        if num_prompt_tokens == 0:
            raise ValueError("the prompt is empty: give at least one token")
        if num_prompt_tokens >= self.max_model_len:
            raise PromptTooLongError(
                f"the prompt has {num_prompt_tokens} tokens; the model's context is "
                f"{self.max_model_len} tokens and at least one must be left to generate"
            )
        needed = self.num_blocks_for(num_prompt_tokens + 1)
        if needed > self.num_blocks:
            raise PromptNeverFitsError(
                f"the prompt needs {needed} KV blocks; the pool has {self.num_blocks}"
            )
        if vocab_ids and (min(vocab_ids) < 0 or max(vocab_ids) >= self.vocab_size):
            bad = [t for t in vocab_ids if not 0 <= t < self.vocab_size]
            raise ValueError(f"token ids out of vocabulary [0, {self.vocab_size}): {bad[:8]}")

    def check_draft_tokens(self, draft_token_ids: list[int]) -> None:
        """Drafts handed to a generation phase (DisaggregatedParams.draft_tokens). An engine that
        verifies drafts takes at most MAX_SPECULATIVE_TOKENS of them (what any worker's
        --speculative-config may propose), each an id of the vocabulary (its rows index the
        logits), and verifies the first num_speculative_tokens (a prefill that drafts more than
        this decode verifies still hands off); one that verifies none ignores them unread."""
        if not self.num_speculative_tokens or not draft_token_ids:
            return
        if len(draft_token_ids) > MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"disaggregated_params.draft_tokens has {len(draft_token_ids)} tokens; at most "
                f"{MAX_SPECULATIVE_TOKENS} are taken (this worker verifies "
                f"{self.num_speculative_tokens}, its --speculative-config num_speculative_tokens)"
            )
        bad = [t for t in draft_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(
                f"disaggregated_params.draft_tokens out of vocabulary [0, {self.vocab_size}): "
                f"{bad[:8]}"
            )

    def check_options(self, options: SamplingOptions) -> None:
        """Token ids in the options index the logits: out of range they would fail a whole step."""
        vocab = self.vocab_size
        bad = [t for t in options.stop_token_ids + options.eos_token_ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"stop_token_ids / end_id out of vocabulary [0, {vocab}): {bad[:8]}")
        bad = [t for word in options.bad_words for t in word if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"bad_token_ids out of vocabulary [0, {vocab}): {bad[:8]}")
        if options.embedding_bias and len(options.embedding_bias) != vocab:
            raise ValueError(
                f"embedding_bias has {len(options.embedding_bias)} values; the vocabulary has {vocab}"
            )
        if self.tensor_parallel_size > 1:
            # Rank 0 alone reads prompt rows (a gathered LM head) and copies forked beams' KV.
            asked = [
                name
                for name, on in (
                    ("prompt_logprobs", bool(options.prompt_logprobs)),
                    ("return_context_logits", options.return_context_logits),
                    ("use_beam_search", options.beam_width > 1),
                )
                if on
            ]
            if asked:
                raise NotImplementedError(
                    f"{', '.join(asked)} on a tensor-parallel worker is not supported yet; "
                    "send it to a worker with --tensor-parallel-size 1"
                )
