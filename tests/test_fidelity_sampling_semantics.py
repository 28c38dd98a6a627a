"""Issue 9, group 2 (server side): how the server reads sampling params, as TensorRT-LLM does.

TensorRT-LLM, tensorrt_llm/sampling_params.py: SamplingParams.params_imply_greedy_decoding
(greedy iff temperature, top_p and top_k are all None, or top_k == 1, or top_p == 0.0, or
temperature == 0); otherwise it samples, and an unset temperature is the C++ runtime's default
1.0 (the field's docstring). _validate refuses best_of > 1 under greedy decoding unless
TLLM_ALLOW_N_GREEDY_DECODING is set. end_id=-1 is accepted (no check there): no sampled token
equals it, so the sequence never ends by end id (TorchSampler._handle_stop_criteria compares
new_token == py_end_id).
"""

from __future__ import annotations

import grpc
import pytest
from conftest import tiny_split_cluster

from tandem.client import LLM, RequestError, SamplingParams
from tandem.testing.cluster import client_kwargs_for

PROMPTS = [f"prompt number {i} says hello" for i in range(6)]


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with tiny_split_cluster(model_dirs) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    with LLM(cluster.workers[2].address, **cluster.worker_client_kwargs()) as client:
        yield client


def _ids(llm, prompt, **kwargs) -> list[int]:
    return (
        llm.generate(
            prompt, SamplingParams(max_tokens=12, ignore_eos=True, **kwargs), use_tqdm=False
        )
        .outputs[0]
        .token_ids
    )


@pytest.mark.parametrize("knob", [dict(top_k=50), dict(top_p=0.95), dict(top_k=0)])
def test_top_k_or_top_p_without_temperature_samples_at_temperature_one(llm, knob):
    differ = 0
    for i, prompt in enumerate(PROMPTS):
        sampled = _ids(llm, prompt, seed=i, **knob)
        assert sampled == _ids(llm, prompt, seed=i, temperature=1.0, **knob)
        differ += sampled != _ids(llm, prompt)
    assert differ >= len(PROMPTS) // 2, "sampling at temperature 1 is not greedy decoding"


@pytest.mark.parametrize(
    "knob",
    [
        dict(top_p=0.0, temperature=0.8),
        dict(top_k=1, temperature=0.8),
        dict(temperature=0.0, top_k=40),
        dict(min_p=0.2),
    ],
)
def test_params_that_imply_greedy_decode_greedily(llm, knob):
    for i, prompt in enumerate(PROMPTS[:3]):
        assert _ids(llm, prompt, seed=i, **knob) == _ids(llm, prompt)


def test_greedy_with_several_returns_is_refused_by_the_server(cluster, monkeypatch):
    # The client refuses it at construction; with the variable set on the client side only, the
    # request reaches the servers, which refuse it as TensorRT-LLM's _validate does.
    monkeypatch.setenv("TLLM_ALLOW_N_GREEDY_DECODING", "1")
    params = SamplingParams(max_tokens=4, n=2)
    for target in (
        cluster.address,
        cluster.workers[2].address,
    ):  # the router's split, an aggregated worker
        with LLM(target, **client_kwargs_for(target)) as client, pytest.raises(RequestError) as err:
            client.generate("two greedy", params, use_tqdm=False)
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        assert "Greedy decoding in the LLM API does not allow multiple returns" in err.value.details
    with LLM(cluster.address) as client:  # sampling with several returns is fine
        out = client.generate(
            "two samples", SamplingParams(max_tokens=4, n=2, top_k=20, seed=1), use_tqdm=False
        )
        assert len(out.outputs) == 2


def test_end_id_minus_one_never_ends_by_end_id(llm):
    prompt = PROMPTS[0]
    greedy = _ids(llm, prompt)
    end = greedy[3]
    stopped = llm.generate(
        prompt, SamplingParams(max_tokens=12, end_id=end), use_tqdm=False
    ).outputs[0]
    assert stopped.token_ids == greedy[: greedy.index(end) + 1] and stopped.finish_reason == "stop"
    unbounded = llm.generate(
        prompt, SamplingParams(max_tokens=12, end_id=-1), use_tqdm=False
    ).outputs[0]
    assert unbounded.token_ids == greedy and unbounded.finish_reason == "length"
    with pytest.raises(RequestError) as err:
        llm.generate(prompt, SamplingParams(max_tokens=4, end_id=-2), use_tqdm=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
