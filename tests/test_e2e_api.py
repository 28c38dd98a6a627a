"""The client API against a real router + worker on the default model: streaming,
sampling, stops, abort/cancel, bad input, and the introspection surface."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from conftest import assert_all_blocks_free

from tandem.client import LLM, AsyncLLM, PreprocessedInputs, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster


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
            "8",
            "--max-model-len",
            "256",
        ],
    ) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    client = LLM(cluster.address)
    yield client
    client.close()


@pytest.fixture(autouse=True)
def no_leaked_blocks(llm):
    yield
    assert_all_blocks_free(llm)


def _run(coro):
    return asyncio.run(coro)


def test_streaming_deltas_add_up_to_the_final_text(cluster, llm):
    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            texts, ids, n = [], [], 0
            async for out in aio.generate_async(
                "Once upon a time", SamplingParams(max_tokens=20, ignore_eos=True), streaming=True
            ):
                n += 1
                texts.append(out.outputs[0].text_diff)
                ids.extend(out.outputs[0].token_ids_diff)
            return out, "".join(texts), ids, n
        finally:
            aio.close()

    out, text, ids, num_messages = _run(go())
    assert out.finished and num_messages >= 2
    assert ids == out.outputs[0].token_ids and len(ids) == 20
    assert text == out.outputs[0].text == llm.tokenizer.decode(ids)
    assert out.outputs[0].finish_reason == "length"


def test_seeded_sampling_is_reproducible(llm):
    params = [
        SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, top_k=50, seed=s, ignore_eos=True)
        for s in (1, 1, 2)
    ]
    outs = llm.generate(["a b c", "a b c", "a b c"], params, use_tqdm=False)
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids
    assert outs[0].outputs[0].token_ids != outs[2].outputs[0].token_ids


def test_stop_token_ids_and_stop_strings(llm):
    free = llm.generate(
        "x y z", SamplingParams(max_tokens=12, ignore_eos=True), use_tqdm=False
    ).outputs[0]
    stop_at = free.token_ids[5]
    out = llm.generate(
        "x y z",
        SamplingParams(max_tokens=12, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    ).outputs[0]
    first = free.token_ids.index(stop_at)
    assert out.token_ids == free.token_ids[:first]  # the stop token trimmed, as TensorRT-LLM
    assert out.finish_reason == "stop" and out.stop_reason == stop_at
    # A stop string from the middle of the free text: the first 3-character window with no
    # whitespace (the run fails, rather than skips, when the text has none).
    middle = len(free.text) // 2
    stop_str = next(
        (
            free.text[i : i + 3]
            for i in list(range(middle, len(free.text) - 2)) + list(range(middle))
            if len(free.text[i : i + 3].strip()) == 3 and "\ufffd" not in free.text[i : i + 3]
        ),
        None,
    )
    assert stop_str is not None, f"no stop string candidate in {free.text!r}"
    out = llm.generate(
        "x y z", SamplingParams(max_tokens=12, ignore_eos=True, stop=[stop_str]), use_tqdm=False
    ).outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop_str
    assert out.text == free.text[: free.text.index(stop_str)]
    assert free.token_ids[: len(out.token_ids)] == out.token_ids and len(out.token_ids) < len(
        free.token_ids
    )


def test_sync_generate_batch_with_tqdm(llm, capsys):
    outs = llm.generate(
        [f"prompt {i}" for i in range(6)],
        SamplingParams(max_tokens=4, ignore_eos=True),
        use_tqdm=True,
    )
    assert [len(o.outputs[0].token_ids) for o in outs] == [4] * 6
    assert "Processed requests" in capsys.readouterr().err


@pytest.mark.parametrize(
    "inputs, params, fragment",
    [
        ("", SamplingParams(max_tokens=4), "empty"),
        ([1, 10**6], SamplingParams(max_tokens=4), "out of vocabulary"),
        ("hi", SamplingParams(max_tokens=0), "max_tokens"),
        ([1] * 300, SamplingParams(max_tokens=4), "context"),
        (
            "hi",
            SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**7]),
            "stop_token_ids",
        ),
        ("hi", SamplingParams(max_tokens=4, stop_token_ids=[-1]), "stop_token_ids"),
    ],
)
def test_bad_input_is_invalid_argument(llm, inputs, params, fragment):
    with pytest.raises(RequestError) as err:
        llm.generate(inputs, params, use_tqdm=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert fragment in err.value.details
    assert (
        llm.generate("still serving", SamplingParams(max_tokens=2), use_tqdm=False)
        .outputs[0]
        .token_ids
    )


def test_prompt_larger_than_the_kv_pool_is_resource_exhausted(cluster, model_dirs):
    with (
        LocalCluster(
            roles=["both"],
            engine_args=[
                "--model",
                str(model_dirs["llama"]),
                "--num-blocks",
                "4",
                "--block-size",
                "4",
            ],
        ) as small,
        LLM(small.address) as client,
    ):
        with pytest.raises(RequestError) as err:
            client.generate([1] * 40, SamplingParams(max_tokens=2), use_tqdm=False)
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "KV blocks" in err.value.details


def test_abort_mid_stream_finishes_cancelled(cluster, llm):
    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            result = aio.generate_async(
                "abort me", SamplingParams(max_tokens=200, ignore_eos=True), streaming=True
            )
            async for out in result:
                if len(out.outputs[0].token_ids) >= 3:
                    result.abort()
            return out
        finally:
            aio.close()

    out = _run(go())
    assert out.finished and out.outputs[0].finish_reason == "cancelled"
    assert 3 <= len(out.outputs[0].token_ids) < 200


def _worker_state(cluster):
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    with cluster.channel(cluster.workers[0].address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetWorkerState(worker_pb2.WorkerStateRequest())


def test_each_process_names_its_instance_in_health_answers_and_the_worker_state(cluster):
    """The router trusts a reopened health Watch only from the process its last state poll saw
    (router/worker_watch.py): a worker's health answers and its state carry the same instance id,
    and no other process has it."""
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    from tandem.common.health import INSTANCE_ID_METADATA

    def health_instance(address: str) -> str:
        with cluster.channel(address) as channel:
            _, call = health_pb2_grpc.HealthStub(channel).Check.with_call(
                health_pb2.HealthCheckRequest()
            )
            return dict(call.initial_metadata())[INSTANCE_ID_METADATA]

    worker = health_instance(cluster.workers[0].address)
    assert worker and worker == _worker_state(cluster).instance_id
    assert health_instance(cluster.workers[0].address) == worker  # drawn once per process
    assert health_instance(cluster.address) not in ("", worker)


def test_client_cancellation_aborts_on_the_server(cluster, llm):
    before = _worker_state(cluster).num_generated_tokens

    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            got_first = asyncio.Event()

            async def consume():
                async for _ in aio.generate_async(
                    "cancel me", SamplingParams(max_tokens=240, ignore_eos=True), streaming=True
                ):
                    got_first.set()
                    await asyncio.sleep(10)  # a slow consumer; cancelled while it waits

            task = asyncio.create_task(consume())
            await asyncio.wait_for(got_first.wait(), 10)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
        finally:
            aio.close()

    _run(go())
    deadline = time.monotonic() + 10
    while _worker_state(cluster).num_active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    state = _worker_state(cluster)
    assert state.num_active_requests == 0
    assert state.num_generated_tokens - before < 240


def test_leaving_the_stream_early_aborts_on_the_server(cluster, llm):
    before = _worker_state(cluster).num_generated_tokens

    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            stream = aio.generate_async(
                "leave early", SamplingParams(max_tokens=240, ignore_eos=True), streaming=True
            )
            agen = stream.__aiter__()
            await agen.__anext__()
            await agen.aclose()
        finally:
            aio.close()

    _run(go())
    deadline = time.monotonic() + 10
    while _worker_state(cluster).num_active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _worker_state(cluster).num_generated_tokens - before < 240


def test_preprocess_then_generate(llm):
    pre = llm.preprocess("preprocess me", SamplingParams(max_tokens=5))
    assert isinstance(pre, PreprocessedInputs) and pre.prompt_token_ids[0] == 1
    assert pre.prompt_token_ids == llm.tokenizer.encode("preprocess me")
    out = llm.generate(pre, SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    direct = llm.generate(
        "preprocess me", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False
    )
    assert out.outputs[0].token_ids == direct.outputs[0].token_ids


def test_introspection_surface(cluster, llm):
    cap = llm.get_kv_cache_capacity()
    assert cap["maxNumBlocks"] == 64 and cap["tokensPerBlock"] == 8 and cap["maxNumTokens"] == 512
    assert llm.llm_id and llm.disaggregated_params["mode"] == "aggregated"
    assert any(k.endswith("model_load_s") for k in llm.startup_metrics)
    tok = llm.tokenizer
    assert tok.decode(tok.encode("round trip")) == "round trip"
    assert llm.get_data_transceiver_state() == b""  # an aggregated worker has no transceiver
    llm.generate("stats please", SamplingParams(max_tokens=3), use_tqdm=False)
    stats = llm.get_stats(timeout=2)
    assert stats and {"iter", "kvCacheStats", "worker_id", "inflightBatchingStats"} <= set(
        stats[-1]
    )


def test_pause_blocks_new_requests_until_resume(cluster, llm):
    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            running = aio.generate_async(
                "long one", SamplingParams(max_tokens=400, ignore_eos=True)
            )
            await asyncio.sleep(0.3)
            await aio.pause_generation()
            out = await running
            assert out.outputs[0].finish_reason == "cancelled"
            with pytest.raises(RequestError) as err:
                await aio.generate_async("refused", SamplingParams(max_tokens=2))
            assert err.value.code == grpc.StatusCode.UNAVAILABLE
            await aio.resume_generation()
            assert (await aio.generate_async("accepted", SamplingParams(max_tokens=2))).finished
        finally:
            aio.close()

    _run(go())


def test_a_bad_request_does_not_fail_its_neighbours(cluster):
    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            good = aio.generate_async("neighbour", SamplingParams(max_tokens=40, ignore_eos=True))
            with pytest.raises(RequestError) as err:
                await aio.generate_async(
                    "bad", SamplingParams(max_tokens=4, min_tokens=2, stop_token_ids=[10**7])
                )
            assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
            return await good
        finally:
            aio.close()

    out = _run(go())
    assert out.outputs[0].finish_reason == "length" and len(out.outputs[0].token_ids) == 40


def test_immediate_aborts_are_never_lost(cluster):
    async def go():
        aio = await AsyncLLM(cluster.address)
        try:
            results = []
            for i in range(30):
                result = aio.generate_async(
                    f"abort at once {i}", SamplingParams(max_tokens=200, ignore_eos=True)
                )
                result.abort()
                results.append(await result)
            return results
        finally:
            aio.close()

    reasons = [r.outputs[0].finish_reason for r in _run(go())]
    assert reasons == ["cancelled"] * 30


def stop_string_only_in(text: str, other: str) -> str:
    """A 3-character stop string from the middle of text that `other` does not contain."""
    middle = len(text) // 2
    for i in list(range(middle, len(text) - 2)) + list(range(middle)):
        candidate = text[i : i + 3]
        if len(candidate.strip()) == 3 and "\ufffd" not in candidate and candidate not in other:
            return candidate
    raise AssertionError(f"no stop string candidate in {text!r} that {other!r} lacks")


def test_a_stop_string_ends_one_of_n_sequences(llm):
    import dataclasses

    params = SamplingParams(max_tokens=16, n=2, temperature=1.0, seed=5, ignore_eos=True)
    free = llm.generate("n sequences, one stops", params, use_tqdm=False).outputs
    stop = stop_string_only_in(free[0].text, free[1].text)
    out = llm.generate(
        "n sequences, one stops", dataclasses.replace(params, stop=[stop]), use_tqdm=False
    ).outputs
    assert out[0].finish_reason == "stop" and out[0].stop_reason == stop
    assert out[0].text == free[0].text[: free[0].text.index(stop)]
    assert free[0].token_ids[: len(out[0].token_ids)] == out[0].token_ids
    assert (out[1].token_ids, out[1].text, out[1].finish_reason) == (
        free[1].token_ids,
        free[1].text,
        "length",
    )
