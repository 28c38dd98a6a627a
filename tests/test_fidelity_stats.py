"""Issue 9, group 6: get_stats and get_kv_cache_events as TensorRT-LLM returns them: its
IterationStats keys, ints as ints (63-bit block hashes exact), and the async variants ending
once nothing arrives within their timeout."""

from __future__ import annotations

import asyncio
import time

import pytest

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.engine.block_manager import chain_hash
from tandem.testing.cluster import LocalCluster

BLOCK_SIZE = 4

# TensorRT-LLM's JSON schema of its stats: cpp/tensorrt_llm/executor/jsonSerialization.cpp
# (NLOHMANN_DEFINE_TYPE_NON_INTRUSIVE of IterationStats, KvCacheStats, InflightBatchingStats).
ITERATION_STATS_KEYS = {
    "timestamp",
    "iter",
    "iterLatencyMS",
    "newActiveRequestsQueueLatencyMS",
    "numNewActiveRequests",
    "numActiveRequests",
    "numQueuedRequests",
    "numCompletedRequests",
    "maxNumActiveRequests",
    "maxBatchSizeStatic",
    "maxBatchSizeTunerRecommended",
    "maxBatchSizeRuntime",
    "maxNumTokensStatic",
    "maxNumTokensTunerRecommended",
    "maxNumTokensRuntime",
    "gpuMemUsage",
    "cpuMemUsage",
    "pinnedMemUsage",
    "kvCacheStats",
    "staticBatchingStats",
    "inflightBatchingStats",
    "specDecodingStats",
}
KV_CACHE_STATS_KEYS = {
    "maxNumBlocks",
    "freeNumBlocks",
    "usedNumBlocks",
    "tokensPerBlock",
    "allocTotalBlocks",
    "allocNewBlocks",
    "reusedBlocks",
    "missedBlocks",
    "cacheHitRate",
}
INFLIGHT_BATCHING_KEYS = {
    "numScheduledRequests",
    "numContextRequests",
    "numGenRequests",
    "numPausedRequests",
    "numCtxTokens",
    "microBatchId",
    "avgNumDecodedTokensPerIter",
}
INT_KEYS = {
    "iter",
    "numNewActiveRequests",
    "numActiveRequests",
    "numQueuedRequests",
    "numCompletedRequests",
    "maxNumActiveRequests",
    "maxBatchSizeStatic",
    "maxBatchSizeRuntime",
    "maxNumTokensStatic",
    "maxNumTokensRuntime",
    "gpuMemUsage",
    "cpuMemUsage",
    "pinnedMemUsage",
}


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "64",
            "--block-size",
            str(BLOCK_SIZE),
            "--max-num-seqs",
            "8",
        ],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    with LLM(cluster.address) as client:
        yield client


def test_iteration_stats_have_tensorrt_llms_keys_and_ints(cluster, llm):
    llm.get_stats(timeout=0.1)  # drop what came before
    llm.generate(
        [f"three requests {i}" for i in range(3)],
        SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=False,
    )
    stats = llm.get_stats(timeout=2)
    assert stats
    for s in stats:
        assert ITERATION_STATS_KEYS <= set(s) and s["worker_id"] == cluster.workers[0].address
        assert KV_CACHE_STATS_KEYS <= set(s["kvCacheStats"])
        assert INFLIGHT_BATCHING_KEYS <= set(s["inflightBatchingStats"])
        for key in INT_KEYS:
            assert type(s[key]) is int, (key, s[key])
        assert all(type(v) is int for k, v in s["kvCacheStats"].items() if k != "cacheHitRate")
        assert isinstance(s["timestamp"], str) and s["staticBatchingStats"] is None
        assert s["maxNumActiveRequests"] == s["maxBatchSizeStatic"] == 8
        assert (
            s["kvCacheStats"]["maxNumBlocks"] == 64
            and s["kvCacheStats"]["tokensPerBlock"] == BLOCK_SIZE
        )
        assert (
            s["cpuMemUsage"] > 0 and s["gpuMemUsage"] == 0
        )  # a CPU worker: its resident memory, no device
    assert [s["iter"] for s in stats] == sorted(s["iter"] for s in stats)
    # Every request entered once and completed once.
    assert sum(s["numNewActiveRequests"] for s in stats) == 3
    assert sum(s["numCompletedRequests"] for s in stats) == 3


def test_kv_event_block_hashes_are_exact(llm):
    llm.get_kv_cache_events(timeout=0.1)
    prompts = [[1] + [(13 * i + j) % 250 + 3 for j in range(4 * BLOCK_SIZE)] for i in range(4)]
    llm.generate(prompts, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
    events = llm.get_kv_cache_events(timeout=2)
    stored = [e["data"] for e in events if e["data"]["type"] == "stored"]
    assert stored and all(type(e["event_id"]) is int for e in events)
    hashes = []
    for data in stored:
        for block in data["blocks"]:
            # TensorRT-LLM's KVCacheEventSerializer: every token has its token_extra_id (0: none).
            assert set(block) == {
                "type",
                "block_hash",
                "tokens",
                "lora_id",
                "cache_level",
                "priority",
            }
            assert all(
                set(t) == {"type", "token_id", "token_extra_id"}
                and t["type"] == "unique_token"
                and t["token_extra_id"] == 0
                for t in block["tokens"]
            )
            tokens = [t["token_id"] for t in block["tokens"]]
            # Recomputed here from the event's own parent and tokens: bit-exact or the hash was rounded.
            assert block["block_hash"] == chain_hash(data["parent_hash"], tokens, None)
            assert type(block["block_hash"]) is int
            hashes.append(block["block_hash"])
    assert max(hashes) > 2**53, "63-bit hashes: a double could not hold them"


def test_async_stats_end_once_nothing_arrives(cluster):
    # TensorRT-LLM: tensorrt_llm/executor/result.py, IterationResult.__anext__ raises
    # StopAsyncIteration when nothing arrives within its timeout.
    async def go():
        async with AsyncLLM(cluster.address) as aio:
            await aio.generate_async("stats stream", SamplingParams(max_tokens=3, ignore_eos=True))
            started = time.monotonic()
            stats = [s async for s in aio.get_stats_async(timeout=1.0)]
            events = [e async for e in aio.get_kv_cache_events_async(timeout=0.5)]
            return stats, events, time.monotonic() - started

    stats, events, elapsed = asyncio.run(go())
    assert elapsed < 10
    assert len(stats) >= 3 and all(
        type(s["iter"]) is int for s in stats
    )  # one per step of the request
    assert all(type(e["event_id"]) is int for e in events)


def test_memory_readings_serve_the_records_of_half_a_second(monkeypatch):
    """The device is asked for its memory at most once per MEMORY_SAMPLE_S (a driver call per
    step otherwise); a reading that old is taken again."""
    from tandem.engine import iteration_stats as stats_module

    readings = []

    def read(device):
        readings.append(device)
        return {"cpuMemUsage": len(readings), "gpuMemUsage": 0, "pinnedMemUsage": 0}

    monkeypatch.setattr(stats_module, "_read_memory", read)
    monkeypatch.setattr(stats_module, "_memory_readings", {})
    window = stats_module.MEMORY_SAMPLE_S
    assert stats_module.memory_usage("cpu", now=100.0)["cpuMemUsage"] == 1
    assert stats_module.memory_usage("cpu", now=100.0 + window / 2)["cpuMemUsage"] == 1
    assert stats_module.memory_usage("cuda:1", now=100.0 + window / 2)["cpuMemUsage"] == 2
    assert stats_module.memory_usage("cpu", now=100.0 + window)["cpuMemUsage"] == 3
    assert readings == ["cpu", "cuda:1", "cpu"]
