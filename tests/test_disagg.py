"""Disaggregated serving: router -> prefill (context_only) -> NIXL READ -> decode
(generation_only), as real processes. The aggregated worker in the same cluster
and transformers are the oracles."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import assert_all_blocks_free

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.kvtransfer import TransceiverState
from tandem.testing.cluster import LocalCluster, channel_to
from tandem.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 8
ENGINE_ARGS = [
    "--num-blocks",
    "128",
    "--block-size",
    str(BLOCK_SIZE),
    "--max-num-batched-tokens",
    "128",
]


def worker_state(address: str) -> worker_pb2.WorkerState:
    """A worker's state, read with its cluster's credentials (workers serve only the internal plane)."""
    with channel_to(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetWorkerState(
            worker_pb2.WorkerStateRequest(), timeout=10
        )


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def served(request, model_dirs):
    """prefill + decode (the router splits every request) and an aggregated worker to compare with."""
    model_dir = model_dirs[request.param]
    with LocalCluster(
        roles=["prefill", "decode", "both"], engine_args=["--model", str(model_dir), *ENGINE_ARGS]
    ) as c:
        with (
            LLM(c.address) as llm,
            LLM(c.workers[2].address, **c.worker_client_kwargs()) as aggregated,
        ):
            yield model_dir, c, llm, aggregated


@pytest.fixture(autouse=True)
def no_leaked_blocks(served):
    yield
    assert_all_blocks_free(served[2])


def _prompts(vocab_size: int, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(4, vocab_size) for _ in range(rng.randrange(2, 70))]
        for _ in range(num)
    ]


def _block_nbytes(model_dir) -> int:
    from tandem.engine.model_config import ModelConfig

    mc = ModelConfig.from_pretrained(model_dir)
    return mc.num_layers * 2 * BLOCK_SIZE * mc.num_kv_heads * mc.head_dim * 4  # float32


def test_disaggregated_equals_aggregated_and_transformers(served, oracle):
    model_dir, cluster, llm, aggregated = served
    ref = oracle(model_dir)
    prefill, decode = cluster.workers[0].address, cluster.workers[1].address
    before = worker_state(decode)
    prompts = _prompts(ref.model.config.vocab_size, 8, seed=11)
    greedy = SamplingParams(max_tokens=20)
    seeded = [
        SamplingParams(
            max_tokens=20, temperature=0.9, top_p=0.95, seed=100 + i, ignore_eos=True, logprobs=0
        )
        for i in range(8)
    ]

    async def both_ways():
        split, local = (
            await AsyncLLM(cluster.address),
            await AsyncLLM(cluster.workers[2].address, **cluster.worker_client_kwargs()),
        )
        try:
            # Greedy first and alone: these prompts share no block, so nothing comes from the
            # decode's prefix cache and every prompt block must be pulled.
            greedy_outs = await asyncio.gather(*(split.generate_async(p, greedy) for p in prompts))
            middle = worker_state(decode)
            seeded_outs = await asyncio.gather(
                asyncio.gather(*(split.generate_async(p, s) for p, s in zip(prompts, seeded))),
                asyncio.gather(*(local.generate_async(p, s) for p, s in zip(prompts, seeded))),
            )
            return greedy_outs, middle, *seeded_outs
        finally:
            split.close()
            local.close()

    split_greedy, middle, split_seeded, local_seeded = asyncio.run(both_ways())
    for p, out in zip(prompts, split_greedy):
        assert out.outputs[0].token_ids == ref.greedy(p, 20)
        assert out.metrics.served_by == [prefill, decode] or len(out.outputs[0].token_ids) == 1
    for a, b in zip(split_seeded, local_seeded):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].text == b.outputs[0].text
        # The first token's logprob was sampled on the prefill; the router carries it over.
        assert a.outputs[0].cumulative_logprob == pytest.approx(
            b.outputs[0].cumulative_logprob, rel=1e-4, abs=1e-4
        )
    # The KV really moved: the decode worker computed no prompt token and received
    # exactly the prompts' blocks.
    after = worker_state(decode)
    assert after.num_prompt_tokens_computed == before.num_prompt_tokens_computed == 0
    handed_off = [o for o in split_greedy if o.metrics.kv_transfer_bytes]
    assert len(handed_off) >= 7
    expected = sum(
        -(-len(o.prompt_token_ids) // BLOCK_SIZE) * _block_nbytes(model_dir) for o in handed_off
    )
    assert middle.kv_bytes_received - before.kv_bytes_received == expected
    assert sum(o.metrics.kv_transfer_bytes for o in handed_off) == expected


def test_streaming_through_the_split_is_one_continuous_stream(served):
    _, cluster, llm, aggregated = served

    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            ids, text, n = [], "", 0
            async for out in aio.generate_async(
                "stream me across workers",
                SamplingParams(max_tokens=16, ignore_eos=True),
                streaming=True,
            ):
                n += 1
                ids += out.outputs[0].token_ids_diff
                text += out.outputs[0].text_diff
            return out, ids, text, n
        finally:
            aio.close()

    out, ids, text, n = asyncio.run(go())
    expected = aggregated.generate(
        "stream me across workers", SamplingParams(max_tokens=16, ignore_eos=True), use_tqdm=False
    )
    assert n >= 2 and ids == out.outputs[0].token_ids == expected.outputs[0].token_ids
    assert text == out.outputs[0].text == expected.outputs[0].text
    assert out.prompt_token_ids == expected.prompt_token_ids


def test_request_that_ends_in_the_context_phase_skips_decode(served):
    _, cluster, llm, _ = served
    before = worker_state(cluster.workers[1].address).num_generated_tokens
    out = llm.generate("just one", SamplingParams(max_tokens=1), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 1 and out.outputs[0].finish_reason == "length"
    assert out.metrics.served_by == [cluster.workers[0].address]
    assert worker_state(cluster.workers[1].address).num_generated_tokens == before


def test_transceiver_state_is_served(served):
    _, cluster, llm, _ = served
    state = TransceiverState.from_bytes(llm.get_data_transceiver_state())
    assert state.memory_type == "DRAM" and state.num_blocks == 128
    assert (
        llm.get_data_transceiver_state(cluster.workers[1].address)
        != llm.get_data_transceiver_state()
    )
    assert llm.disaggregated_params["mode"] == "disaggregated"


def test_cancel_during_decode_reaches_both_workers(served):
    _, cluster, llm, _ = served
    decode = cluster.workers[1].address

    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            result = aio.generate_async(
                "long decode", SamplingParams(max_tokens=400, ignore_eos=True), streaming=True
            )
            async for out in result:
                if len(out.outputs[0].token_ids) >= 4:
                    result.abort()
            return out
        finally:
            aio.close()

    out = asyncio.run(go())
    assert out.outputs[0].finish_reason == "cancelled" and len(out.outputs[0].token_ids) < 400
    assert worker_state(decode).num_active_requests == 0


def test_n_sequences_through_the_split_equal_the_aggregated_worker(served):
    _, cluster, llm, aggregated = served
    # A high temperature: the tiny models are so peaked that cooler samples often coincide.
    params = SamplingParams(max_tokens=10, n=3, temperature=8.0, seed=42, ignore_eos=True)
    split = llm.generate("three ways", params, use_tqdm=False)
    local = aggregated.generate("three ways", params, use_tqdm=False)
    assert [o.index for o in split.outputs] == [0, 1, 2]
    assert [o.token_ids for o in split.outputs] == [o.token_ids for o in local.outputs]
    assert [o.text for o in split.outputs] == [o.text for o in local.outputs]
    assert len({tuple(o.token_ids) for o in split.outputs}) > 1
    assert split.finished and all(o.finish_reason == "length" for o in split.outputs)


def test_prefix_caching_on_both_sides_of_the_split(served):
    """A repeated prompt: the prefill recomputes only the tail after its cached blocks, and
    the decode pulls only the blocks its own cache lacks."""
    _, cluster, llm, _ = served
    prefill, decode = cluster.workers[0].address, cluster.workers[1].address
    prompt = [1] + [
        (7 * i) % 300 + 4 for i in range(45)
    ]  # 46 tokens: 5 full blocks of 8 and a tail
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    first = llm.generate(prompt, params, use_tqdm=False)
    p0, d0 = worker_state(prefill), worker_state(decode)
    second = llm.generate(prompt, params, use_tqdm=False)
    p1, d1 = worker_state(prefill), worker_state(decode)
    assert second.outputs[0].token_ids == first.outputs[0].token_ids
    assert p1.num_prompt_tokens_computed - p0.num_prompt_tokens_computed == 46 - 5 * BLOCK_SIZE
    assert second.metrics.num_cached_prompt_tokens == 5 * BLOCK_SIZE
    # The decode had all 5 full blocks: only the partial last block moved.
    assert (
        d1.kv_bytes_received - d0.kv_bytes_received
        == second.metrics.kv_transfer_bytes
        == 1 * _block_nbytes(served[0])
    )
    salted = llm.generate(prompt, params, use_tqdm=False, cache_salt="tenant-b")
    assert salted.metrics.num_cached_prompt_tokens == 0  # another salt shares nothing
    assert salted.outputs[0].token_ids == first.outputs[0].token_ids


def test_kv_cache_events(served):
    _, cluster, llm, _ = served
    llm.get_kv_cache_events(timeout=0.1)  # drop what earlier tests produced
    llm.generate([1] + [5] * 20, SamplingParams(max_tokens=2), use_tqdm=False)
    events = llm.get_kv_cache_events(timeout=2)
    stored = [e for e in events if e["data"]["type"] == "stored"]
    assert {e["worker_id"] for e in stored} >= {
        cluster.workers[0].address,
        cluster.workers[1].address,
    }
    block = stored[0]["data"]["blocks"][0]
    assert block["type"] == "stored_block" and len(block["tokens"]) == BLOCK_SIZE
    assert all(isinstance(e["event_id"], (int, float)) for e in events)
