"""Validated per-request sampling options, the engine's view of SamplingParams."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Any


@dataclass(frozen=True)
class SamplingOptions:
    max_tokens: int = 32
    min_tokens: int = 0
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    n: int = 1
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logprobs: int | None = None
    prompt_logprobs: int | None = None
    detokenize: bool = True
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # End-of-sequence ids of the model (or end_id); ignored when ignore_eos.
    eos_token_ids: tuple[int, ...] = field(default_factory=tuple)
    # Token sequences never generated (bad_token_ids are one-token words; `bad` strings tokenized).
    bad_words: tuple[tuple[int, ...], ...] = ()
    # No n-gram of this size appears twice in the sequence (0: off).
    no_repeat_ngram_size: int = 0
    # Added to the logits before sampling, one float per vocabulary entry (empty: none).
    embedding_bias: tuple[float, ...] = ()
    # Return the raw logits of every prompt position / of each drawn token.
    return_context_logits: bool = False
    return_generation_logits: bool = False
    # Record the sequence's performance metrics (engine/sequence_perf.py); off: nothing is recorded.
    return_perf_metrics: bool = False
    # Beam search (use_beam_search): beams searched, returned are n; TensorRT-LLM's defaults.
    beam_width: int = 1
    length_penalty: float = 0.0
    early_stopping: int = 1
    # The compiled grammar the output follows (guided_decoding; engine/guided.py), or None.
    guide: Any = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        if self.max_tokens <= 0:
            raise ValueError(f"max_tokens must be > 0, got {self.max_tokens}")
        if self.min_tokens < 0 or self.min_tokens > self.max_tokens:
            raise ValueError(
                f"min_tokens must be in [0, max_tokens={self.max_tokens}], got {self.min_tokens}"
            )
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0 (0 disables), got {self.top_k}")
        if not 0.0 < self.top_p <= 1.0:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0.0 <= self.min_p <= 1.0:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.repetition_penalty <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        if not -2.0 <= self.presence_penalty <= 2.0 or not -2.0 <= self.frequency_penalty <= 2.0:
            raise ValueError("presence_penalty and frequency_penalty must be in [-2, 2]")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise ValueError(f"{name} must be in [0, 20], got {value}")
        if any(not s for s in self.stop):
            raise ValueError("stop strings must not be empty")
        if any(not w for w in self.bad_words):
            raise ValueError("bad words must not be empty")
        if self.beam_width < 1 or (self.beam_width > 1 and self.n > self.beam_width):
            raise ValueError(
                f"beam search returns at most its {self.beam_width} beams, got n={self.n}"
            )
        if self.no_repeat_ngram_size < 0:
            raise ValueError(f"no_repeat_ngram_size must be >= 0, got {self.no_repeat_ngram_size}")

    # The derived values below are read for every sequence of every step: each is computed once
    # (the options are frozen), cached_property keeps it in the instance's __dict__.
    @cached_property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0

    @cached_property
    def needs_token_ids(self) -> bool:
        """Its next draw depends on the ids drawn so far (not only on how many): an overlapped
        step must read them back first."""
        return (
            self.has_penalties
            or self.no_repeat_ngram_size > 0
            or any(len(w) > 1 for w in self.bad_words)
            or self.guide is not None
            or self.beam_width > 1
        )

    @cached_property
    def has_penalties(self) -> bool:
        return (
            self.repetition_penalty != 1.0
            or self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
        )

    @cached_property
    def wants_only_draws(self) -> bool:
        """The sampler owes it nothing but the drawn id and its log-probability: no penalty, bias,
        top log-probabilities, beam candidates or logits rows (most requests)."""
        return not (
            self.has_penalties
            or self.embedding_bias
            or self.logprobs is not None
            or self.beam_width > 1
            or self.return_generation_logits
        )

    @cached_property
    def wants_prompt_rows(self) -> bool:
        """It asks for an output of every prompt position: prompt_logprobs or the context logits."""
        return bool(self.prompt_logprobs) or self.return_context_logits

    @cached_property
    def may_ban_tokens(self) -> bool:
        """Some draw of it may have ids blocked (logits_masks.banned_ids): min_tokens, bad words or
        no repeated n-grams."""
        return self.min_tokens > 0 or bool(self.bad_words) or self.no_repeat_ngram_size > 0

    @property
    def num_beam_candidates(self) -> int:
        """Candidates a beam keeps per step: max(2, 1 + end ids) x beams (transformers' beams_to_keep)."""
        return max(2, 1 + len(self.end_ids)) * self.beam_width

    def eos_ids(self) -> frozenset[int]:
        """The end ids (the model's EOS or end_id) that end this sequence, stop tokens aside."""
        return frozenset(() if self.ignore_eos else self.eos_token_ids)

    @cached_property
    def end_ids(self) -> frozenset[int]:
        """Token ids that finish the sequence once min_tokens are out."""
        ids = set(self.stop_token_ids)
        if not self.ignore_eos:
            ids.update(self.eos_token_ids)
        return frozenset(ids)


def for_generation_phase(options: SamplingOptions) -> SamplingOptions:
    """A generation_only sequence's options: the context phase had the prompt, so no prompt rows
    (prompt_logprobs, context logits) are computed here. The same object when nothing changes
    (a replace costs ~50 us: every handoff's path takes this)."""
    if options.prompt_logprobs is None and not options.return_context_logits:
        return options
    return replace(options, prompt_logprobs=None, return_context_logits=False)
