"""The engine thread and its bridge to the asyncio loop.

The gRPC loop never runs model code: it puts commands on a queue; one thread
owns the LLMEngine, drains the queue, runs steps and hands each step's outputs
back to the loop with call_soon_threadsafe. A slow client never stalls a step.
"""
from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Callable

from tandem.engine.llm_engine import LLMEngine, StepOutput

log = logging.getLogger("tandem.engine_loop")


class JsonBuffer:
    """Dicts the engine thread publishes (iteration stats, KV events) for Get*/Stream* RPCs.
    Lives on the asyncio side; bounded, oldest dropped first."""

    def __init__(self, maxlen: int):
        self.items: deque[dict] = deque(maxlen=maxlen)
        self._event = asyncio.Event()

    def push(self, items: list[dict]) -> None:
        self.items.extend(items)
        self._event.set()

    async def drain(self, timeout: float | None) -> list[dict]:
        """What arrived since the last drain, waiting up to timeout seconds (None: forever) for something."""
        if not self.items:
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        items = list(self.items)
        self.items.clear()
        return items


@dataclass
class EngineFailure:
    """Delivered to a request's stream when the engine could not run it."""
    error: BaseException


class EngineLoop:
    def __init__(self, engine: LLMEngine, loop: asyncio.AbstractEventLoop, stats_history: int = 1000):
        self.engine = engine
        self.loop = loop
        self._commands: queue.Queue = queue.Queue()
        self._streams: dict[str, asyncio.Queue] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False
        self.iteration_stats = JsonBuffer(stats_history)
        self.kv_events = JsonBuffer(stats_history * 10)
        self._next_event_id = 0
        # Seconds each request admitted since the last stats record waited in the command queue.
        self._new_request_waits: list[float] = []

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put(None)
        self._thread.join(timeout=10)

    def add_request(self, request_id: str, stream: asyncio.Queue, **kwargs) -> None:
        """Queues a request; its StepOutputs (or an EngineFailure) arrive on stream."""
        if self._streams.get(request_id, stream) is not stream:
            raise ValueError(f"request id {request_id!r} is already running on this worker")
        self._streams[request_id] = stream
        self._commands.put(("add", request_id, (kwargs, time.monotonic())))

    def register(self, request_id: str, stream: asyncio.Queue) -> None:
        """Routes a request's outputs to stream before it reaches the engine (a KV import in flight)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running on this worker")
        self._streams[request_id] = stream

    def abort(self, request_id: str) -> bool:
        """Stops a request; no further output reaches its stream. Returns whether it was known."""
        known = self._streams.pop(request_id, None) is not None
        self._commands.put(("abort", request_id, None))
        return known

    def is_active(self, request_id: str) -> bool:
        return request_id in self._streams

    @property
    def num_active(self) -> int:
        return len(self._streams)

    async def call(self, fn: Callable[[LLMEngine], Any]) -> Any:
        """Runs fn(engine) on the engine thread between steps and returns its result."""
        future = self.loop.create_future()
        self._commands.put(("call", fn, future))
        return await future

    def _run(self) -> None:
        while not self._stopping:
            idle = self.engine.num_unfinished == 0
            # Requests that all wait for blocks (held by leases, say): wait a little for the
            # command that frees them instead of spinning on empty steps with the GIL held.
            stalled = not idle and self.engine.last_step_was_idle
            try:
                if idle or stalled:
                    command = self._commands.get(timeout=0.5 if idle else 0.005)
                else:
                    command = self._commands.get_nowait()
            except queue.Empty:
                command = None
            while command is not None:
                self._handle(command)
                try:
                    command = self._commands.get_nowait()
                except queue.Empty:
                    command = None
            if self._stopping:
                break
            if self.engine.leases:
                self.engine.expire_leases(time.time())
            if self.engine.num_unfinished:
                self._step()
            self._publish_kv_events()

    def _handle(self, command) -> None:
        kind, key, payload = command
        if kind == "add":
            kwargs, enqueued_at = payload
            self._new_request_waits.append(time.monotonic() - enqueued_at)
            try:
                self.engine.add_request(key, **kwargs)
            except Exception as exc:  # noqa: BLE001 - reported to the caller's stream
                self._deliver(key, EngineFailure(exc))
        elif kind == "abort":
            self.engine.abort_request(key)
        elif kind == "call":
            fn, future = key, payload
            try:
                result = fn(self.engine)
            except Exception as exc:  # noqa: BLE001
                self.loop.call_soon_threadsafe(_set_exception, future, exc)
            else:
                self.loop.call_soon_threadsafe(_set_result, future, result)

    def _step(self) -> None:
        try:
            outputs = self.engine.step()
        except Exception as exc:  # noqa: BLE001 - a failed step fails its batch, not the worker
            log.exception("engine step failed")
            for request_id in self.engine.current_batch_ids:
                self.engine.abort_request(request_id)
                self._deliver(request_id, EngineFailure(exc))
            return
        for out in outputs:
            self._deliver(out.request_id, out)
        self._record_stats(outputs)

    def _deliver(self, request_id: str, item: StepOutput | EngineFailure) -> None:
        self.loop.call_soon_threadsafe(self._put, request_id, item)

    def _put(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        if stream is None:
            return  # aborted meanwhile
        if isinstance(item, EngineFailure) or item.finished:
            self._streams.pop(request_id, None)
        stream.put_nowait(item)

    def _record_stats(self, outputs: list[StepOutput]) -> None:
        """One iteration under TensorRT-LLM's IterationStats keys (its JSON schema:
        cpp/tensorrt_llm/executor/jsonSerialization.cpp), plus tandem's cachedBlocks."""
        engine, config = self.engine, self.engine.config
        bm = engine.block_manager
        waits, self._new_request_waits = self._new_request_waits, []
        num_missed = bm.num_new_blocks
        stats = {
            "timestamp": datetime.now().strftime("%m-%d-%Y %H:%M:%S.%f"),
            "iter": engine.counters.num_steps,
            "iterLatencyMS": engine.counters.last_step_seconds * 1e3,
            "newActiveRequestsQueueLatencyMS": sum(waits) / len(waits) * 1e3 if waits else 0.0,
            "numNewActiveRequests": len(waits),
            "numActiveRequests": engine.num_unfinished,
            "numQueuedRequests": len(engine.scheduler.waiting),
            "numCompletedRequests": sum(1 for out in outputs if out.finished),
            "maxNumActiveRequests": config.max_num_seqs,
            # Static limits; there is no runtime tuner, whose recommendations TensorRT-LLM leaves at 0 without one.
            "maxBatchSizeStatic": config.max_num_seqs,
            "maxBatchSizeTunerRecommended": 0,
            "maxBatchSizeRuntime": config.max_num_seqs,
            "maxNumTokensStatic": config.max_num_batched_tokens,
            "maxNumTokensTunerRecommended": 0,
            "maxNumTokensRuntime": config.max_num_batched_tokens,
            **_memory_usage(config.device),
            "kvCacheStats": {
                "maxNumBlocks": bm.num_blocks, "freeNumBlocks": bm.num_free_blocks,
                "usedNumBlocks": bm.num_blocks - bm.num_free_blocks, "tokensPerBlock": bm.block_size,
                "allocTotalBlocks": bm.num_cache_hits + num_missed, "allocNewBlocks": num_missed,
                "reusedBlocks": bm.num_cache_hits, "missedBlocks": num_missed,
                "cacheHitRate": bm.num_cache_hits / max(1, bm.num_cache_hits + num_missed),
                "cachedBlocks": bm.num_cached_blocks,
            },
            "staticBatchingStats": None,  # in-flight batching only
            # One token per generation request and step: no pipeline micro-batches, no speculative decoding.
            "inflightBatchingStats": dict(engine.counters.last_batch, numPausedRequests=0, microBatchId=0,
                                          avgNumDecodedTokensPerIter=1.0),
            "specDecodingStats": None,
        }
        self.loop.call_soon_threadsafe(self.iteration_stats.push, [stats])

    def _publish_kv_events(self) -> None:
        """KV events in TensorRT-LLM's shape: {event_id, data, window_size}."""
        if not self.engine.block_manager.events:
            return
        events = []
        for data in self.engine.block_manager.drain_events():
            events.append({"event_id": self._next_event_id, "data": data, "window_size": self.engine.max_model_len})
            self._next_event_id += 1
        self.loop.call_soon_threadsafe(self.kv_events.push, events)


def _memory_usage(device: str) -> dict[str, int]:
    """Bytes in use: this process's resident host memory, the device's used memory (total - free,
    as TensorRT-LLM's PyTorch backend measures it) and pinned host memory held by torch."""
    import torch
    page_size = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        cpu = int(f.read().split()[1]) * page_size
    gpu = pinned = 0
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        gpu = total - free
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    return {"cpuMemUsage": cpu, "gpuMemUsage": gpu, "pinnedMemUsage": pinned}


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
