"""Issue 9, groups 3 and 9: the result object and the client's lifetime as TensorRT-LLM has
them. RequestOutput.aborted() is a method, a streaming result iterates from sync and async
code (__next__, __anext__), `async with AsyncLLM(...)`, setup_async() returns self;
shutdown() closes the client only, and stopping the cluster is the admin shutdown_cluster()."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, RequestError, RequestOutput, SamplingParams
from tandem.testing.cluster import LocalCluster

LONG = SamplingParams(max_tokens=200, ignore_eos=True)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both"], engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "64"]
    ) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    with LLM(cluster.address) as client:
        yield client


def _wait_idle(address: str, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while worker_state(address).num_active_requests and time.monotonic() < deadline:
        time.sleep(0.05)
    return worker_state(address)


def test_aborted_is_a_method(llm):
    # TensorRT-LLM: tensorrt_llm/executor/result.py, GenerationResult.aborted() -> bool (a method,
    # True once abort() was called).
    assert callable(RequestOutput.aborted)
    done = llm.generate("not aborted", SamplingParams(max_tokens=3), use_tqdm=False)
    assert done.aborted() is False
    result = llm.generate_async("abort me", LONG)
    result.abort()
    assert result.aborted() is True
    out = result.result()
    assert out.aborted() is True and out.outputs[0].finish_reason == "cancelled"
    assert len(out.outputs[0].token_ids) < 200


def test_sync_streaming_from_plain_code(cluster, llm):
    # TensorRT-LLM: GenerationResult.__iter__ / __next__ step a streaming result synchronously.
    ids, steps = [], 0
    for out in llm.generate_async(
        "stream me", SamplingParams(max_tokens=12, ignore_eos=True), streaming=True
    ):
        steps += 1
        ids += out.outputs[0].token_ids_diff
    assert steps >= 2 and out.finished and ids == out.outputs[0].token_ids and len(ids) == 12
    result = llm.generate_async(
        "step by hand", SamplingParams(max_tokens=6, ignore_eos=True), streaming=True
    )
    first = next(result)
    assert first is result and first.outputs[0].token_ids
    assert result.result().finished and len(result.outputs[0].token_ids) == 6
    with pytest.raises(StopIteration):
        next(result)


def test_leaving_a_sync_stream_early_aborts_on_the_server(cluster, llm):
    before = worker_state(cluster.workers[0].address).num_generated_tokens
    for out in llm.generate_async("leave early", LONG, streaming=True):
        if len(out.outputs[0].token_ids) >= 2:
            break
    state = _wait_idle(cluster.workers[0].address)
    assert state.num_active_requests == 0 and state.num_generated_tokens - before < 200


def test_anext_and_await(cluster):
    # TensorRT-LLM: GenerationResult.__anext__ steps a streaming result; __await__ gives the final one.
    async def go():
        aio = await AsyncLLM(cluster.address)  # AsyncLLM.__await__ -> setup_async() -> self
        try:
            assert isinstance(aio, AsyncLLM)
            result = aio.generate_async(
                "anext", SamplingParams(max_tokens=5, ignore_eos=True), streaming=True
            )
            first = await result.__anext__()
            second = await anext(result)
            assert first is second is result
            while True:
                try:
                    await result.__anext__()
                except StopAsyncIteration:
                    break
            awaited = await aio.generate_async(
                "await", SamplingParams(max_tokens=4, ignore_eos=True)
            )
            return result, awaited
        finally:
            aio.shutdown()

    streamed, awaited = asyncio.run(go())
    assert streamed.finished and len(streamed.outputs[0].token_ids) == 5
    assert awaited.finished and len(awaited.outputs[0].token_ids) == 4


def test_async_with_and_setup_async(cluster):
    # TensorRT-LLM: tensorrt_llm/_torch/async_llm.py: setup_async() returns self, __aenter__ awaits it,
    # __aexit__ shuts the LLM down, and a plain `with` is refused.
    async def go():
        async with AsyncLLM(cluster.address) as aio:
            assert await aio.setup_async() is aio
            out = await aio.generate_async("inside", SamplingParams(max_tokens=3, ignore_eos=True))
        with pytest.raises(RuntimeError, match="LLM is shutting down"):
            aio.generate_async("after", SamplingParams(max_tokens=3))
        return out

    assert len(asyncio.run(go()).outputs[0].token_ids) == 3
    aio = AsyncLLM(cluster.address)
    try:
        with pytest.raises(RuntimeError, match="Please use 'async with AsyncLLM' instead"):
            with aio:
                pass
    finally:
        aio.shutdown()


def test_shutdown_closes_the_client_and_not_the_cluster(cluster):
    # TensorRT-LLM: BaseLLM.shutdown() ends what the LLM object owns, and __exit__ calls it.
    with LLM(cluster.address) as client:
        assert client.generate("before", SamplingParams(max_tokens=2), use_tqdm=False).finished
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        client.generate("after", SamplingParams(max_tokens=2), use_tqdm=False)
    other = LLM(cluster.address)
    other.shutdown()
    other.shutdown()  # idempotent
    with LLM(cluster.address) as fresh:  # the cluster still serves
        assert fresh.generate("still up", SamplingParams(max_tokens=2), use_tqdm=False).finished
    assert all(s.process.poll() is None for s in cluster.services)


def test_shutdown_cluster_is_an_admin_call(model_dirs):
    token = "stop-it"
    cluster = LocalCluster(
        roles=["both"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "16"],
        env={"TANDEM_ADMIN_TOKEN": token},
    )
    with cluster:
        with LLM(cluster.address) as anonymous, pytest.raises(RequestError) as err:
            anonymous.shutdown_cluster()
        assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
        assert all(s.process.poll() is None for s in cluster.services)
        with LLM(cluster.address, auth_token=token) as admin:
            detail = admin.shutdown_cluster()
        assert any("stopping" in d for d in detail)
        for service in cluster.services:
            assert service.process.wait(timeout=20) == 0, service.log_tail()
