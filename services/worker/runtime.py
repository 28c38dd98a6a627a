"""Everything a worker's servicers share: the engine thread, the text front, the phases of its
role, the KV transceiver and its poller, readiness and counters."""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import time
import uuid

import torch

from tandem.common.auth import derive_key
from tandem.common.channels import ClusterCredentials
from tandem.common.errors import PreconditionError, unavailable
from tandem.common.pause import PauseMode
from tandem.common.roles import Role
from tandem.common.server import GrpcServer, advertised_host
from tandem.decode.generation import GenerationPhase
from tandem.decode.outcomes import HandoffOutcomes, Outcome, Reason
from tandem.decode.peers import PeerCache
from tandem.decode.prefix_pull import PrefixPulls
from tandem.decode.pull_links import PullLinks
from tandem.engine.bert import is_encoder_only
from tandem.engine.engine_core import EngineCore
from tandem.engine.kv_layout import layout_hash
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.lora_adapter import AdapterNotFoundError, AdapterStore, LoRAAdapter
from tandem.engine.messages import CheckIdle, ReadCounters
from tandem.kvtransfer import HandoffFormat, KvTransceiver, TransferPoller
from tandem.prefill.context import ContextPhase
from tandem.prefill.handoff_push import HandoffPush
from tandem.prefill.lease_keeper import LeaseKeeper
from tandem.prefill.prefix_leases import PrefixLeases
from tandem.text.front import TextFront
from tandem.text.tokenizer import Tokenizer
from tandem.v1 import llm_pb2, types_pb2, worker_pb2
from tandem.worker.admin import COLLECTIVE_RPC_METHODS
from tandem.worker.config import WorkerConfig
from tandem.worker.kv_feed import KvBlockFeed
from tandem.worker.metrics import WorkerMetrics
from tandem.worker.phases import PhasePicker
from tandem.worker.weight_openers import WEIGHT_OPENERS

log = logging.getLogger("tandem.worker")


class WorkerRuntime:
    def __init__(
        self, config: WorkerConfig, server: GrpcServer, ready: asyncio.Event, metrics: WorkerMetrics
    ):
        self.config = config
        self.metrics = metrics
        self.role = config.role
        self.server = server
        # How this worker names itself to its peers (a prefill's handoffs carry it: the decode
        # calls back there), reachable from another host, unlike a wildcard bind address.
        port = server.address.rpartition(":")[2]
        self.worker_id = f"{advertised_host(config.host, config.advertise_host)}:{port}"
        self.llm_id = uuid.uuid4().hex
        self.ready = ready
        # The pause in force (pause_generation), None while generating.
        self.pause_mode: PauseMode | None = None
        self.startup_metrics: dict[str, float] = {}
        # The engine thread (engine_core.EngineCore): everything the worker asks of its engine
        # goes through it, as messages, or is read from its facts.
        self.core: EngineCore | None = None
        # The router's KV index feed (SubscribeKvBlocks), once the engine is loaded.
        self.kv_feed: KvBlockFeed | None = None
        self.tokenizer: Tokenizer | None = None
        self.front: TextFront | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.bos_token_id: int | None = None
        self.handoff_format: HandoffFormat | None = None
        self.phases = PhasePicker(config.role)
        # The one lease table of a prefill worker.
        limits = config.limits
        self.leases = (
            LeaseKeeper(
                config.engine.kv_lease_seconds,
                limits.max_unclaimed_kv_fraction,
                limits.max_unclaimed_kv_fraction_per_client,
            )
            if config.role.hands_off or config.pulls_prefixes
            else None
        )
        self.transceiver: KvTransceiver | None = None
        self.poller: TransferPoller | None = None
        self._peers: PeerCache | None = None
        self._push: HandoffPush | None = None
        # A decode's pull rate per prefill; it outlives a released and resumed pool.
        self.pull_links = PullLinks(
            config.kv_pull_floor, on_pull=metrics.observe_peer_pull, on_forget=metrics.forget_peer
        )
        # How each handoff that reached a decode ended; it outlives a released and resumed pool too.
        self.handoff_outcomes = HandoffOutcomes(self.worker_id, metrics.observe_handoff_outcome)
        self._transceiver_generation = 0
        # Cross-worker prefix pulls (--kv-prefix-pulls): the peer side (LeasePrefix) and ours,
        # while the transceiver runs; how ours ended, since start.
        self.prefix_leases: PrefixLeases | None = None
        self.prefix_pulls: PrefixPulls | None = None
        self._prefix_lease_counts = (0, 0)  # (opened, trimmed) across transceiver restarts
        self.prefix_pull_outcomes: collections.Counter[str] = collections.Counter()
        self._num_bytes_received = 0
        # Why the worker must exit non-zero (its engine core process died), else None.
        self.failure: str | None = None
        # Set instead of engine when the model is encoder-only (Encode, not Generate).
        self.encoder = None
        # LoRA adapters read from disk (None with --max-loras 0).
        self.adapters: AdapterStore | None = None
        metrics.watch(self)

    @property
    def encode_only(self) -> bool:
        return self.encoder is not None

    async def load(self) -> None:
        """Loads tokenizer and model off the event loop, warms the engine up, starts its thread."""
        started = time.perf_counter()
        if is_encoder_only(self.config.engine.model_dir):
            return await self._load_encoder(started)
        self.tokenizer = await asyncio.to_thread(Tokenizer.from_dir, self.config.engine.model_dir)
        if self.config.engine_process:
            loaded = await self._spawn_core()
        else:
            engine = await asyncio.to_thread(LLMEngine, self.config.engine, self.role.hands_off)
            loaded = time.perf_counter()
            seconds = await asyncio.to_thread(engine.warm_up)
            if seconds:
                log.info("attention kernel variants compiled in %.1f s", seconds)
            self.core = EngineCore(
                engine,
                asyncio.get_running_loop(),
                on_stats=self.metrics.observe_step,
                on_kv_events=lambda events: self.kv_feed.observe(events),
                leases=self.leases,
                weight_openers=WEIGHT_OPENERS,
            )
        facts = self.core.facts
        self.front = TextFront(self.tokenizer, self.config.limits, facts.limits.max_model_len)
        mc = facts.model_config
        log.info("model %s", mc.describe_path())
        self.eos_token_ids = tuple(
            dict.fromkeys(mc.eos_token_ids + self.tokenizer.generation_eos_ids())
        )
        engine_config = self.config.engine
        if engine_config.max_loras and mc.impl == "tandem":  # no adapters on the transformers path
            # Twice the device slots on the host: an adapter evicted from the device comes back without a read.
            self.adapters = AdapterStore(
                mc,
                engine_config.max_lora_rank,
                getattr(torch, facts.dtype),
                capacity=2 * engine_config.max_loras,
            )
        self.bos_token_id = mc.bos_token_id
        self.kv_feed = KvBlockFeed(
            facts.limits.block_size,
            lambda int_id: self.adapters.fingerprint(int_id) if self.adapters else None,
        )
        if self.leases is not None:
            self.leases.attach(self.core)
        self.handoff_format = (
            HandoffFormat(facts.kv_layout, self.signing_key) if self.signing_key else None
        )
        if self.config.has_transceiver:
            await self.open_transceiver()
        self.core.start()
        self.startup_metrics = {
            "model_load_s": loaded - started,
            "warmup_s": time.perf_counter() - loaded,
            "total_s": time.perf_counter() - started,
            # How the numbers were computed, beside what the start cost (--deterministic).
            "deterministic": self.config.engine.deterministic,
        }
        self.ready.set()

    async def _spawn_core(self) -> float:
        """The engine core in a process of its own (--engine-process); returns when it is up,
        with the time its load ended (its warm-up is the rest of the start)."""
        from tandem.worker.core_client import RemoteEngineCore

        capacity = 2 * self.config.engine.max_loras
        core = await RemoteEngineCore.spawn(self.config.engine, self.role.hands_off, capacity)
        core.on_stats = self.metrics.observe_step
        core.on_kv_events = lambda events: self.kv_feed.observe(events)
        core.leases = self.leases
        core.on_death = self._core_died
        self.core = core
        log.info("engine core process %d up (warm-up %.1f s)", core.pid, core.warmup_s)
        return time.perf_counter() - core.warmup_s

    def _core_died(self, why: str) -> None:
        """The engine core process is gone: NOT_SERVING (readiness and liveness) at once, and out;
        the worker exits non-zero for its supervisor to restart it."""
        self.failure = why
        asyncio.ensure_future(self.server.fail(why))

    async def _load_encoder(self, started: float) -> None:
        from tandem.worker.encoder import EncoderRuntime

        if self.role is not Role.BOTH:
            raise ValueError(
                f"{self.config.engine.model_dir} is an encoder-only model: serve it in the both role "
                f"(there is no prefill/decode split to make), not {self.role.label}"
            )
        self.encoder = await asyncio.to_thread(EncoderRuntime, self.config.engine)
        self.tokenizer = self.encoder.tokenizer
        self.front = TextFront(self.tokenizer, self.config.limits)
        loaded = time.perf_counter()
        await asyncio.to_thread(self.encoder.warm_up)
        self.startup_metrics = {
            "model_load_s": loaded - started,
            "warmup_s": time.perf_counter() - loaded,
            "total_s": time.perf_counter() - started,
        }
        self.ready.set()

    @property
    def signing_key(self) -> bytes | None:
        """Handoffs are signed with a key derived from the cluster token (which a prefill or decode
        worker cannot run without): an aggregated worker without one hands nothing off."""
        return (
            derive_key(self.config.cluster_token, "KV handoff signing")
            if self.config.cluster_token
            else None
        )

    @property
    def kv_layout_hash(self) -> str:
        return layout_hash(self.core.facts.kv_layout) if self.core is not None else ""

    async def open_transceiver(self) -> None:
        """A NIXL agent over the KV pool, the thread that polls it, and the phases that use it.
        A new agent name each time, so peers that cached the old one (before a release of the
        pool) fetch the new state. The agent lives beside the pool: in this process with the
        engine thread, in the engine core process with --engine-process."""
        self._transceiver_generation += 1
        agent_name = (
            f"{self.role.label}-{self.worker_id}-{self.llm_id[:8]}-{self._transceiver_generation}"
        )
        keeper = self.leases
        if self.config.engine_process:
            self.core.on_notification = keeper.on_notification if keeper else None
            self.poller = await self.core.start_transceiver(
                agent_name, self.config.nixl_progress_thread
            )
            self.transceiver = self.poller.transceiver
        else:
            await asyncio.to_thread(self._start_local_transceiver, agent_name)
        self._start_phases(agent_name)

    def _start_local_transceiver(self, agent_name: str) -> None:
        # The one place the IO side holds engine memory: the agent registers the KV pool.
        self.transceiver = KvTransceiver(
            agent_name,
            self.core.engine.runner.kv_pools,
            self.kv_layout_hash,
            progress_thread=self.config.nixl_progress_thread,
        )
        keeper = self.leases
        self.poller = TransferPoller(
            self.transceiver,
            self.core.loop,
            on_notification=keeper.on_notification if keeper else None,
            on_tick=keeper.expire if keeper else None,
        )
        self.poller.start()

    def _start_phases(self, agent_name: str) -> None:
        keeper = self.leases
        cfg = self.config
        weights_id = lambda: self.core.weights.weights_id  # noqa: E731
        if self.role is not Role.PREFILL or cfg.pulls_prefixes:
            self._peers = PeerCache(
                self.poller, ClusterCredentials(cfg.tls, cfg.cluster_token, cfg.admin_token)
            )
        if cfg.pulls_prefixes:
            self.prefix_leases = PrefixLeases(
                self.core,
                keeper,
                self.handoff_format,
                self.worker_id,
                agent_name,
                weights_id,
                cfg.limits.max_prefix_lease_kv_fraction,
            )
            # Counted since start, not since the transceiver last opened (a memory release).
            self.prefix_leases.num_opened, self.prefix_leases.num_trimmed = (
                self._prefix_lease_counts
            )
            self.prefix_pulls = PrefixPulls(
                self.worker_id,
                self.core.facts.limits.block_size,
                self.poller,
                self._peers,
                self.handoff_format,
                weights_id,
                self._prefix_pull_ended,
            )
        if self.role is Role.PREFILL:
            self._push = HandoffPush(
                ClusterCredentials(cfg.tls, cfg.cluster_token, cfg.admin_token)
            )
            self.phases.context = ContextPhase(
                keeper, self.handoff_format, self.worker_id, agent_name, weights_id, self._push
            )
        elif self.role is Role.DECODE:
            self.phases.generation = GenerationPhase(
                self.poller,
                self._peers,
                self.handoff_format,
                self.pull_links,
                self.handoff_outcomes,
                on_pulled=self.metrics.observe_kv_pull,
                load_failure_policy=self.config.kv_load_failure_policy,
                room_wait_s=self.config.kv_room_wait_s,
                early_reserve=self.config.kv_early_reserve,
                weights_id=lambda: self.core.weights.weights_id,
            )

    def _prefix_pull_ended(self, outcome: str, reason: str) -> None:
        self.prefix_pull_outcomes[f"{outcome}:{reason}" if reason else outcome] += 1
        self.metrics.observe_prefix_pull(outcome, reason)

    def stop_transceiver(self) -> None:
        if self.phases.generation is not None:
            self._num_bytes_received += self.phases.generation.num_bytes_received
        self.phases.context = self.phases.generation = None
        if self.prefix_leases is not None:
            self._prefix_lease_counts = (
                self.prefix_leases.num_opened,
                self.prefix_leases.num_trimmed,
            )
        self.prefix_leases = self.prefix_pulls = None
        if self._peers is not None:
            asyncio.ensure_future(self._peers.close())
        if self._push is not None:
            asyncio.ensure_future(self._push.close())
            self._push = None
        if self.poller is not None:
            self.poller.stop()
        if self.transceiver is not None:
            self.transceiver.close()
        self.transceiver = self.poller = self._peers = None

    def request_stop(self) -> None:
        self.server.request_stop()

    async def close(self) -> None:
        if self.core is not None:
            await self.core.aclose()
        if self.encoder is not None:
            self.encoder.close()
        self.stop_transceiver()

    # -- state the servicers read --
    @property
    def paused(self) -> bool:
        return self.pause_mode is not None

    def check_accepting(self, request_type: int) -> None:
        """Generate is refused while paused or while memory is released. Paused in keep mode, the
        generation phase of a request whose context phase ran here or on a prefill comes in (it is
        in flight: frozen here with the others, it continues on resume)."""
        continues_in_flight = (
            self.pause_mode is PauseMode.KEEP
            and request_type == types_pb2.REQUEST_TYPE_GENERATION_ONLY
        )
        if self.paused and not continues_in_flight:
            raise unavailable("generation is paused (PauseGeneration); call ResumeGeneration first")
        released = self.core.released_tags
        if released:
            raise unavailable(
                f"memory {released} is released (Release); call Resume({released}) first"
            )

    async def require_idle(self, what: str) -> None:
        """Refuses `what` while requests run or KV handoffs wait (checked on the engine thread)."""
        await self.core.call(CheckIdle(what))

    async def kv_capacity(self) -> llm_pb2.KvCacheCapacity:
        limits = self.core.facts.limits
        snap = await self.core.call(ReadCounters())
        return llm_pb2.KvCacheCapacity(
            max_num_blocks=limits.num_blocks,
            tokens_per_block=limits.block_size,
            max_num_tokens=limits.num_blocks * limits.block_size,
            num_free_blocks=snap.num_free_blocks,
        )

    async def load_adapter(self, request: llm_pb2.GenerateRequest) -> LoRAAdapter | None:
        """The LoRA adapter a request names, read from the worker's disk on first use (off the loop).
        A decode worker that cannot load the adapter a KV handoff was computed with refuses the
        handoff (FAILED_PRECONDITION); any other request naming missing files is INVALID_ARGUMENT."""
        if not request.HasField("lora_request") or not request.lora_request.lora_name:
            return None
        lora = request.lora_request
        if lora.lora_ckpt_source not in ("", "hf"):
            raise NotImplementedError(
                f"lora_ckpt_source {lora.lora_ckpt_source!r} is not supported; tandem loads "
                f'PEFT ("hf") adapter directories'
            )
        if self.adapters is None:
            raise PreconditionError(
                f"this worker serves no LoRA adapters (--max-loras 0, or a model on the "
                f"transformers path); cannot run adapter "
                f"{lora.lora_name!r}"
            )
        try:
            return await asyncio.to_thread(
                self.adapters.load, lora.lora_name, lora.lora_int_id, lora.lora_path
            )
        except AdapterNotFoundError as exc:
            if request.disaggregated_params.opaque_state:
                raise PreconditionError(
                    f"this {self.role.label} worker cannot take the KV handoff: it was computed "
                    f"with a LoRA adapter this worker cannot load: {exc}"
                ) from None
            raise

    async def lora_adapters(self) -> list[types_pb2.LoRARequest]:
        """The adapters in the engine's device pool now."""
        if self.core is None:
            return []
        snap = await self.core.call(ReadCounters())
        return [
            types_pb2.LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)
            for name, int_id, path in snap.lora_adapters
        ]

    async def server_info(self) -> llm_pb2.ServerInfo:
        info = llm_pb2.ServerInfo(
            llm_id=self.llm_id,
            model=os.path.abspath(self.config.engine.model_dir),
            role=self.role.label,
            max_model_len=self.core.facts.limits.max_model_len if self.core else 0,
        )
        info.disaggregated_params.update(
            {
                "role": self.role.label,
                "kv_layout_hash": self.kv_layout_hash,
                "deterministic": self.config.engine.deterministic,
                "transceiver": self.transceiver.agent_name if self.transceiver else "",
            }
        )
        info.startup_metrics.update(self.startup_metrics)
        info.collective_rpc_methods.extend(COLLECTIVE_RPC_METHODS)
        if self.encoder is not None:
            info.encode_only, info.max_model_len = True, self.encoder.max_model_len
            info.embedding_size = self.encoder.embedding_size
        info.lora_adapters.extend(await self.lora_adapters())
        return info

    @property
    def num_bytes_received(self) -> int:
        generation = self.phases.generation
        return self._num_bytes_received + (generation.num_bytes_received if generation else 0)

    async def worker_state(self) -> worker_pb2.WorkerState:
        if self.encoder is not None:  # no KV cache; the router only needs the role and the instance
            return worker_pb2.WorkerState(
                role=self.role, paused=self.paused, instance_id=self.server.instance_id
            )
        snap = await self.core.call(ReadCounters())
        keeper = self.leases
        return worker_pb2.WorkerState(
            role=self.role,
            instance_id=self.server.instance_id,
            kv_layout_hash=self.kv_layout_hash,
            num_total_blocks=snap.num_total_blocks,
            num_free_blocks=snap.num_free_blocks,
            num_active_requests=snap.num_unfinished + snap.num_waiting_for_remote_kv,
            num_prompt_tokens_computed=snap.num_prompt_tokens_computed,
            num_generated_tokens=snap.num_generated_tokens,
            num_steps=snap.num_steps,
            num_leased_blocks=keeper.num_leased_blocks if keeper else 0,
            paused=self.paused,
            kv_bytes_received=self.num_bytes_received,
            weight_bytes=snap.weight_bytes,
            kv_cache_bytes=snap.kv_cache_bytes,
            weights_source=snap.weights_source,
            weights_version=snap.weights_version,
            num_leases=keeper.num_leases if keeper else 0,
            lease_endings=dict(keeper.endings) if keeper else {},
            num_waiting_for_remote_kv=snap.num_waiting_for_remote_kv,
            num_queued_prompt_tokens=snap.num_queued_prompt_tokens,
            engine_core_pid=getattr(self.core, "pid", os.getpid()),
            num_leases_opened=keeper.num_opened if keeper else 0,
            lora_adapters=[
                types_pb2.LoRARequest(lora_name=name, lora_int_id=int_id, lora_path=path)
                for name, int_id, path in snap.lora_adapters
            ],
            num_ignored_notifications=keeper.num_ignored_notifications if keeper else 0,
            num_unconfirmed_handoffs=self.handoff_outcomes.count(
                Outcome.RECOMPUTED, Reason.UNCONFIRMED
            ),
            kv_handoff_outcomes=self.handoff_outcomes.counts(),
            prefix_pull_outcomes=dict(self.prefix_pull_outcomes),
            num_prefix_leases_opened=self.prefix_leases.num_opened if self.prefix_leases else 0,
            leases_prefixes=self.prefix_leases is not None,
            num_prefix_leases_trimmed=self.prefix_leases.num_trimmed if self.prefix_leases else 0,
            kv_pull_links=[
                worker_pb2.KvPullLink(**link.report()) for link in self.pull_links.links()
            ],
        )

    async def drain_stats(self, timeout: float | None) -> list[dict]:
        """Iteration stats since the last call, waiting up to timeout seconds for the first. A
        decode's last record also carries its pulls per prefill so far (kvPullStats, cumulative:
        KvPullLink's fields, named as its JSON names them) and how its KV handoffs ended so far
        (kvHandoffOutcomes: WorkerState.kv_handoff_outcomes)."""
        records = [
            dict(s, worker_id=self.worker_id)
            for s in await self.core.iteration_stats.drain(timeout)
        ]
        outcomes = self.handoff_outcomes.counts()
        if records and outcomes:
            records[-1]["kvHandoffOutcomes"] = outcomes
        links = self.pull_links.links()
        if records and links:
            records[-1]["kvPullStats"] = {
                link.peer: {
                    _camel(name): value for name, value in link.report().items() if name != "peer"
                }
                for link in links
            }
        return records

    async def drain_kv_events(self, timeout: float | None) -> list[dict]:
        return [dict(e, worker_id=self.worker_id) for e in await self.core.kv_events.drain(timeout)]

    async def drain(self, timeout: float = 30.0) -> None:
        """Waits until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            snap = await self.core.call(ReadCounters())
            if not snap.num_unfinished + snap.num_waiting_for_remote_kv:
                return
            await asyncio.sleep(0.01)

    async def is_drained(self) -> bool:
        """Nothing a stop would cut: no request in the engine, no KV import, no KV leased to a decode worker."""
        if self.core is None:
            return True
        snap = await self.core.call(ReadCounters())
        leased = self.leases.num_leases if self.leases is not None else 0
        return not (snap.num_unfinished or snap.num_waiting_for_remote_kv or leased)

    def transceiver_state(self) -> bytes:
        # An aggregated worker has no transceiver; the seed returns empty bytes then.
        return self.transceiver.get_state() if self.transceiver is not None else b""


def _camel(name: str) -> str:
    first, *rest = name.split("_")
    return first + "".join(part.title() for part in rest)
