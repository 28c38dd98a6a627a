"""One engine iteration as TensorRT-LLM reports it: its IterationStats keys (the JSON schema of
cpp/tensorrt_llm/executor/jsonSerialization.cpp), plus tandem's cachedBlocks."""

from __future__ import annotations

import os
import time
from datetime import datetime

import torch

from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import StepOutput


def iteration_stats(engine: LLMEngine, outputs: list[StepOutput], queue_waits: list[float]) -> dict:
    """queue_waits: seconds each request admitted since the last record waited for the engine thread."""
    config, bm = engine.config, engine.block_manager
    num_missed = bm.num_new_blocks
    return {
        "timestamp": datetime.now().strftime("%m-%d-%Y %H:%M:%S.%f"),
        "iter": engine.counters.num_steps,
        "iterLatencyMS": engine.counters.last_step_seconds * 1e3,
        "newActiveRequestsQueueLatencyMS": sum(queue_waits) / len(queue_waits) * 1e3
        if queue_waits
        else 0.0,
        "numNewActiveRequests": len(queue_waits),
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
        **memory_usage(config.device),
        "kvCacheStats": {
            "maxNumBlocks": bm.num_blocks,
            "freeNumBlocks": bm.num_free_blocks,
            "usedNumBlocks": bm.num_blocks - bm.num_free_blocks,
            "tokensPerBlock": bm.block_size,
            "allocTotalBlocks": bm.num_cache_hits + num_missed,
            "allocNewBlocks": num_missed,
            "reusedBlocks": bm.num_cache_hits,
            "missedBlocks": num_missed,
            "cacheHitRate": bm.num_cache_hits / max(1, bm.num_cache_hits + num_missed),
            "cachedBlocks": bm.num_cached_blocks,
        },
        "staticBatchingStats": None,  # in-flight batching only
        # No pipeline micro-batches; speculative decoding makes several tokens per step.
        "inflightBatchingStats": dict(
            engine.counters.last_batch,
            numPausedRequests=0,
            microBatchId=0,
            avgNumDecodedTokensPerIter=_decoded_per_step(engine),
        ),
        "specDecodingStats": _spec_decoding_stats(engine),
    }


def _decoded_per_step(engine: LLMEngine) -> float:
    """Tokens a generation request got per step, on average, in the last step."""
    spec = engine.counters.last_spec
    num_requests = spec.get("num_requests", 0)
    num_gen = engine.counters.last_batch.get("numGenRequests", 0)
    if not num_requests or not num_gen:
        return 1.0
    return (num_gen + spec["num_accepted_tokens"]) / num_gen


def _spec_decoding_stats(engine: LLMEngine) -> dict | None:
    """TensorRT-LLM's SpecDecodingStats of the last step (None without speculative decoding):
    acceptanceLength = tokens per drafted request and step; draftOverhead = the share of the
    step's time its drafting took."""
    if engine.proposer is None:
        return None
    spec = engine.counters.last_spec
    count = spec.get("num_requests", 0)
    accepted = spec.get("num_accepted_tokens", 0)
    draft_ms = spec.get("draft_seconds", 0.0) * 1e3
    step_ms = engine.counters.last_step_seconds * 1e3
    return {
        "numDraftTokens": spec.get("num_draft_tokens", 0),
        "numAcceptedTokens": accepted,
        "numRequestsWithDraftTokens": count,
        "acceptanceLength": (accepted + count) / count if count else 0.0,
        "iterLatencyMS": draft_ms,
        "draftOverhead": draft_ms / step_ms if step_ms > 0 else 0.0,
    }


# How long a memory reading serves the iteration records after it: asked every step, it is a
# driver call (cudaMemGetInfo) and torch's host-allocator statistics on the engine thread, GIL
# held, each step (an H100's timeline put 0.46 ms between a step's end and its record, of which
# the reading's share is bench/memory_reading.py's to tell). Monitoring needs no fresher figure.
MEMORY_SAMPLE_S = 0.5

_memory_readings: dict[str, tuple[float, dict[str, int]]] = {}


def memory_usage(device: str, now: float | None = None) -> dict[str, int]:
    """Bytes in use: this process's resident host memory, the device's used memory (total - free,
    as TensorRT-LLM's PyTorch backend measures it) and pinned host memory held by torch; read at
    most once per MEMORY_SAMPLE_S per device."""
    now = time.monotonic() if now is None else now
    taken = _memory_readings.get(device)
    if taken is None or now - taken[0] >= MEMORY_SAMPLE_S:
        taken = _memory_readings[device] = (now, _read_memory(device))
    return dict(taken[1])


def _read_memory(device: str) -> dict[str, int]:
    page_size = os.sysconf("SC_PAGE_SIZE")
    with open("/proc/self/statm") as f:
        cpu = int(f.read().split()[1]) * page_size
    gpu = pinned = 0
    if device.startswith("cuda"):
        free, total = torch.cuda.mem_get_info(torch.device(device))
        gpu = total - free
        pinned = torch.cuda.host_memory_stats().get("allocated_bytes.current", 0)
    return {"cpuMemUsage": cpu, "gpuMemUsage": gpu, "pinnedMemUsage": pinned}
