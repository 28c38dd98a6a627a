"""What crosses the engine thread's boundary: the commands it takes and the outputs it gives.

Plain dataclasses, one per message, as mini-sglang's message/backend.py keeps them. The
gRPC side puts commands on EngineCore's queue; the engine thread applies them between
steps in arrival order and answers the ones that have a reply.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.admission import EngineLimits
from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence import FinishReason, Phase
from tandem.engine.sequence_perf import SequencePerf


# -- commands: the request path --
@dataclass(frozen=True)
class AddRequest:
    """Queue a sequence. output_token_ids: tokens already generated elsewhere (a migrated
    request, or a handoff whose KV is computed here instead of pulled).

    remote_kv: a generation_only sequence whose prompt KV a prefill worker holds. The engine
    reserves blocks for it and parks it as WAITING_FOR_REMOTE_KV; the reply is the ImportPlan
    (where to pull the KV into), or None when the pool cannot hold the prompt now.
    """

    request_id: str
    prompt_token_ids: list[int]
    options: SamplingOptions
    phase: Phase = Phase.CONTEXT_AND_GENERATION
    priority: float = 0.5
    cache_salt: str | None = None
    output_token_ids: list[int] = field(default_factory=list)
    remote_kv: bool = False
    # The request's LoRA adapter (a lora_adapter.LoRAAdapter loaded off the engine thread), or None.
    adapter: Any = None
    # When the command was sent (its wait in the queue goes into the iteration stats).
    enqueued_at: float = field(default_factory=time.monotonic)
    # A remote_kv sequence's drafts from the context phase (DisaggregatedParams.draft_tokens),
    # verified at its first step when the engine speculates (ignored otherwise).
    draft_token_ids: list[int] = field(default_factory=list)
    # A remote_kv sequence reserved before its handoff came (the decode reserves an announced
    # request's blocks while its prefill runs): no output_token_ids yet (RemoteKvArrived brings
    # them), and refused (None) unless the pool keeps headroom for the running sequences.
    ahead_of_handoff: bool = False


@dataclass(frozen=True)
class AbortRequest:
    """Stop a sequence wherever it is (queued, running, waiting for its KV) and free its blocks."""

    request_id: str


@dataclass(frozen=True)
class RemoteKvArrived:
    """A WAITING_FOR_REMOTE_KV sequence's prompt KV has landed in its blocks: schedule it.
    num_blocks: the prompt's first blocks that hold it, when only those landed (the rest of the
    prompt is computed here); None: all of them."""

    request_id: str
    num_blocks: int | None = None
    # False: the KV landed but its lease is not confirmed yet (the decode asks while the sequence
    # runs its first step): the sequence runs, but none of its blocks enters the prefix cache
    # until KvConfirmed (what it read may turn out to be another request's KV; the worker then
    # aborts it and computes the prompt, and holds its outputs until then).
    confirmed: bool = True
    # The context phase's first tokens and drafts, for a sequence reserved ahead of its handoff
    # (AddRequest.ahead_of_handoff; checked by the worker); ignored by one that has its tokens.
    first_token_ids: list[int] = field(default_factory=list)
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class KvConfirmed:
    """The lease of a sequence that RemoteKvArrived(confirmed=False) scheduled is confirmed: its
    blocks may enter the prefix cache from now on."""

    request_id: str


@dataclass(frozen=True)
class LeasePrefix:
    """Hold the cached blocks of the longest prefix of token_ids for a peer to pull (a cross-worker
    prefix pull); the reply is their device block ids ([] when none is cached), given back later
    by FreeBlocks, as a handoff's."""

    token_ids: list[int]
    cache_salt: str | None = None


@dataclass(frozen=True)
class FreeBlocks:
    """Blocks handed out under a lease (a finished context phase) come back to the pool."""

    block_ids: list[int]


# -- commands: admin and introspection (each has a reply) --
@dataclass(frozen=True)
class CheckIdle:
    """Raise PreconditionError naming `what` unless no request runs and no KV lease is out.
    unless_held: nothing is refused while the requests are frozen (pause_generation, keep)."""

    what: str
    unless_held: bool = False


@dataclass(frozen=True)
class HoldSteps:
    """held: stop stepping (pause_generation in keep mode); the requests keep their KV and other
    commands still apply. Not held: step again, each request from where it stopped."""

    held: bool


@dataclass(frozen=True)
class ReleaseMemory:
    """Reply: the memory tags released now."""

    tags: list[str]


@dataclass(frozen=True)
class ResumeMemory:
    tags: list[str]


@dataclass(frozen=True)
class SwapWeights:
    """Reply: the WeightsInfo of the new weights."""

    model: Any
    source: str
    fingerprint: str  # checkpoint_fingerprint(source), taken before the load


@dataclass(frozen=True)
class CopyWeights:
    """Write tensors into the served weights in place (an update by IPC handles): each update is
    (engine parameter, first row, end row, tensor), checked against the parameter already.
    finalize: the update is over (update_weights(None)). Either way the prefix cache is reset:
    its KV was computed with other weights."""

    updates: list
    finalize: bool = False


@dataclass(frozen=True)
class WeightsInfo:
    """Which weights the engine serves (the reply of every command that changes them)."""

    weights_id: str  # KvHandoff.weights_id (model_runner.weights_id)
    version: int


@dataclass(frozen=True)
class EngineFacts:
    """What the worker's IO side knows of its engine without asking it, fixed from the start;
    what changes (the weights, released memory) it learns from the replies of the commands
    that change it (engine_core.EngineCore)."""

    limits: EngineLimits
    model_config: ModelConfig
    dtype: str  # of the weights, a torch dtype's name ("bfloat16")
    cache_dtype: str  # of the KV pool's elements
    device: str
    # The device's key in update_weights' IPC handles (device.device_uuid).
    device_uuid: str
    kv_layout: dict  # kv_layout.kv_layout(): what a handoff's KV must match


@dataclass(frozen=True)
class ReadCounters:
    """Reply: an EngineSnapshot."""


@dataclass(frozen=True)
class WeightsChecksum:
    """Reply: the sha256 of the served weights (hex), "" when released."""


# -- outputs --
@dataclass
class Lease:
    """KV blocks a finished context phase keeps for the decode side, until released or expired."""

    lease_id: int
    block_ids: list[int]
    expires_at: float


@dataclass
class StepOutput:
    """What one step produced for one sequence."""

    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[dict[int, float] | None]
    cumulative_logprob: float
    finished: bool
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    # Set by the engine when a context_only sequence hands off: the KV blocks it keeps for the
    # decode side (finish_reason still says whether its first token ended it), until a FreeBlocks
    # gives them back.
    kept_block_ids: list[int] | None = None
    # Vocabulary ranks of the new_logprobs entries, one dict per token (None where not asked).
    new_ranks: list[dict[int, int] | None] = field(default_factory=list)
    # The prompt's per-position log-probabilities (top prompt_logprobs each, with ranks), on the
    # sequence's first output only.
    prompt_logprobs: list[tuple[dict[int, float], dict[int, int]]] | None = None
    # Beam search: the returned beams, best first, on the request's one (final) output.
    beams: list | None = None
    # Raw logits on the host: of every prompt position ([P, V], on the first output) and of each
    # new token's draw (one [V] row per token), when the options ask for them.
    context_logits: Any = None
    generation_logits: list | None = None
    # When a step first scheduled the sequence (time.monotonic), on each of its outputs.
    first_scheduled_at: float = 0.0
    # The sequence's perf metrics so far (engine/sequence_perf.SequencePerf) on each of its outputs,
    # when its options ask for them (return_perf_metrics); the worker sends the last one.
    perf: SequencePerf | None = None
    # The lease the worker's lease table opened over kept_block_ids (engine_core.EngineCore, on
    # the loop, as the output is delivered; never set by the engine).
    lease: Lease | None = None
    # With kept_block_ids, when the engine speculates: the drafts it proposes to follow the first
    # token (DisaggregatedParams.draft_tokens), for the decode side to verify at its first step.
    draft_token_ids: list[int] = field(default_factory=list)


@dataclass
class ImportPlan:
    """Where a generation_only request's KV goes: the first num_cached_blocks prompt blocks were
    found in our prefix cache; the prefill's remaining blocks are pulled into block_ids."""

    num_cached_blocks: int
    block_ids: list[int]


@dataclass
class EngineFailure:
    """Delivered to a request's stream when the engine could not run it."""

    error: BaseException


@dataclass(frozen=True)
class EngineSnapshot:
    """Counters of the engine at one point between steps."""

    num_total_blocks: int
    num_free_blocks: int
    num_unfinished: int
    num_waiting_for_remote_kv: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_steps: int
    weight_bytes: int
    kv_cache_bytes: int
    weights_source: str
    weights_version: int
    num_running: int = 0
    num_waiting: int = 0  # queued; those waiting for remote KV are num_waiting_for_remote_kv
    # Prompt tokens of the running and queued sequences not computed yet.
    num_queued_prompt_tokens: int = 0
    num_preemptions: int = 0
    num_prefix_query_tokens: int = 0
    num_prefix_hit_tokens: int = 0
    # The LoRA adapters in the device pool now: (lora_name, lora_int_id, lora_path) each.
    lora_adapters: tuple[tuple[str, int, str], ...] = ()
    # Speculative decoding: drafts verified, drafts accepted, sequence-steps with drafts.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_drafted_steps: int = 0


def coalesce(earlier: list[StepOutput], later: list[StepOutput]) -> list[StepOutput]:
    """The outputs of two consecutive steps as one step's: each sequence's new tokens (logprobs,
    ranks, logits) appended, its state (cumulative logprob, finish, lease, perf) the later one's,
    its first output's prompt fields kept."""
    if not earlier:
        return later
    merged = list(earlier)
    by_id = {out.request_id: out for out in earlier}
    for out in later:
        first = by_id.get(out.request_id)
        if first is None:
            by_id[out.request_id] = out
            merged.append(out)
            continue
        first.new_ranks = (first.new_ranks or [None] * len(first.new_logprobs)) + (
            out.new_ranks or [None] * len(out.new_logprobs)
        )
        first.new_token_ids = first.new_token_ids + out.new_token_ids
        first.new_logprobs = first.new_logprobs + out.new_logprobs
        if out.generation_logits:
            first.generation_logits = (first.generation_logits or []) + out.generation_logits
        first.num_cached_prompt_tokens = max(
            first.num_cached_prompt_tokens, out.num_cached_prompt_tokens
        )
        for name in (
            "cumulative_logprob",
            "finished",
            "finish_reason",
            "stop_token_id",
            "kept_block_ids",
            "draft_token_ids",
            "lease",
            "beams",
            "perf",
        ):
            setattr(first, name, getattr(out, name))
    return merged
