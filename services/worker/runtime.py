"""Everything a worker's servicers share: engine thread, tokenizer, readiness, counters."""
from __future__ import annotations

import asyncio
import os
import time
import uuid

from tandem.common.server import GrpcServer
from tandem.engine.bert import is_encoder_only
from tandem.engine.kv_layout import layout_hash
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.worker.admin import COLLECTIVE_RPC_METHODS
from tandem.worker.config import WorkerConfig
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.tokenizer import Tokenizer, generation_eos_ids
from tandem.v1 import llm_pb2, worker_pb2


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, server: GrpcServer, ready: asyncio.Event):
        self.config = config
        self.server = server
        self.worker_id = server.address
        self.llm_id = uuid.uuid4().hex
        self.ready = ready
        self.paused = False
        self.startup_metrics: dict[str, float] = {}
        self.engine: LLMEngine | None = None
        self.engine_loop: EngineLoop | None = None
        self.tokenizer: Tokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.bos_token_id: int | None = None
        self.kv_layout: dict = {}
        self.kv_layout_hash = ""
        self.transceiver = None
        self.handoff_keeper = None
        self.importer = None
        self._transceiver_generation = 0
        # Set instead of engine when the model is encoder-only (Encode, not Generate).
        self.encoder = None

    @property
    def encode_only(self) -> bool:
        return self.encoder is not None

    async def load(self) -> None:
        """Loads tokenizer and model off the event loop, warms the engine up, starts its thread."""
        started = time.perf_counter()
        if is_encoder_only(self.config.engine.model_dir):
            return await self._load_encoder(started)
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.config.engine.model_dir)
        self.engine = await asyncio.to_thread(LLMEngine, self.config.engine)
        loaded = time.perf_counter()
        mc = self.engine.model_config
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_ids + generation_eos_ids(self.config.engine.model_dir)))
        self.bos_token_id = mc.bos_token_id
        await asyncio.to_thread(self._warm_up)
        self.engine_loop = EngineLoop(self.engine, asyncio.get_running_loop())
        self.kv_layout = self.engine.runner.kv_layout
        self.kv_layout_hash = layout_hash(self.kv_layout)
        if self.config.role in ("prefill", "decode"):
            await asyncio.to_thread(self.start_transceiver)
        self.engine_loop.start()
        self.startup_metrics = {"model_load_s": loaded - started, "warmup_s": time.perf_counter() - loaded,
                                "total_s": time.perf_counter() - started}
        self.ready.set()

    async def _load_encoder(self, started: float) -> None:
        from tandem.worker.encoder import EncoderRuntime
        if self.config.role != "both":
            raise ValueError(f"{self.config.engine.model_dir} is an encoder-only model: serve it in the both role "
                             f"(there is no prefill/decode split to make), not {self.config.role}")
        self.encoder = await asyncio.to_thread(EncoderRuntime, self.config.engine)
        self.tokenizer = self.encoder.tokenizer
        loaded = time.perf_counter()
        await asyncio.to_thread(self.encoder.warm_up)
        self.startup_metrics = {"model_load_s": loaded - started, "warmup_s": time.perf_counter() - loaded,
                                "total_s": time.perf_counter() - started}
        self.ready.set()

    @property
    def signing_key(self) -> bytes | None:
        """Handoffs are signed with the admin token: a cluster with one authenticates them too."""
        return self.config.admin_token.encode() if self.config.admin_token else None

    def start_transceiver(self) -> None:
        """A NIXL agent over the KV pool; a new agent name each time, so peers that cached
        the old one (before a release of the pool) fetch the new state."""
        from tandem.decode.importer import KvImporter
        from tandem.kvtransfer import KvTransceiver
        from tandem.prefill.handoff import HandoffKeeper
        self._transceiver_generation += 1
        agent_name = f"{self.config.role}-{self.worker_id}-{self.llm_id[:8]}-{self._transceiver_generation}"
        self.transceiver = KvTransceiver(agent_name, self.engine.runner.kv_cache, self.kv_layout_hash,
                                         progress_thread=self.config.nixl_progress_thread)
        if self.config.role == "prefill":
            self.handoff_keeper = HandoffKeeper(self.engine_loop, self.transceiver, self.worker_id, self.kv_layout,
                                                self.kv_layout_hash, self.signing_key)
        else:
            self.importer = KvImporter(self.transceiver)

    def stop_transceiver(self) -> None:
        if self.handoff_keeper is not None:
            self.handoff_keeper.stop()
        if self.importer is not None:
            asyncio.ensure_future(self.importer.close())
        if self.transceiver is not None:
            self.transceiver.close()
        self.transceiver = self.handoff_keeper = self.importer = None

    def start_background(self) -> None:
        if self.handoff_keeper is not None:
            self.handoff_keeper.start()

    def _warm_up(self) -> None:
        """One prefill and one decode step so the first real request does not pay for lazy init."""
        engine = self.engine
        engine.add_request("warmup", [min(1, engine.model_config.vocab_size - 1)] * 4,
                           SamplingOptions(max_tokens=2, ignore_eos=True))
        while engine.num_unfinished:
            engine.step()
        engine.counters.num_steps = engine.counters.num_prompt_tokens_computed = engine.counters.num_generated_tokens = 0

    def request_stop(self) -> None:
        self.server.request_stop()

    async def close(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.stop()
        if self.encoder is not None:
            self.encoder.close()
        self.stop_transceiver()

    def kv_capacity(self) -> llm_pb2.KvCacheCapacity:
        bm = self.engine.block_manager
        return llm_pb2.KvCacheCapacity(max_num_blocks=bm.num_blocks, tokens_per_block=bm.block_size,
                                       max_num_tokens=bm.num_blocks * bm.block_size, num_free_blocks=bm.num_free_blocks)

    def server_info(self) -> llm_pb2.ServerInfo:
        info = llm_pb2.ServerInfo(llm_id=self.llm_id, model=os.path.abspath(self.config.engine.model_dir),
                                  role=self.config.role, max_model_len=self.engine.max_model_len if self.engine else 0)
        info.disaggregated_params.update({"role": self.config.role, "kv_layout_hash": self.kv_layout_hash,
                                          "transceiver": self.transceiver.agent_name if self.transceiver else ""})
        info.startup_metrics.update(self.startup_metrics)
        info.collective_rpc_methods.extend(COLLECTIVE_RPC_METHODS)
        if self.encoder is not None:
            info.encode_only, info.max_model_len = True, self.encoder.max_model_len
        return info

    async def worker_state(self) -> worker_pb2.WorkerState:
        if self.encoder is not None:  # no KV cache; the router only needs the role
            return worker_pb2.WorkerState(role=self.config.role, paused=self.paused)
        def read(engine: LLMEngine) -> worker_pb2.WorkerState:
            bm = engine.block_manager
            c = engine.counters
            return worker_pb2.WorkerState(
                role=self.config.role, kv_layout_hash=self.kv_layout_hash, num_total_blocks=bm.num_blocks,
                num_free_blocks=bm.num_free_blocks, num_active_requests=engine.num_unfinished + len(engine.imports),
                num_prompt_tokens_computed=c.num_prompt_tokens_computed, num_generated_tokens=c.num_generated_tokens,
                num_steps=c.num_steps, num_leased_blocks=engine.num_leased_blocks, paused=self.paused,
                kv_bytes_received=self.importer.num_bytes_received if self.importer else 0,
                weight_bytes=engine.runner.weight_bytes, kv_cache_bytes=engine.runner.kv_cache_bytes,
                weights_source=engine.runner.weights_source, weights_version=engine.runner.weights_version)
        return await self.engine_loop.call(read)

    async def drain_stats(self, timeout: float | None) -> list[dict]:
        """Iteration stats since the last call, waiting up to timeout seconds for the first."""
        return [dict(s, worker_id=self.worker_id) for s in await self.engine_loop.iteration_stats.drain(timeout)]

    async def drain_kv_events(self, timeout: float | None) -> list[dict]:
        return [dict(e, worker_id=self.worker_id) for e in await self.engine_loop.kv_events.drain(timeout)]

    async def drain(self, timeout: float = 30.0) -> None:
        """Waits until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while await self.engine_loop.call(lambda e: e.num_unfinished) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    async def is_drained(self) -> bool:
        """Nothing a stop would cut: no request in the engine, no KV import, no KV leased to a decode worker."""
        if self.engine_loop is None:
            return True
        return await self.engine_loop.call(lambda engine: not (engine.num_unfinished or engine.imports or engine.leases))

    def transceiver_state(self) -> bytes:
        # An aggregated worker has no transceiver; the seed returns empty bytes then.
        return self.transceiver.get_state() if self.transceiver is not None else b""
