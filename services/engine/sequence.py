"""The state unit of the engine: one sequence being generated."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence_perf import SequencePerf


class Phase(enum.Enum):
    """Which part of the request lifecycle this engine runs (DisaggregatedParams.request_type)."""

    CONTEXT_AND_GENERATION = 0
    CONTEXT_ONLY = 1
    GENERATION_ONLY = 2


class Status(enum.Enum):
    WAITING = "waiting"
    # A generation_only request whose prompt KV is on its way from a prefill worker: its blocks
    # are allocated, it is in no scheduler queue until the KV has landed (vLLM v1's
    # RequestStatus.WAITING_FOR_REMOTE_KVS).
    WAITING_FOR_REMOTE_KV = "waiting_for_remote_kv"
    RUNNING = "running"
    FINISHED = "finished"


class FinishReason(enum.Enum):
    STOP = "stop"
    LENGTH = "length"
    CANCELLED = "cancelled"


def natural_finish(
    options: SamplingOptions,
    num_prompt_tokens: int,
    output_token_ids: list[int],
    max_model_len: int,
) -> tuple[FinishReason | None, int | None]:
    """How a sequence whose output so far is output_token_ids ends after its last token, by its own
    options: (STOP, the end id) once min_tokens are out, (LENGTH, None) at max_tokens or the model's
    context length, else (None, None)."""
    num_output = len(output_token_ids)
    if num_output and num_output >= options.min_tokens and output_token_ids[-1] in options.end_ids:
        return FinishReason.STOP, output_token_ids[-1]
    if num_output >= options.max_tokens or num_prompt_tokens + num_output >= max_model_len:
        return FinishReason.LENGTH, None
    return None, None


@dataclass(eq=False)  # identity: queues test membership, and field-wise __eq__ is O(tokens)
class Sequence:
    request_id: str
    prompt_token_ids: list[int]
    options: SamplingOptions
    phase: Phase = Phase.CONTEXT_AND_GENERATION
    priority: float = 0.5
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    output_logprobs: list[dict[int, float]] = field(default_factory=list)
    # The beam search this sequence is a beam of (engine/beam_search.py), and whether its next
    # token's candidates wait for the other beams' (it is not scheduled meanwhile).
    beam: object | None = None
    awaiting_beam: bool = False
    # The guide's matcher (options.guide), made at the first draw from the tokens so far.
    guide_matcher: object | None = None
    # Prompt positions whose outputs (below) are in, and those outputs: top log-probabilities
    # (options.prompt_logprobs) and raw logits rows on the host (options.return_context_logits).
    num_prompt_rows: int = 0
    prompt_logprobs: list[tuple[dict[int, float], dict[int, int]]] = field(default_factory=list)
    context_logits: list = field(default_factory=list)
    cumulative_logprob: float = 0.0
    status: Status = Status.WAITING
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    block_table: list[int] = field(default_factory=list)
    # Chain hashes of the full blocks of block_table whose KV is computed (prefix cache).
    block_hashes: list[int] = field(default_factory=list)
    # Tokens whose KV is in the cache (computed here or imported from a prefill worker).
    num_computed_tokens: int = 0
    # Prompt tokens served without computing them (prefix cache or KV import).
    num_cached_prompt_tokens: int = 0
    # Tokens drawn on the device whose ids the host has not read yet (an overlapped step in
    # flight); not in output_token_ids, not in num_tokens, but they are the next tokens to compute.
    num_pending_tokens: int = 0
    arrival_time: float = field(default_factory=time.monotonic)
    # When a step first scheduled it (time.monotonic; 0.0: not yet): its queue time ends there.
    first_scheduled_at: float = 0.0
    first_token_time: float | None = None
    arrival_seq: int = 0
    # The request's LoRA adapter (lora_adapter.LoRAAdapter), and its slot in the adapter pool
    # while the sequence runs (pinned: the slot cannot be given to another adapter meanwhile).
    adapter: object | None = None
    lora_slot: int | None = None
    # What options.return_perf_metrics asks to record (None when not asked).
    perf: SequencePerf | None = None
    # Speculative decoding: the draft tokens the next step verifies after its last token (the
    # scheduler may trim them to the step's budget), and the sequence's n-gram index
    # (engine/speculative.py) that proposes them.
    draft_token_ids: list[int] = field(default_factory=list)
    spec_index: object | None = None
    # A generation_only sequence's drafts from the context phase (DisaggregatedParams.draft_tokens):
    # its first step verifies them once its prompt's KV has landed whole.
    handed_draft_token_ids: list[int] = field(default_factory=list)
    # False once the weights changed under this sequence (an update while paused in keep mode):
    # its KV mixes weights, so none of its blocks enters the prefix cache from then on.
    caches_blocks: bool = True
    # A KV import scheduled before its lease was confirmed (RemoteKvArrived(confirmed=False)):
    # its blocks stay out of the prefix cache until KvConfirmed.
    kv_unconfirmed: bool = False

    @property
    def lora_fingerprint(self) -> str | None:
        """What the adapter adds to the prefix-cache hash: KV computed under one adapter is never
        reused for another (or for none)."""
        return self.adapter.fingerprint if self.adapter is not None else None

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_slice(self, start: int, end: int) -> list[int]:
        """all_token_ids[start:end] without copying the whole sequence."""
        num_prompt = len(self.prompt_token_ids)
        if end <= num_prompt:
            return self.prompt_token_ids[start:end]
        if start >= num_prompt:
            return self.output_token_ids[start - num_prompt : end - num_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - num_prompt]

    @property
    def needs_prompt_rows(self) -> bool:
        """Asked for prompt_logprobs or context logits and not every prompt position has them yet: its
        prompt is computed whole (no prefix cache), each position once (not again after a preemption)."""
        return self.options.wants_prompt_rows and self.num_prompt_rows < self.num_prompt_tokens

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens + self.num_pending_tokens - self.num_computed_tokens

    @property
    def finishes_when_pending_lands(self) -> bool:
        """The tokens in flight end the sequence whatever their ids (a handoff, or max_tokens):
        another step for it would only compute a row to throw away."""
        return self.num_pending_tokens > 0 and (
            self.phase is Phase.CONTEXT_ONLY
            or self.num_output_tokens + self.num_pending_tokens >= self.options.max_tokens
        )
