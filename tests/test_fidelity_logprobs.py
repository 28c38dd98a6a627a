"""Issue 9, group 4 (client side): logprobs as TensorRT-LLM presents them, one
{token id: Logprob(logprob, rank)} per generated token, and cumulative_logprob only when
logprobs were asked for."""

from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest
from conftest import tiny_split_cluster

from tandem.client import LLM, AsyncLLM, Logprob, SamplingParams
from tandem.testing.cluster import client_kwargs_for


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """The router splits every request over the prefill and the decode; workers[2] is aggregated."""
    with tiny_split_cluster(model_dirs) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    with LLM(cluster.address) as client:
        yield client


def test_logprob_is_tensorrt_llms_type():
    # TensorRT-LLM: tensorrt_llm/executor/result.py, @dataclass(slots=True) class Logprob: logprob, rank=None.
    assert [f.name for f in dataclasses.fields(Logprob)] == ["logprob", "rank"]
    assert Logprob(-0.5) == Logprob(logprob=-0.5, rank=None)


def test_no_logprobs_unless_asked(llm):
    # TensorRT-LLM: CompletionOutput.cumulative_logprob stays None and logprobs [] when the
    # response carries no log probs (GenerationResultBase._handle_sequence sets them only then).
    out = llm.generate(
        "plain", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
    ).outputs[0]
    assert out.cumulative_logprob is None and out.logprobs == [] and out.prompt_logprobs == []


def test_greedy_top_logprobs_are_ranked(llm, model_dirs, oracle):
    # TensorRT-LLM (PyTorch sampler, handle_logprobs): the top-k tokens of each position as
    # {token: Logprob(logprob, rank=position + 1)}, most likely first.
    k = 3
    prompt = llm.tokenizer.encode("ranked logprobs")
    out = llm.generate(
        prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=k), use_tqdm=False
    ).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = oracle(model_dirs["llama"])
    with ref.torch.no_grad():
        logits = ref.model(ref.torch.tensor([prompt + out.token_ids[:-1]])).logits[
            0, len(prompt) - 1 :
        ]
    expected = ref.torch.log_softmax(logits.float(), dim=-1)
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        assert all(isinstance(v, Logprob) for v in entry.values())
        assert len(entry) == k and token in entry  # greedy: the sampled token is among the top k
        assert entry[token].rank == 1
        ranks = [v.rank for v in entry.values()]
        assert ranks == [1, 2, 3], "most likely first, ranked 1..k"
        values = [v.logprob for v in entry.values()]
        assert values == sorted(values, reverse=True)
        for t, v in entry.items():  # the model's own log-probabilities (transformers as the oracle)
            assert v.logprob == pytest.approx(expected[position, t].item(), abs=1e-3)
    assert out.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)), abs=1e-4
    )


def _oracle_logprobs(oracle, model_dir, ids: list[int]):
    ref = oracle(model_dir)
    with ref.torch.no_grad():
        logits = ref.model(ref.torch.tensor([ids])).logits[0]
    return ref.torch.log_softmax(logits.float(), dim=-1)


def _rank_range(row, value: float, tol: float = 1e-4) -> range:
    """The ranks value may have in row, allowing for float differences with transformers."""
    return range(int((row > value + tol).sum()) + 1, int((row > value - tol).sum()) + 2)


def test_a_sampled_token_outside_the_top_k_has_its_vocabulary_rank(llm, model_dirs, oracle):
    # TensorRT-LLM adds the sampled token to the top-k when it is not among them, with
    # rank = 1 + the number of tokens more likely (executor/result.py, compute_logprobs).
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=8.0, seed=3, logprobs=1)
    prompt = llm.tokenizer.encode("hot sampling")
    out = llm.generate(prompt, params, use_tqdm=False).outputs[0]
    expected = _oracle_logprobs(oracle, model_dirs["llama"], prompt + out.token_ids[:-1])[
        len(prompt) - 1 :
    ]
    outside = 0
    for position, (token, entry) in enumerate(zip(out.token_ids, out.logprobs)):
        top = [t for t, v in entry.items() if v.rank == 1]
        assert len(top) == 1
        assert entry[token].rank in _rank_range(
            expected[position], expected[position, token].item()
        )
        if token != top[0]:
            outside += 1
            assert len(entry) == 2 and entry[token].rank > 1
            assert entry[token].logprob <= entry[top[0]].logprob
    assert outside > 0, "a temperature of 8 samples below the top token somewhere in 30 steps"
    assert math.isfinite(out.cumulative_logprob)


@pytest.mark.parametrize("target", ["split", "aggregated"])
def test_prompt_logprobs_are_the_context_logits_top_k(cluster, model_dirs, oracle, target):
    # TensorRT-LLM: prompt_logprobs=k gives, for every prompt position, the top k of the context
    # logits there with ranks 1..k (executor/result.py, compute_logprobs, tokens=None), one
    # list shared by the outputs (CompletionOutput.prompt_logprobs).
    k = 3
    address = cluster.address if target == "split" else cluster.workers[2].address
    with LLM(address, **client_kwargs_for(address)) as client:
        prompt = client.tokenizer.encode("the prompt has logprobs too, position by position")
        params = SamplingParams(max_tokens=3, ignore_eos=True, prompt_logprobs=k)
        first = client.generate(prompt, params, use_tqdm=False)
        again = client.generate(
            prompt, params, use_tqdm=False
        )  # its blocks are cached now: still all of it
    expected = _oracle_logprobs(oracle, model_dirs["llama"], prompt)
    for result in (first, again):
        got = result.outputs[0].prompt_logprobs
        assert len(got) == len(prompt)
        for position, entry in enumerate(got):
            assert [v.rank for v in entry.values()] == list(range(1, k + 1))
            values, ids = expected[position].topk(k)
            assert list(entry) == ids.tolist()
            assert [v.logprob for v in entry.values()] == pytest.approx(values.tolist(), abs=1e-4)
    assert first.outputs[0].token_ids == again.outputs[0].token_ids


def test_streamed_logprob_diffs_add_up(cluster):
    async def go():
        async with AsyncLLM(cluster.address) as aio:
            diffs = []
            async for out in aio.generate_async(
                "stream logprobs",
                SamplingParams(max_tokens=8, ignore_eos=True, logprobs=2),
                streaming=True,
            ):
                diffs += out.outputs[0].logprobs_diff
            return out, diffs

    out, diffs = asyncio.run(go())
    assert diffs == out.outputs[0].logprobs and len(diffs) == 8
