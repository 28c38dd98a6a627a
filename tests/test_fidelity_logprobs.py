"""Issue 9, group 4 (client side): logprobs as TensorRT-LLM presents them, one
{token id: Logprob(logprob, rank)} per generated token, and cumulative_logprob only when
logprobs were asked for."""
from __future__ import annotations

import asyncio
import dataclasses
import math

import pytest

from tandem.testing.cluster import LocalCluster
from tandem.client import LLM, AsyncLLM, Logprob, SamplingParams


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(roles=["both"], engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"]) as c:
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
    out = llm.generate("plain", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False).outputs[0]
    assert out.cumulative_logprob is None and out.logprobs == [] and out.prompt_logprobs == []


def test_greedy_top_logprobs_are_ranked(llm, model_dirs, oracle):
    # TensorRT-LLM (PyTorch sampler, handle_logprobs): the top-k tokens of each position as
    # {token: Logprob(logprob, rank=position + 1)}, most likely first.
    k = 3
    prompt = llm.tokenizer.encode("ranked logprobs")
    out = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True, logprobs=k), use_tqdm=False).outputs[0]
    assert len(out.logprobs) == len(out.token_ids) == 6
    ref = oracle(model_dirs["llama"])
    with ref.torch.no_grad():
        logits = ref.model(ref.torch.tensor([prompt + out.token_ids[:-1]])).logits[0, len(prompt) - 1:]
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
    assert out.cumulative_logprob == pytest.approx(sum(e[t].logprob for t, e in zip(out.token_ids, out.logprobs)),
                                                   abs=1e-4)


def test_a_sampled_token_outside_the_top_k_has_no_known_rank(llm):
    # TensorRT-LLM adds the sampled token to the top-k when it is not among them
    # (result.py, compute_logprobs); its exact rank is the server's to send: without it, None.
    params = SamplingParams(max_tokens=30, ignore_eos=True, temperature=8.0, seed=3, logprobs=1)
    out = llm.generate("hot sampling", params, use_tqdm=False).outputs[0]
    outside = 0
    for token, entry in zip(out.token_ids, out.logprobs):
        top = [t for t, v in entry.items() if v.rank == 1]
        assert len(top) == 1
        if token != top[0]:
            outside += 1
            assert len(entry) == 2 and (entry[token].rank is None or entry[token].rank > 1)
            assert entry[token].logprob <= entry[top[0]].logprob
    assert outside > 0, "a temperature of 8 samples below the top token somewhere in 30 steps"
    assert math.isfinite(out.cumulative_logprob)


def test_streamed_logprob_diffs_add_up(cluster):
    async def go():
        async with AsyncLLM(cluster.address) as aio:
            diffs = []
            async for out in aio.generate_async("stream logprobs", SamplingParams(max_tokens=8, ignore_eos=True,
                                                                                   logprobs=2), streaming=True):
                diffs += out.outputs[0].logprobs_diff
            return out, diffs
    out, diffs = asyncio.run(go())
    assert diffs == out.outputs[0].logprobs and len(diffs) == 8
