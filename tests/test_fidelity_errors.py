"""Issue 9, groups 1-2: the errors a TensorRT-LLM user catches. Bad sampling values raise
ValueError when the params are built, with TensorRT-LLM's checks and messages; what the
server refuses raises a RequestError(RuntimeError) carrying the gRPC status, whichever way
the result is read."""

from __future__ import annotations

import asyncio
import re

import grpc
import pytest

from tandem.client import (
    LLM,
    AsyncLLM,
    DisaggregatedParams,
    GuidedDecodingParams,
    InvalidRequestError,
    RequestError,
    SamplingParams,
    UnsupportedRequestError,
)
from tandem.testing.cluster import LocalCluster

TOKEN = "fidelity-admin-token"
BAD_PROMPT = [1, 10**6]  # out of vocabulary: INVALID_ARGUMENT from the worker


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"],
        env={"TANDEM_ADMIN_TOKEN": TOKEN},
    ) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    with LLM(cluster.address) as client:
        yield client


# TensorRT-LLM: tensorrt_llm/sampling_params.py, SamplingParams._validate (run by __post_init__):
# these checks, these messages, at construction.
@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(top_p=1.5), "require 0 <= top_p <= 1, got top_p=1.5"),
        (dict(top_p=-0.1), "require 0 <= top_p <= 1, got top_p=-0.1"),
        (dict(top_k=-1), "require top_k >= 0, got top_k=-1"),
        (dict(temperature=-0.5), "require temperature >= 0, got temperature=-0.5"),
        (dict(n=3, best_of=2, temperature=1.0), "best_of (2) cannot be less than n (3)"),
        (dict(truncate_prompt_tokens=0), "truncate_prompt_tokens must be >= 1, got 0"),
        (
            dict(guided_decoding=GuidedDecodingParams(regex="a+", grammar="root ::= 'a'")),
            "Only one guide can be used for a request, but got 2.",
        ),
    ],
)
def test_bad_sampling_values_raise_value_error_at_construction(kwargs, message):
    with pytest.raises(ValueError, match=f"^{re.escape(message)}$"):
        SamplingParams(**kwargs)


# TensorRT-LLM: SamplingParams._validate refuses best_of > 1 when _greedy_decoding
# (params_imply_greedy_decoding: nothing set, top_k=1, top_p=0 or temperature=0) unless the
# environment has TLLM_ALLOW_N_GREEDY_DECODING; the refusal is at construction.
@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=2),
        dict(best_of=3),
        dict(n=2, temperature=0.0),
        dict(n=2, top_k=1, temperature=0.8),
        dict(n=2, top_p=0.0, temperature=0.8),
    ],
)
def test_greedy_with_several_returns_is_refused_at_construction(kwargs, monkeypatch):
    monkeypatch.delenv("TLLM_ALLOW_N_GREEDY_DECODING", raising=False)
    with pytest.raises(
        ValueError, match="^Greedy decoding in the LLM API does not allow multiple returns"
    ):
        SamplingParams(**kwargs)
    monkeypatch.setenv("TLLM_ALLOW_N_GREEDY_DECODING", "1")
    assert SamplingParams(**kwargs).best_of >= 2


@pytest.mark.parametrize(
    "kwargs",
    [
        dict(n=2, temperature=0.7),
        dict(n=2, top_k=5),
        dict(n=2, top_p=0.9),
        dict(n=2, use_beam_search=True),
    ],
)
def test_sampling_or_beams_with_several_returns_are_accepted(kwargs):
    assert SamplingParams(**kwargs).best_of == 2  # __post_init__: best_of = best_of or n


def test_top_p_zero_and_end_id_minus_one_are_accepted_at_construction():
    # TensorRT-LLM accepts both: _validate allows 0 <= top_p (top_p=0 implies greedy decoding) and
    # checks no end_id; __post_init__ copies end_id into an unset pad_id.
    params = SamplingParams(top_p=0.0, end_id=-1)
    assert params.top_p == 0.0 and params.end_id == -1 and params.pad_id == -1
    assert params._greedy_decoding
    msg = params.to_proto()
    assert msg.HasField("top_p") and msg.top_p == 0.0 and msg.end_id == -1


def test_construction_normalizes_as_tensorrt_llm_does():
    # SamplingParams.__post_init__ / _validate: best_of defaults to n, logprobs=True means top-1;
    # the dataclass is keyword-only (dataclass(slots=True, kw_only=True)).
    assert SamplingParams(n=4, temperature=1.0).best_of == 4
    assert (
        SamplingParams(logprobs=True).logprobs == 1
        and SamplingParams(logprobs=False).logprobs is None
    )
    with pytest.raises(TypeError):
        SamplingParams(16)


def test_disaggregated_params_are_checked_at_construction():
    # TensorRT-LLM: tensorrt_llm/disaggregated_params.py, DisaggregatedParams.__post_init__
    # lower-cases request_type and refuses unknown ones with this message.
    assert DisaggregatedParams(request_type="Context_Only").request_type == "context_only"
    with pytest.raises(
        ValueError,
        match=re.escape(
            "Unknown request type: prefill_only. Must be context_only, "
            "generation_only or context_and_generation"
        ),
    ):
        DisaggregatedParams(request_type="prefill_only")
    with pytest.raises(NotImplementedError, match="multimodal_hashes"):
        DisaggregatedParams(multimodal_hashes=[[1] * 8])


def test_a_refused_generate_raises_request_error_with_its_status(llm):
    # TensorRT-LLM: tensorrt_llm/executor/utils.py, class RequestError(RuntimeError): what a
    # failed request raises. Here it also carries the gRPC status; bad input is also a ValueError.
    with pytest.raises(RequestError) as err:
        llm.generate(BAD_PROMPT, SamplingParams(max_tokens=4), use_tqdm=False)
    error = err.value
    assert (
        isinstance(error, RuntimeError)
        and isinstance(error, InvalidRequestError)
        and isinstance(error, ValueError)
    )
    assert not isinstance(error, grpc.RpcError)
    assert error.code == grpc.StatusCode.INVALID_ARGUMENT
    assert "out of vocabulary" in error.details and "out of vocabulary" in str(error)


def test_every_way_of_reading_a_refused_request_raises_it(cluster, llm):
    params = SamplingParams(max_tokens=4)

    async def go():
        async with AsyncLLM(cluster.address) as aio:
            with pytest.raises(InvalidRequestError):
                await aio.generate_async(BAD_PROMPT, params)
            with pytest.raises(InvalidRequestError):
                async for _ in aio.generate_async(BAD_PROMPT, params, streaming=True):
                    pass
            with pytest.raises(InvalidRequestError):
                await aio.generate_async(BAD_PROMPT, params, streaming=True).__anext__()

    asyncio.run(go())
    with pytest.raises(InvalidRequestError):
        llm.generate_async(BAD_PROMPT, params).result()
    with pytest.raises(InvalidRequestError):
        for _ in llm.generate_async(BAD_PROMPT, params, streaming=True):
            pass
    assert llm.generate("still serving", params, use_tqdm=False).outputs[0].token_ids


def test_other_calls_raise_request_error_too(cluster, llm):
    with pytest.raises(InvalidRequestError, match="empty"):
        llm.preprocess("")
    with pytest.raises(InvalidRequestError, match="unknown worker"):
        llm.get_kv_cache_capacity("127.0.0.1:1")
    with pytest.raises(UnsupportedRequestError) as err:  # also a NotImplementedError
        llm.generate("hi", SamplingParams(max_tokens=2, top_p_decay=0.5), use_tqdm=False)
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED and "top_p_decay" in err.value.details

    async def admin(token):
        async with AsyncLLM(cluster.address, auth_token=token) as aio:
            return await aio.collective_rpc("os.system", args=("true",))

    with pytest.raises(RequestError) as err:
        asyncio.run(admin(None))
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED and not isinstance(
        err.value, ValueError
    )
    with pytest.raises(InvalidRequestError, match="not allowed"):
        asyncio.run(admin(TOKEN))


def test_a_closed_client_refuses_calls(cluster):
    # TensorRT-LLM: BaseLLM.generate_async raises RuntimeError("LLM is shutting down") after shutdown().
    llm = LLM(cluster.address)
    llm.shutdown()
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        llm.generate_async("too late", SamplingParams(max_tokens=2))
    with pytest.raises(RuntimeError, match="LLM is shutting down"):
        llm.get_kv_cache_capacity()
