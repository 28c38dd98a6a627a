"""Everything a worker's servicers share: engine thread, tokenizer, readiness, counters."""
from __future__ import annotations

import asyncio
import os
import time
import uuid

from tandem.common.server import GrpcServer
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.worker.config import WorkerConfig
from tandem.worker.engine_loop import EngineLoop
from tandem.worker.tokenizer import Tokenizer, generation_eos_ids
from tandem.v1 import llm_pb2, worker_pb2


class WorkerRuntime:
    def __init__(self, config: WorkerConfig, server: GrpcServer):
        self.config = config
        self.server = server
        self.worker_id = server.address
        self.llm_id = uuid.uuid4().hex
        self.ready = asyncio.Event()
        self.paused = False
        self.startup_metrics: dict[str, float] = {}
        self.engine: LLMEngine | None = None
        self.engine_loop: EngineLoop | None = None
        self.tokenizer: Tokenizer | None = None
        self.eos_token_ids: tuple[int, ...] = ()
        self.bos_token_id: int | None = None

    async def load(self) -> None:
        """Loads tokenizer and model off the event loop, warms the engine up, starts its thread."""
        started = time.perf_counter()
        self.tokenizer = await asyncio.to_thread(Tokenizer, self.config.engine.model_dir)
        self.engine = await asyncio.to_thread(LLMEngine, self.config.engine)
        loaded = time.perf_counter()
        mc = self.engine.model_config
        self.eos_token_ids = tuple(dict.fromkeys(mc.eos_token_ids + generation_eos_ids(self.config.engine.model_dir)))
        self.bos_token_id = mc.bos_token_id
        await asyncio.to_thread(self._warm_up)
        self.engine_loop = EngineLoop(self.engine, asyncio.get_running_loop())
        self.engine_loop.start()
        self.startup_metrics = {"model_load_s": loaded - started, "warmup_s": time.perf_counter() - loaded,
                                "total_s": time.perf_counter() - started}
        self.ready.set()

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

    def close(self) -> None:
        if self.engine_loop is not None:
            self.engine_loop.stop()

    def kv_capacity(self) -> llm_pb2.KvCacheCapacity:
        bm = self.engine.block_manager
        return llm_pb2.KvCacheCapacity(max_num_blocks=bm.num_blocks, tokens_per_block=bm.block_size,
                                       max_num_tokens=bm.num_blocks * bm.block_size, num_free_blocks=bm.num_free_blocks)

    def server_info(self) -> llm_pb2.ServerInfo:
        info = llm_pb2.ServerInfo(llm_id=self.llm_id, model=os.path.abspath(self.config.engine.model_dir),
                                  role=self.config.role, max_model_len=self.engine.max_model_len if self.engine else 0)
        info.disaggregated_params.update({"role": self.config.role})
        info.startup_metrics.update(self.startup_metrics)
        return info

    async def worker_state(self) -> worker_pb2.WorkerState:
        def read(engine: LLMEngine) -> worker_pb2.WorkerState:
            bm = engine.block_manager
            c = engine.counters
            return worker_pb2.WorkerState(
                role=self.config.role, num_total_blocks=bm.num_blocks, num_free_blocks=bm.num_free_blocks,
                num_active_requests=engine.num_unfinished, num_prompt_tokens_computed=c.num_prompt_tokens_computed,
                num_generated_tokens=c.num_generated_tokens, num_steps=c.num_steps, paused=self.paused)
        return await self.engine_loop.call(read)

    async def drain_stats(self, timeout: float | None) -> list[dict]:
        """Iteration stats since the last call, waiting up to timeout seconds for the first."""
        loop = self.engine_loop
        if not loop.iteration_stats:
            loop.stats_event.clear()
            try:
                await asyncio.wait_for(loop.stats_event.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        items = [dict(s, worker_id=self.worker_id) for s in loop.iteration_stats]
        loop.iteration_stats.clear()
        return items

    async def drain(self, timeout: float = 30.0) -> None:
        """Waits until the engine holds no request."""
        deadline = time.monotonic() + timeout
        while await self.engine_loop.call(lambda e: e.num_unfinished) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)

    def transceiver_state(self) -> bytes:
        # An aggregated worker has no transceiver; the seed returns empty bytes then.
        return b""
