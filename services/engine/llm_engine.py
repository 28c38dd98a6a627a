"""Requests in, per-step outputs out. Single-threaded: the worker's engine thread owns it."""

from __future__ import annotations

import dataclasses
import hashlib
import time
from dataclasses import dataclass, field

import torch

from tandem.common.exceptions import PreconditionError
from tandem.engine.admission import EngineLimits
from tandem.engine.beam_search import BeamGroup
from tandem.engine.block_manager import BlockManager
from tandem.engine.config import EngineConfig
from tandem.engine.device import device_uuid
from tandem.engine.draft_model import DraftModelProposer
from tandem.engine.eagle3 import Eagle3Proposer
from tandem.engine.kv_tier import HostKvTier
from tandem.engine.lora_adapter import LoRAAdapter
from tandem.engine.messages import (
    EngineFacts,
    EngineSnapshot,
    ImportPlan,
    StepOutput,
    WeightsInfo,
    coalesce,
)
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampler import SampledBatch
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.scheduler import ScheduledBatch, Scheduler
from tandem.engine.sequence import FinishReason, Phase, Sequence, Status, natural_finish
from tandem.engine.sequence_perf import SequencePerf
from tandem.engine.speculative import Proposer


@dataclass
class InFlightStep:
    """A step queued on the device: its batch, the sequences that draw a token, their draws."""

    batch: ScheduledBatch
    sampled: list[Sequence]
    draws: SampledBatch | None
    started: float
    # Its number (EngineCounters.iteration): the iteration of the perf metrics of what it draws.
    iteration: int = 0
    # The draft tokens it verifies, by sequence (speculative decoding): their rows follow the
    # sequence's first row in `sampled`, one per draft.
    drafts: dict[Sequence, list[int]] = field(default_factory=dict)

    @property
    def needs_ids(self) -> bool:
        """The next step cannot run before these ids are on the host: a penalty counts them, a bad
        word or an n-gram matches them. (A step that verifies drafts is never left in flight.)"""
        return any(seq.options.needs_token_ids for seq in self.sampled)


@dataclass
class EngineCounters:
    num_steps: int = 0
    # Steps launched so far (ahead of num_steps by the one in flight when overlapped).
    iteration: int = 0
    num_prompt_tokens_computed: int = 0
    num_generated_tokens: int = 0
    last_step_seconds: float = 0.0
    last_batch: dict = field(default_factory=dict)
    # Speculative decoding, in all: drafts verified, those accepted, sequence-steps that had drafts.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    num_drafted_steps: int = 0
    # The last step's (TensorRT-LLM's specDecodingStats), and the seconds its drafts took.
    last_spec: dict = field(default_factory=dict)


class LLMEngine:
    MEMORY_TAGS = ("model", "kv_cache")

    def __init__(self, config: EngineConfig, hands_off: bool = False):
        """hands_off: the engine runs context_only requests, whose KV it keeps for the decode side
        (a prefill worker's: StepOutput.kept_block_ids) until FreeBlocks gives it back."""
        self.config = config
        self.runner = ModelRunner(config)
        self.model_config = self.runner.model_config
        self.max_model_len = self.runner.max_model_len
        host_tier = (
            HostKvTier(self.runner.host_kv.shape[0]) if self.runner.host_kv is not None else None
        )
        self.block_manager = BlockManager(
            self.runner.num_blocks, config.block_size, config.enable_prefix_caching, host_tier
        )
        self.scheduler = Scheduler(
            self.block_manager,
            config.max_num_seqs,
            config.max_num_batched_tokens,
            self.runner.lora_pool,
            config.max_num_samples - config.max_num_seqs,
        )
        self.counters = EngineCounters()
        spec = config.speculative
        # What requests are checked against, here and (a copy) on the worker's IO side.
        self.limits = EngineLimits(
            self.max_model_len,
            config.block_size,
            self.runner.num_blocks,
            self.model_config.vocab_size,
            config.tensor_parallel_size,
            spec.num_speculative_tokens if spec is not None else 0,
        )
        # Speculative decoding's drafts come from the tokens so far: a step that drafts reads the
        # last step's ids first (no overlap then), as vLLM's n-gram proposer also needs; a step
        # with nothing to draft (a prefill's context phases, a batch past disable_by_batch_size)
        # stays overlapped.
        self.proposer = self._proposer(spec)
        self.overlap_scheduling = config.overlap_scheduling
        self.hands_off = hands_off
        # Block groups handed off (kept for the decode side) and not freed yet.
        self.num_handed_off = 0
        # True when the last step found nothing it could run (everything waits for blocks).
        self.last_step_was_idle = False
        # The batches of the step being run (the one scheduled, and the one in flight when
        # overlapped): the requests a failed step fails.
        self._current_batches: list[ScheduledBatch] = []
        # Every sequence the engine owns: queued, running or WAITING_FOR_REMOTE_KV.
        self._seqs: dict[str, Sequence] = {}
        # KV imports that finished before their lease was confirmed: their blocks wait for the
        # answer (kv_confirmed caches then frees them; abort_request frees them uncached).
        self._unconfirmed_done: dict[str, Sequence] = {}
        # The launched step whose draws the host has not read yet (overlap_scheduling).
        self._in_flight: InFlightStep | None = None
        # Context phases handed off by the step being postprocessed, with their outputs: the
        # drafts proposed after their first token go with the handoff (speculative decoding).
        self._handing_off: list[tuple[Sequence, StepOutput]] = []

    def _proposer(self, spec):
        if spec is None:
            return None
        if spec.method == "eagle3":
            return Eagle3Proposer(spec, self.runner, self.max_model_len)
        if spec.method != "draft_model":
            return Proposer(spec)
        return DraftModelProposer(
            spec, self.config, self.model_config, self.runner.num_blocks, type(self)
        )

    @property
    def num_unfinished(self) -> int:
        """Sequences the scheduler will run (those waiting for remote KV are not among them yet)."""
        return self.scheduler.num_unfinished

    @property
    def has_step_in_flight(self) -> bool:
        """Whether the device still computes a launched step whose draws are still to be read
        (overlap scheduling on an accelerator; on the CPU a step has run by the time it is
        launched): its draws' event not reached yet (a step without one counts as running)."""
        step = self._in_flight
        if step is None or self.runner.device.type == "cpu":
            return False
        ready = step.draws.ready if step.draws is not None else None
        return ready is None or not ready.query()

    @property
    def current_batch_ids(self) -> list[str]:
        """The requests of the step being run; read only when it failed, so not built every step."""
        return [seq.request_id for batch in self._current_batches for seq in batch.seqs]

    @property
    def num_waiting_for_remote_kv(self) -> int:
        """KV imports not done with: parked for their KV, or finished before their lease was
        confirmed (their blocks and last outputs wait for the answer)."""
        parked = sum(1 for s in self._seqs.values() if s.status is Status.WAITING_FOR_REMOTE_KV)
        return parked + len(self._unconfirmed_done)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._seqs

    # -- admission --
    def check_prompt(self, num_prompt_tokens: int, vocab_ids: list[int] | None = None) -> None:
        """Raises the error a prompt of that length would meet (admission.EngineLimits)."""
        self.limits.check_prompt(num_prompt_tokens, vocab_ids)

    def check_options(self, options: SamplingOptions) -> None:
        self.limits.check_options(options)

    def _new_sequence(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: SamplingOptions,
        phase: Phase,
        priority: float,
        cache_salt: str | None,
        output_token_ids: list[int] | None,
        adapter: LoRAAdapter | None,
    ) -> Sequence:
        if request_id in self._seqs:
            raise ValueError(f"request id {request_id!r} is already running")
        output_token_ids = list(output_token_ids or ())
        self.check_prompt(
            len(prompt_token_ids) + len(output_token_ids), list(prompt_token_ids) + output_token_ids
        )
        self.check_options(options)
        if phase is Phase.CONTEXT_ONLY and not self.hands_off:
            raise PreconditionError(
                "this engine keeps no KV leases (not a prefill worker): it cannot run "
                "context_only requests"
            )
        if adapter is not None and self.runner.lora_pool is None:
            raise PreconditionError(
                f"this worker serves no LoRA adapters (--max-loras 0, or a model on the "
                f"transformers path): {adapter.describe()}"
            )
        if adapter is not None and self.config.deterministic:
            raise PreconditionError(
                f"this worker runs --deterministic, whose batch-invariant schedule does not cover "
                f"LoRA adapters (their deltas are computed per adapter group): {adapter.describe()}"
            )
        return Sequence(
            request_id,
            list(prompt_token_ids),
            options,
            phase=phase,
            priority=priority,
            cache_salt=cache_salt,
            output_token_ids=output_token_ids,
            adapter=adapter,
            perf=SequencePerf() if options.return_perf_metrics else None,
        )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        options: SamplingOptions,
        phase: Phase = Phase.CONTEXT_AND_GENERATION,
        priority: float = 0.5,
        cache_salt: str | None = None,
        output_token_ids: list[int] | None = None,
        adapter: LoRAAdapter | None = None,
    ) -> Sequence:
        """output_token_ids: tokens already generated elsewhere (a handoff computed here instead of pulled).
        adapter: the request's LoRA adapter (lora_adapter.AdapterStore.load), or None for the base model."""
        seq = self._new_sequence(
            request_id,
            prompt_token_ids,
            options,
            phase,
            priority,
            cache_salt,
            output_token_ids,
            adapter,
        )
        if options.beam_width > 1:
            if phase is not Phase.CONTEXT_AND_GENERATION or output_token_ids:
                raise NotImplementedError(
                    "use_beam_search runs on an aggregated worker, from the prompt"
                )
            if adapter is not None:
                raise NotImplementedError(
                    "use_beam_search with a lora_request is not supported yet: send one or "
                    "the other"
                )
            seq.beam = BeamGroup(seq, options.end_ids, self.max_model_len)
        self._seqs[request_id] = seq
        self.scheduler.add(seq)
        return seq

    def add_remote_kv_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        first_token_ids: list[int],
        options: SamplingOptions,
        priority: float = 0.5,
        cache_salt: str | None = None,
        adapter: LoRAAdapter | None = None,
        draft_token_ids: list[int] | None = None,
        phase: Phase = Phase.GENERATION_ONLY,
        ahead_of_handoff: bool = False,
    ) -> ImportPlan | None:
        """A generation_only sequence whose prompt KV comes from a prefill worker (or, phase
        context_and_generation / context_only with no first tokens, a prompt whose prefix comes from
        a peer's prefix cache: decode/prefix_pull.py): allocates its blocks
        and parks it as WAITING_FOR_REMOTE_KV until remote_kv_arrived(). Prompt blocks already in the
        prefix cache are reused; the plan says which of the prefill's blocks still have to be pulled,
        into which of ours. None when the pool cannot hold the prompt now (the caller then computes
        the prompt here instead, or asks again later: the answer costs a prefix lookup, nothing
        more, and never waits for the device). draft_token_ids: the context phase's drafts
        (DisaggregatedParams.draft_tokens), verified at the sequence's first step when this engine
        speculates (checked by EngineLimits.check_draft_tokens), ignored when it does not.
        ahead_of_handoff: reserved before the handoff came (an announced request, while its prefill
        runs: no first tokens yet, remote_kv_arrived brings them), so held longer: only while the
        pool keeps a block free for each sequence the scheduler has and a twentieth of itself."""
        self.limits.check_draft_tokens(draft_token_ids or [])
        bm = self.block_manager
        num_prompt = len(prompt_token_ids)
        cached, hashes = bm.match_prefix(
            prompt_token_ids,
            cache_salt,
            # A prompt run here computes its last token at least (its logits give the first token).
            num_prompt if phase is Phase.GENERATION_ONLY else num_prompt - 1,
            adapter.fingerprint if adapter is not None else None,
        )
        # Room for the first generated token's KV too: a parked sequence that still needed a block
        # could wait behind a preempted sequence that needs the same blocks, forever.
        num_blocks = bm.num_blocks_for(num_prompt + 1)
        headroom = self.scheduler.num_unfinished + bm.num_blocks // 20 if ahead_of_handoff else 0
        if not bm.can_allocate(bm.num_free_needed(cached, num_blocks - len(cached)) + headroom):
            return None
        seq = self._new_sequence(
            request_id,
            prompt_token_ids,
            options,
            phase,
            priority,
            cache_salt,
            first_token_ids,
            adapter,
        )
        if self._in_flight is not None:
            # Blocks freed while a step was in flight (an abort, a preemption) may still be written
            # by it; the KV pulled into them arrives outside the device's stream order.
            self.runner.synchronize()
        bm.take_cached(seq, cached, hashes, seq.num_prompt_tokens)
        seq.block_table += bm.allocate(num_blocks - len(cached))
        if self._flush_kv_tier():
            # Blocks reused before their copies down landed: the pull writes outside stream order.
            self.runner.synchronize()
        if seq.perf is not None:  # the blocks not found here are the ones pulled
            seq.perf.admitted(len(cached), bm.num_blocks_for(seq.num_prompt_tokens))
        seq.status = Status.WAITING_FOR_REMOTE_KV
        if self.proposer is not None and draft_token_ids:
            seq.handed_draft_token_ids = list(draft_token_ids)
        self._seqs[request_id] = seq
        num_prompt_blocks = bm.num_blocks_for(seq.num_prompt_tokens)
        return ImportPlan(
            num_cached_blocks=len(cached),
            block_ids=seq.block_table[len(cached) : num_prompt_blocks],
        )

    def remote_kv_arrived(
        self,
        request_id: str,
        num_blocks: int | None = None,
        confirmed: bool = True,
        first_token_ids: list[int] | None = None,
        draft_token_ids: list[int] | None = None,
    ) -> None:
        """The prompt's KV has landed in the reserved blocks: schedule the sequence for decoding.
        num_blocks: only the first num_blocks of them hold it (a pull that failed part-way): the
        rest of the prompt is computed here first, as a prefill continues from a cached prefix.
        confirmed=False: its lease is not confirmed yet; none of its blocks is cached until
        kv_confirmed(). first_token_ids, draft_token_ids: the context phase's, for a sequence
        reserved ahead of its handoff (the worker checked them as add_remote_kv_request would)."""
        seq = self._seqs.get(request_id)
        if seq is None or seq.status is not Status.WAITING_FOR_REMOTE_KV:
            return  # aborted while its KV was on the way
        if first_token_ids and not seq.output_token_ids:
            seq.output_token_ids = list(first_token_ids)
            if self.proposer is not None and draft_token_ids:
                seq.handed_draft_token_ids = list(draft_token_ids)
        num_valid = seq.num_prompt_tokens
        if num_blocks is not None:
            num_valid = min(num_valid, num_blocks * self.block_manager.block_size)
        seq.num_computed_tokens = seq.num_cached_prompt_tokens = num_valid
        seq.kv_unconfirmed = not confirmed
        self.block_manager.register_computed(seq)
        handed, seq.handed_draft_token_ids = seq.handed_draft_token_ids, []
        if handed and seq.num_uncomputed_tokens == 1:
            # The whole prompt landed: its first step computes the first token and verifies the
            # handed drafts after it in one forward (a prompt computed here in part drops them;
            # this engine's own proposer drafts from its next step on).
            seq.draft_token_ids = handed[: self._draft_room(seq)]
        self.scheduler.add(seq)

    def kv_confirmed(self, request_id: str) -> None:
        """The lease of a sequence scheduled with remote_kv_arrived(confirmed=False) is confirmed:
        its full computed blocks (the imported prompt's and any its steps filled since) enter the
        prefix cache (a sequence that finished meanwhile: then its blocks go back)."""
        done = self._unconfirmed_done.pop(request_id, None)
        seq = done or self._seqs.get(request_id)
        if seq is None or not seq.kv_unconfirmed:
            return
        seq.kv_unconfirmed = False
        self.block_manager.register_computed(seq)
        if done is not None:
            self.block_manager.release(done)
            if self.proposer is not None:
                self.proposer.finished(done)

    def lease_prefix(self, token_ids: list[int], cache_salt: str | None) -> list[int]:
        """The device blocks of the longest prefix of token_ids (whole blocks) the prefix cache
        holds, in the device pool or the host tier, held for a peer to read (a cross-worker prefix
        pull): one more reference each until free_blocks() gives them back, as a handoff's. Blocks
        in the host tier are copied up into fresh device blocks first (the peer's READ sees device
        memory only: the tier is not registered with NIXL), within what the pool has free; the
        lease stops at the first block that finds no room. [] when none is held."""
        bm = self.block_manager
        cached, hashes = bm.match_prefix(token_ids, cache_salt, len(token_ids))
        while cached and not bm.can_allocate(bm.num_free_needed(cached, 0)):
            cached, hashes = cached[:-1], hashes[:-1]
        if not cached:
            return []
        if self._in_flight is not None:
            self.runner.synchronize()  # a step in flight must not hold a block about to be read
        blocks = bm.take(cached, hashes)
        if self._flush_kv_tier():
            self.runner.synchronize()  # the copies up land before the peer reads them
        self.num_handed_off += 1
        return blocks

    def abort_request(self, request_id: str) -> bool:
        done = self._unconfirmed_done.pop(request_id, None)
        if done is not None:  # its lease was refused: what it computed is dropped uncached
            self.block_manager.release(done)
            return True
        seq = self._seqs.pop(request_id, None)
        if seq is None:
            return False
        if seq.status is Status.WAITING_FOR_REMOTE_KV:
            self.block_manager.release(seq)
        for slot in seq.beam.slots if seq.beam is not None else [seq]:
            if slot.status is not Status.WAITING_FOR_REMOTE_KV:
                self.scheduler.remove(slot)
            slot.status = Status.FINISHED
            slot.finish_reason = FinishReason.CANCELLED
        return True

    def free_blocks(self, block_ids: list[int]) -> None:
        """Handed-off blocks come back (their lease ended, or their output reached nobody): they
        return to the pool and stay findable by the prefix cache."""
        self.block_manager.free(block_ids)
        self.num_handed_off -= 1

    # -- admin: memory and weights (RL flows: pause, release, update weights, resume) --
    def require_idle(self, what: str, held: bool = False) -> None:
        """Refuses `what` while requests run or KV handoffs wait: both hold KV of the current
        weights in the current pool. held: the requests are frozen (pause_generation, keep)."""
        busy = len(self._seqs) + len(self._unconfirmed_done) + self.num_handed_off
        if busy:
            kept = " (paused in mode 'keep', they hold their KV: pause in mode 'abort')"
            raise PreconditionError(
                f"{busy} requests or KV handoffs are in flight; call pause_generation before "
                f"{what}{kept if held else ''}"
            )

    def _weights_may_change(self, held: bool) -> None:
        """Weights change while nothing runs, or (held: paused in keep mode, vLLM's in-flight
        update) under frozen requests, which continue on the new weights from KV of the old."""
        self.runner.require_single_rank("update_weights")
        if not held:
            self.require_idle("update_weights")

    def _forget_kv_of_old_weights(self) -> None:
        """KV computed with the old weights must not meet requests that start on the new ones:
        the prefix cache forgets it, and the requests running across the change (their KV mixes
        both) cache none of theirs."""
        self.block_manager.reset_prefix_cache()
        for seq in (*self._seqs.values(), *self._unconfirmed_done.values()):
            seq.caches_blocks = False

    def swap_weights(self, model, source: str, fingerprint: str, held: bool = False) -> WeightsInfo:
        self._weights_may_change(held)
        self.runner.swap_weights(model, source, fingerprint)
        self._forget_kv_of_old_weights()
        return self.weights_info()

    def weights_info(self) -> WeightsInfo:
        return WeightsInfo(self.runner.weights_id, self.runner.weights_version)

    def facts(self) -> EngineFacts:
        runner, config = self.runner, self.config
        dtype = str(runner.dtype).removeprefix("torch.")
        return EngineFacts(
            self.limits,
            self.model_config,
            dtype,
            dtype if config.kv_cache_dtype == "auto" else config.kv_cache_dtype,
            str(runner.device),
            device_uuid(runner.device),
            runner.kv_layout,
        )

    def copy_weights(self, updates: list, finalize: bool, held: bool = False) -> WeightsInfo:
        """Tensors written into the served weights in place (messages.CopyWeights)."""
        self._weights_may_change(held)
        if "model" in self.released_tags:
            raise PreconditionError(
                "the model weights are released; call resume(['model']) before update_weights"
            )
        self.runner.copy_weights(updates, finalize)
        self._forget_kv_of_old_weights()
        return self.weights_info()

    def release_memory(self, tags: list[str], held: bool = False) -> list[str]:
        """Frees the memory behind tags. Refused while requests run or leases are out."""
        self.runner.require_single_rank("release")
        self.require_idle("release", held)
        if "model" in tags:
            self.runner.check_weights_restorable()
        if "kv_cache" in tags:
            self.block_manager.reset_prefix_cache()
            self.runner.release_kv_cache()
        if "model" in tags:
            self.runner.release_weights()
        if self.proposer is not None:
            self.proposer.release_memory(tags)
        return self.released_tags

    def resume_memory(self, tags: list[str]) -> list[str]:
        self.runner.require_single_rank("resume")
        if "model" in tags:
            self.runner.restore_weights()
        if "kv_cache" in tags:
            self.runner.restore_kv_cache()
        if self.proposer is not None:
            self.proposer.resume_memory(tags)
        return self.released_tags

    def warm_up(self) -> float:
        """One prefill and one decode step so the first real request does not pay for lazy init;
        the attention kernel's eager variants compiled before any request can need one. The
        counters start at zero after it. Returns the seconds the kernel variants took."""
        seconds = self.runner.precompile_kernels()
        self.add_request(
            "warmup",
            [min(1, self.model_config.vocab_size - 1)] * 4,
            SamplingOptions(max_tokens=2, ignore_eos=True),
        )
        while self.num_unfinished:
            self.step()
        if self.proposer is not None:
            self.proposer.reset()
        c = self.counters
        c.num_steps = c.num_prompt_tokens_computed = c.num_generated_tokens = 0
        c.num_draft_tokens = c.num_accepted_draft_tokens = c.num_drafted_steps = 0
        bm = self.block_manager
        bm.num_prefix_query_tokens = bm.num_prefix_hit_tokens = 0
        return seconds

    def close(self) -> None:
        """Stops the engine's other tensor-parallel ranks (and a draft model's), if it has any."""
        self.runner.close()
        if self.proposer is not None:
            self.proposer.close()

    @property
    def released_tags(self) -> list[str]:
        return [
            t
            for t, gone in (
                ("model", self.runner.model is None),
                ("kv_cache", self.runner.kv_cache is None),
            )
            if gone
        ]

    def weights_checksum(self) -> str:
        if self.runner.model is None:
            return ""
        digest = hashlib.sha256()
        for name, tensor in sorted(self.runner.model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().float().cpu().numpy().tobytes())
        return digest.hexdigest()

    def snapshot(self) -> EngineSnapshot:
        bm, c, runner = self.block_manager, self.counters, self.runner
        return EngineSnapshot(
            num_total_blocks=bm.num_blocks,
            num_free_blocks=bm.num_free_blocks,
            num_unfinished=self.num_unfinished,
            num_waiting_for_remote_kv=self.num_waiting_for_remote_kv,
            num_prompt_tokens_computed=c.num_prompt_tokens_computed,
            num_generated_tokens=c.num_generated_tokens,
            num_steps=c.num_steps,
            weight_bytes=runner.weight_bytes,
            kv_cache_bytes=runner.kv_cache_bytes,
            weights_source=runner.weights_source,
            weights_version=runner.weights_version,
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            num_queued_prompt_tokens=sum(
                max(0, seq.num_prompt_tokens - seq.num_computed_tokens)
                for seqs in (self.scheduler.running, self.scheduler.waiting)
                for seq in seqs
            ),
            num_preemptions=self.scheduler.num_preemptions,
            num_prefix_query_tokens=bm.num_prefix_query_tokens,
            num_prefix_hit_tokens=bm.num_prefix_hit_tokens,
            num_draft_tokens=c.num_draft_tokens,
            num_accepted_draft_tokens=c.num_accepted_draft_tokens,
            num_drafted_steps=c.num_drafted_steps,
            lora_adapters=tuple((a.name, a.int_id, a.path) for a in runner.lora_pool.resident)
            if runner.lora_pool
            else (),
        )

    # -- the step: schedule -> run -> postprocess --
    def step(self) -> list[StepOutput]:
        """schedule -> run -> postprocess. With overlap_scheduling the postprocess is the previous
        step's, done while this step runs on the device (SGLang's overlap scheduler, vLLM's async
        scheduling): the host turns the last draws into outputs and schedules while the GPU
        computes, and the step reads the ids still in flight on the device. A sequence that the
        late ids end has computed one row to throw away."""
        outputs: list[StepOutput] = []
        if self.proposer is not None:
            self.counters.last_spec = {}
        if self._in_flight is not None and (
            self._in_flight.needs_ids or self._drafts_need_ids(self._in_flight)
        ):
            outputs += self._postprocess(
                self._in_flight
            )  # penalties count the ids, drafts follow them: read them first
            self._in_flight = None
        if self.proposer is not None:
            self._propose_drafts()
        batch = self.scheduler.schedule()
        self._current_batches = (
            [batch] if self._in_flight is None else [batch, self._in_flight.batch]
        )
        previous, self._in_flight = self._in_flight, self._launch(batch)
        if previous is not None:
            outputs += self._postprocess(previous)
        if self._in_flight is not None and (not self.overlap_scheduling or self._in_flight.drafts):
            # A step that verifies drafts is read at once: the next one waits for its tokens anyway.
            outputs += self._postprocess(self._in_flight)
            self._in_flight = None
        self.last_step_was_idle = batch.is_empty and not outputs
        return outputs

    def _drafting(self) -> bool:
        """Whether this step drafts at all: speculation is on and the running batch is within
        disable_by_batch_size (past it, a verify step's extra rows cost more than they save)."""
        if self.proposer is None:
            return False
        limit = self.proposer.config.disable_by_batch_size
        return limit is None or len(self.scheduler.running) <= limit

    def _drafts_need_ids(self, step: InFlightStep) -> bool:
        """Whether a sequence that drew a token in the step in flight may draft next (it needs
        that token on the host to)."""
        return self._drafting() and any(
            seq.phase is not Phase.CONTEXT_ONLY and self._draft_room(seq) > 0
            for seq in step.sampled
        )

    def _propose_drafts(self) -> None:
        """Draft tokens for each decoding sequence the proposer can serve (not a context phase,
        a beam search or a guide, whose state a rejected draft would have to undo), at most what
        its max_tokens and the context leave room for."""
        started = time.perf_counter()
        wants = []
        drafting = self._drafting()
        for seq in self.scheduler.running:
            seq.draft_token_ids = []  # none left from a step that did not schedule it
            if (
                not drafting
                or seq.num_pending_tokens
                or seq.num_uncomputed_tokens != 1
                or seq.phase is Phase.CONTEXT_ONLY
            ):
                continue
            k = self._draft_room(seq)
            if k > 0:
                wants.append((seq, k))
        if wants:
            for seq, drafts in self.proposer.propose_all(wants).items():
                seq.draft_token_ids = drafts
        spec = self.counters.last_spec  # this step's: the drafts it verifies may be counted first
        spec["draft_seconds"] = spec.get("draft_seconds", 0.0) + time.perf_counter() - started

    def _draft_room(self, seq: Sequence) -> int:
        """How many drafts may follow seq's tokens: at most num_speculative_tokens, and what its
        max_tokens and the context leave room for; none for a beam search or a guide, whose state
        a rejected draft would have to undo. A context phase's max_tokens is its own (often 1, as
        TensorRT-LLM's flow sends it), not the generation's: the decode cuts the drafts to that."""
        if seq.beam is not None or seq.options.guide is not None:
            return 0
        room = min(
            self.proposer.config.num_speculative_tokens, self.max_model_len - seq.num_tokens - 1
        )
        if seq.phase is not Phase.CONTEXT_ONLY:
            room = min(room, seq.options.max_tokens - seq.num_output_tokens - 1)
        return max(0, room)

    def _draft_handoffs(self) -> None:
        """The drafts to follow each handed-off context phase's first token (its prompt and that
        token are all it has), proposed as the decode's own would be and put on its output: the
        decode verifies them at its first step (DisaggregatedParams.draft_tokens)."""
        started = time.perf_counter()
        handing_off, self._handing_off = self._handing_off, []
        wants = [(seq, self._draft_room(seq)) for seq, _ in handing_off]
        drafts = self.proposer.propose_once([(seq, k) for seq, k in wants if k > 0])
        for seq, out in handing_off:
            out.draft_token_ids = list(drafts.get(seq, ()))
        spec = self.counters.last_spec  # the step's drafting time (its draftOverhead)
        spec["draft_seconds"] = spec.get("draft_seconds", 0.0) + time.perf_counter() - started

    def _launch(self, batch: ScheduledBatch) -> InFlightStep | None:
        """Queues the batch's forward and draws on the device; the bookkeeping runs meanwhile."""
        if batch.is_empty:
            return None
        started = time.perf_counter()
        self._flush_kv_tier()  # the blocks this step writes may be ones just evicted
        self.counters.iteration += 1
        now = time.monotonic()
        for seq in batch.seqs:
            if not seq.first_scheduled_at:
                seq.first_scheduled_at = now
            if seq.perf is not None:
                seq.perf.scheduled(self.counters.iteration)
        sampled, draws, prompt_logprobs = self.runner.execute(batch)
        for seq, rows in prompt_logprobs.items():
            seq.num_prompt_rows += rows.num_positions
            seq.prompt_logprobs += rows.logprobs
            if rows.logits is not None:
                seq.context_logits.append(rows.logits)
        num_context = sum(1 for s in batch.seqs if s.num_output_tokens + s.num_pending_tokens == 0)
        self.counters.last_batch = {
            "numScheduledRequests": len(batch.seqs),
            "numContextRequests": num_context,
            "numGenRequests": len(batch.seqs) - num_context,
            "numCtxTokens": batch.num_tokens - len(sampled),
        }
        drafts = {}
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            computed = seq.num_computed_tokens
            if computed < seq.num_prompt_tokens:
                self.counters.num_prompt_tokens_computed += (
                    min(seq.num_prompt_tokens, computed + num_new) - computed
                )
            if seq.draft_token_ids:
                # The drafts' KV counts once they are accepted (_postprocess).
                drafts[seq] = seq.draft_token_ids
                seq.draft_token_ids = []
                num_new -= len(drafts[seq])
            seq.num_computed_tokens = computed + num_new
        self.block_manager.register_computed_blocks(batch.seqs)
        for seq in dict.fromkeys(sampled) if drafts else sampled:
            seq.num_pending_tokens += 1
        return InFlightStep(batch, sampled, draws, started, self.counters.iteration, drafts)

    def _postprocess(self, step: InFlightStep) -> list[StepOutput]:
        """Waits for a launched step's draws and appends each to its sequence."""
        outputs: list[StepOutput] = []
        self._handing_off = []  # none left from a step that failed part-way
        if step.sampled:
            result = step.draws.to_host()
            beams: dict[int, BeamGroup] = {}
            appended: list[Sequence] = []
            ranks = result.ranks or [None] * len(step.sampled)
            logits_rows = result.logits_rows
            if step.drafts:
                outputs += self._verify(step, result, ranks, appended)
            for k, (seq, token_id, logprob, top, rank) in enumerate(
                zip(step.sampled, result.token_ids, result.logprobs, result.top_logprobs, ranks)
            ):
                if seq in step.drafts:  # verified above
                    continue
                seq.num_pending_tokens -= 1
                if (
                    seq.is_finished
                ):  # aborted, or ended by its previous token, while this one was drawn
                    continue
                if seq.beam is not None:  # its candidates wait for the other beams'
                    seq.beam.record(seq, *result.beam_candidates[k])
                    beams[id(seq.beam)] = seq.beam
                    continue
                out = self._append_token(seq, token_id, logprob, top, rank, step.iteration)
                if logits_rows and logits_rows[k] is not None:
                    out.generation_logits = [logits_rows[k]]
                outputs.append(out)
                appended.append(seq)
            self.block_manager.register_computed_blocks(
                appended
            )  # the blocks their tokens complete, now known
            for group in beams.values():
                root = self._seqs.get(group.request_id)
                if (
                    root is not None and root.perf is not None
                ):  # a beam step draws the request's next token
                    root.perf.token_drawn(step.iteration)
            outputs += [
                out for group in beams.values() if group.ready for out in self._beam_step(group)
            ]
            if self._handing_off:
                self._draft_handoffs()
        self.counters.num_steps += 1
        self.counters.last_step_seconds = time.perf_counter() - step.started
        return outputs

    def _verify(self, step: InFlightStep, result, ranks, appended: list[Sequence]) -> list:
        """The drafted sequences' rows: the target's token at each drafted position, kept while it
        equals the draft (the next row follows an accepted draft), the first that differs ending
        the sequence's step. One output per sequence with every token it kept."""
        outputs = []
        num_drafts = num_accepted = 0
        k = 0
        sampled = step.sampled
        while k < len(sampled):
            seq = sampled[k]
            drafts = step.drafts.get(seq)
            if drafts is None:
                k += 1
                continue
            rows = range(k, k + len(drafts) + 1)
            k = rows.stop
            seq.num_pending_tokens -= 1
            num_drafts += len(drafts)
            if seq.is_finished:  # aborted while the step ran
                continue
            kept = []
            for j, row in enumerate(rows):
                token_id = result.token_ids[row]
                out = self._append_token(
                    seq,
                    token_id,
                    result.logprobs[row],
                    result.top_logprobs[row],
                    ranks[row],
                    step.iteration,
                )
                if result.logits_rows and result.logits_rows[row] is not None:
                    out.generation_logits = [result.logits_rows[row]]
                kept = coalesce(kept, [out])
                if seq.is_finished or j == len(drafts) or token_id != drafts[j]:
                    break
                # The draft was the target's token: its KV (computed this step) is the sequence's.
                seq.num_computed_tokens += 1
                num_accepted += 1
            if seq.perf is not None:
                seq.perf.num_draft_tokens += len(drafts)
                seq.perf.num_accepted_draft_tokens += j  # the rows kept before the last
                kept[0].perf = dataclasses.replace(seq.perf)
            outputs += kept
            appended.append(seq)
        c = self.counters
        c.num_draft_tokens += num_drafts
        c.num_accepted_draft_tokens += num_accepted
        c.num_drafted_steps += len(step.drafts)
        c.last_spec.update(
            num_draft_tokens=num_drafts,
            num_accepted_tokens=num_accepted,
            num_requests=len(step.drafts),
        )
        return outputs

    def _append_token(
        self,
        seq: Sequence,
        token_id: int,
        logprob: float,
        top: dict[int, float] | None,
        ranks: dict[int, int] | None = None,
        iteration: int = 0,
    ) -> StepOutput:
        if seq.first_token_time is None:
            seq.first_token_time = time.monotonic()
        if seq.perf is not None:
            seq.perf.token_drawn(iteration)
        seq.output_token_ids.append(token_id)
        seq.output_logprobs.append(top)
        seq.cumulative_logprob += logprob
        self.counters.num_generated_tokens += 1
        seq.finish_reason, seq.stop_token_id = natural_finish(
            seq.options, seq.num_prompt_tokens, seq.output_token_ids, self.max_model_len
        )
        if (
            seq.guide_matcher is not None
            and not seq.guide_matcher.accept_token(token_id)
            and seq.finish_reason is None
        ):
            seq.finish_reason = FinishReason.STOP  # nothing more can follow the guide
        bm = self.block_manager
        if seq.finish_reason is None and seq.num_tokens > bm.num_blocks * bm.block_size:
            seq.finish_reason = (
                FinishReason.LENGTH
            )  # the whole KV pool cannot hold the next step's KV
        # A context_only sequence ends here with its first token, whether or not that token ends it
        # (finish_reason says); its KV leaves the engine, kept for a decode worker to pull.
        kept = None
        if seq.phase is Phase.CONTEXT_ONLY:
            kept, seq.block_table, seq.block_hashes = seq.block_table, [], []
            self.num_handed_off += 1
        finished = seq.finish_reason is not None or kept is not None
        if finished:
            self._finish(seq)
        first = seq.num_output_tokens == 1
        out = StepOutput(
            seq.request_id,
            [token_id],
            [top],
            seq.cumulative_logprob,
            finished,
            seq.finish_reason,
            seq.stop_token_id,
            seq.num_prompt_tokens,
            seq.num_cached_prompt_tokens,
            kept_block_ids=kept,
            new_ranks=[ranks],
            prompt_logprobs=seq.prompt_logprobs if first and seq.options.prompt_logprobs else None,
        )
        out.first_scheduled_at = seq.first_scheduled_at
        if first and seq.context_logits:
            out.context_logits = torch.cat(seq.context_logits)
        if seq.perf is not None:  # on every output: a stop string or an abort may end it next
            out.perf = dataclasses.replace(
                seq.perf
            )  # a copy: the loop reads it, this thread owns seq
        if (
            kept is not None
            and seq.finish_reason is not FinishReason.STOP
            and self.proposer is not None
        ):  # handed off: max_tokens may end a context phase, not the generation after it
            self._handing_off.append((seq, out))
        return out

    def _beam_step(self, group: BeamGroup) -> list[StepOutput]:
        """The group's next beams in its slots (KV forked), or, once the search is over, the n best
        beams as the request's output."""
        new = group.step()
        if group.done:
            root = self._seqs.get(group.request_id)  # the slots share its id: gone once they finish
            perf = (
                dataclasses.replace(root.perf)
                if root is not None and root.perf is not None
                else None
            )
            for slot in group.slots:
                self._finish(slot)
            self._seqs.pop(group.request_id, None)
            return [
                StepOutput(
                    group.request_id,
                    [],
                    [],
                    0.0,
                    True,
                    FinishReason.STOP,
                    beams=group.results(),
                    perf=perf,
                )
            ]
        copies = group.advance(new, self.block_manager)
        for slot in group.slots:
            if slot not in self.scheduler.running and slot not in self.scheduler.waiting:
                self.scheduler.add_forked(slot)  # a new beam: its KV forked
        self._flush_kv_tier()  # the forks' fresh blocks may be ones just evicted
        self.runner.copy_blocks(copies)
        return []

    def _flush_kv_tier(self) -> bool:
        """Runs the host tier's owed copies (engine/kv_tier.py). Returns whether something outside
        the device's stream order (a NIXL READ or write) must synchronize first: blocks copied up,
        or blocks reused before their copies down have landed (ModelRunner.copy_kv_tier)."""
        tier = self.block_manager.host_tier
        if tier is None:
            return False
        copies = tier.take_copies()
        if not copies.down and not copies.up and not copies.reused:
            return False
        return self.runner.copy_kv_tier(copies)

    def _finish(self, seq: Sequence) -> None:
        # An unconfirmed import's tokens may come from another request's KV: the proposer (the
        # suffix method learns from finished outputs) hears of it once its lease is confirmed.
        if self.proposer is not None and not seq.kv_unconfirmed:
            self.proposer.finished(seq)
        seq.status = Status.FINISHED
        self.scheduler.remove(seq, keep_blocks=seq.kv_unconfirmed)
        if seq.kv_unconfirmed:
            self._unconfirmed_done[seq.request_id] = seq
        self._seqs.pop(seq.request_id, None)
