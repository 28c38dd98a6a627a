"""LoRA adapters through a real cluster (router, prefill, two decodes and an aggregated worker as
processes, the tiny Llama): split and aggregated serving give transformers + peft's tokens; the
same prompt under two adapters shares no KV block; a decode worker that cannot load the adapter
a handoff was computed with refuses it; the router sends an adapter's requests to the decode
worker that holds it and reports who holds what."""

from __future__ import annotations

import asyncio
import shutil
import time

import grpc
import pytest
from conftest import assert_all_blocks_free
from lora_adapters import PeftOracle, write_adapter

from tandem.client import LLM, DisaggregatedParams, LoRARequest, SamplingParams
from tandem.client.errors import RequestError
from tandem.testing.cluster import LocalCluster
from tandem.v1 import worker_pb2, worker_pb2_grpc

BLOCK_SIZE = 8
GREEDY = SamplingParams(max_tokens=8)
PROMPTS = [
    [1, 57, 12, 230, 9, 41, 77, 3, 150, 18, 66, 201, 5, 90, 33, 14, 120, 7],
    [1, 300, 4, 44, 19, 270, 8, 61, 99, 102, 6],
]


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    model_dir = model_dirs["llama"]
    root = tmp_path_factory.mktemp("lora")
    adapters = {
        i: LoRARequest(
            f"adapter-{i}",
            i,
            str(write_adapter(model_dir, root / f"a{i}", seed=i, rank=4 * i, std=0.2)),
        )
        for i in (1, 2, 3)
    }
    engine_args = ["--model", str(model_dir), "--num-blocks", "96", "--block-size", str(BLOCK_SIZE)]
    with LocalCluster(
        roles=["prefill", "decode", "decode", "both"], engine_args=engine_args
    ) as cluster:
        with (
            LLM(cluster.address) as llm,
            LLM(cluster.workers[3].address, **cluster.worker_client_kwargs()) as aggregated,
        ):
            yield cluster, llm, aggregated, adapters, PeftOracle(model_dir), root


def test_split_and_aggregated_give_transformers_peft_tokens(served):
    cluster, llm, aggregated, adapters, oracle, _ = served
    # One batch per front: every prompt under every adapter and the base model, concurrently.
    jobs = [(prompt, adapter) for prompt in PROMPTS for adapter in [*adapters.values(), None]]
    prompts, loras = [p for p, _ in jobs], [a for _, a in jobs]
    split = llm.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    local = aggregated.generate(prompts, GREEDY, lora_request=loras, use_tqdm=False)
    for (prompt, adapter), s, a in zip(jobs, split, local):
        expected = oracle.greedy(
            prompt, GREEDY.max_tokens, None if adapter is None else adapter.lora_path
        )
        assert s.outputs[0].token_ids == a.outputs[0].token_ids == expected, adapter
        assert len(s.metrics.served_by) == 2  # prefill, then a decode
    assert (
        len({tuple(r.outputs[0].token_ids) for r in split[:4]}) == 4
    )  # each adapter changes the output
    assert_all_blocks_free(llm)


def test_the_same_prompt_under_two_adapters_shares_no_kv_block(served):
    _, _, aggregated, adapters, _, _ = served
    prompt = [1] + list(range(40, 80))  # no earlier test computed any of its blocks
    aggregated.get_kv_cache_events(timeout=0.1)  # drop what earlier tests produced
    cached = {}
    for name, adapter in (("a1", adapters[1]), ("a2", adapters[2]), ("a1-again", adapters[1])):
        out = aggregated.generate(prompt, GREEDY, lora_request=adapter, use_tqdm=False)
        cached[name] = out.metrics.num_cached_prompt_tokens
    assert cached["a2"] == 0 and cached["a1-again"] == (len(prompt) - 1) // BLOCK_SIZE * BLOCK_SIZE
    hashes: dict = {}
    for event in aggregated.get_kv_cache_events(timeout=2):
        if event["data"]["type"] == "stored":
            for block in event["data"]["blocks"]:
                hashes.setdefault(block["lora_id"], set()).add(block["block_hash"])
    assert (
        len(hashes[1]) >= len(prompt) // BLOCK_SIZE and len(hashes[2]) >= len(prompt) // BLOCK_SIZE
    )
    assert not hashes[1] & hashes[2]


def cluster_model(cluster) -> str:
    return cluster.engine_args[cluster.engine_args.index("--model") + 1]


def _context_only(cluster, llm_address: str, prompt, adapter):
    with LLM(llm_address, **cluster.worker_client_kwargs()) as prefill:
        out = prefill.generate(
            prompt,
            GREEDY,
            lora_request=adapter,
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(request_type="context_only"),
        )
    return out.outputs[0].disaggregated_params


def _generation_only(decode: LLM, prompt, handoff, adapter):
    return decode.generate(
        prompt,
        GREEDY,
        lora_request=adapter,
        use_tqdm=False,
        disaggregated_params=DisaggregatedParams(
            request_type="generation_only",
            first_gen_tokens=handoff.first_gen_tokens,
            ctx_request_id=handoff.ctx_request_id,
            opaque_state=handoff.opaque_state,
        ),
    )


def _release(cluster, handoff) -> None:
    with cluster.channel(cluster.workers[0].address) as channel:
        worker_pb2_grpc.WorkerStub(channel).ReleaseKv(
            worker_pb2.ReleaseKvRequest(ctx_request_id=handoff.ctx_request_id)
        )


def test_a_decode_that_cannot_load_the_adapter_refuses_the_handoff(served):
    cluster, llm, _, adapters, _, root = served
    moved = LoRARequest("moving", 9, str(shutil.copytree(adapters[3].lora_path, root / "moving")))
    prompt = PROMPTS[1]
    with LLM(cluster.workers[1].address, **cluster.worker_client_kwargs()) as decode:
        handoff = _context_only(cluster, cluster.workers[0].address, prompt, moved)
        shutil.rmtree(moved.lora_path)  # the decode worker does not have the files
        with pytest.raises(RequestError) as refused:
            _generation_only(decode, prompt, handoff, moved)
        assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "'moving'" in str(refused.value) and "cannot load" in str(refused.value)
        # The handoff names its adapter: presented without it (or with another) it is refused too.
        for other in (None, adapters[1]):
            with pytest.raises(RequestError) as mismatch:
                _generation_only(decode, prompt, handoff, other)
            assert mismatch.value.code == grpc.StatusCode.FAILED_PRECONDITION
            assert "computed with LoRA adapter 'moving'" in str(mismatch.value)
        _release(cluster, handoff)
        # With the adapter it was computed with, the same handoff goes through.
        good = _context_only(cluster, cluster.workers[0].address, prompt, adapters[3])
        pulled = _generation_only(decode, prompt, good, adapters[3])
        whole = llm.generate(prompt, GREEDY, lora_request=adapters[3], use_tqdm=False)
        # A generation_only output starts with the handoff's first_gen_tokens.
        assert pulled.outputs[0].token_ids[: len(good.first_gen_tokens)] == list(
            good.first_gen_tokens
        )
        assert pulled.outputs[0].token_ids == whole.outputs[0].token_ids
    assert_all_blocks_free(llm)


def test_the_router_prefers_the_decode_that_holds_the_adapter_and_reports_who_holds_what(served):
    cluster, llm, _, _, _, root = served
    fresh = LoRARequest(
        "fresh",
        7,
        str(write_adapter(cluster_model(cluster), root / "fresh", seed=7, rank=4, std=0.2)),
    )
    decodes = {cluster.workers[1].address, cluster.workers[2].address}
    served_by = [
        llm.generate(PROMPTS[i % 2], GREEDY, lora_request=fresh, use_tqdm=False).metrics.served_by[
            -1
        ]
        for i in range(4)
    ]
    assert len(set(served_by)) == 1 and served_by[0] in decodes  # round-robin would alternate
    holder = served_by[0]
    deadline = time.monotonic() + 5
    prefill = cluster.workers[0].address
    while True:  # the router polls each of its workers every 0.2 s, each in its own time
        llm._info = None
        info = llm._server_info()
        held = {w.worker_id: {a.lora_int_id for a in w.lora_adapters} for w in info.workers}
        if (7 in held[holder] and 7 in held[prefill]) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    assert 7 in held[holder] and 7 in held[prefill]
    assert 7 not in held[(decodes - {holder}).pop()] and 7 not in held[cluster.workers[3].address]
    entry = next(
        a
        for w in info.workers
        if w.worker_id == holder
        for a in w.lora_adapters
        if a.lora_int_id == 7
    )
    assert (entry.lora_name, entry.lora_path) == ("fresh", fresh.lora_path)


def test_pick_weighs_holding_the_adapter_against_load():
    """The router's policy on its own (no worker behind the addresses is ever called): a worker
    that holds the adapter wins unless it has ADAPTER_MISS_COST more requests in flight; one just
    sent a request with the adapter counts as holding it."""
    from tandem.common.roles import Role
    from tandem.router.workers import ADAPTER_MISS_COST, WorkerPool
    from tandem.v1 import types_pb2

    async def main():
        pool = WorkerPool(("127.0.0.1:1", "127.0.0.1:2"), health_interval_s=1.0)
        holder, other = pool.workers
        for w in pool.workers:
            w.role, w.ready = Role.DECODE, True
        holder.lora_adapters = [types_pb2.LoRARequest(lora_name="x", lora_int_id=5, lora_path="/x")]
        picks = {pool.pick(Role.DECODE, adapter_id=5).address for _ in range(6)}
        base = {pool.pick(Role.DECODE).address for _ in range(6)}
        holder.in_flight = ADAPTER_MISS_COST - 1
        busy_holder = pool.pick(Role.DECODE, adapter_id=5)
        holder.in_flight = ADAPTER_MISS_COST + 1
        too_busy = pool.pick(Role.DECODE, adapter_id=5)
        holder.in_flight = other.in_flight = 0
        new = [pool.pick(Role.DECODE, adapter_id=6).address for _ in range(4)]
        await pool.close()
        return picks, base, busy_holder, too_busy, new

    picks, base, busy_holder, too_busy, new = asyncio.run(main())
    assert picks == {"127.0.0.1:1"} and base == {"127.0.0.1:1", "127.0.0.1:2"}
    assert busy_holder.address == "127.0.0.1:1" and too_busy.address == "127.0.0.1:2"
    assert len(set(new)) == 1  # the first pick of a new adapter makes that worker its holder
