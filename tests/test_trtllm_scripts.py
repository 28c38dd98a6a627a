"""What TensorRT-LLM's own LLM-API scripts do that tandem's client must take as they are (issue
34): LLM(model=...), per-prompt lists indexed by position, outputs there before the first
response, one cancelled output for a request aborted before it produced anything."""

from __future__ import annotations

import asyncio

import pytest

from tandem.client import LLM, AsyncLLM, SamplingParams
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
        ],
    ) as c:
        yield c


def test_model_is_the_routers_address(cluster):
    with LLM(model=cluster.address) as llm:
        assert llm.target == cluster.address
        assert llm.generate("hi", SamplingParams(max_tokens=2), use_tqdm=False).outputs[0].token_ids
    with pytest.raises(TypeError, match="tandem up --model /models/llama"):
        LLM(model="/models/llama")


def test_a_params_list_is_indexed_by_prompt_position(cluster):
    params = [SamplingParams(max_tokens=n, ignore_eos=True) for n in (2, 3, 4)]
    with LLM(cluster.address) as llm:
        outs = llm.generate(["a", "b"], params, use_tqdm=False)
        assert [len(o.outputs[0].token_ids) for o in outs] == [2, 3]
        with pytest.raises(ValueError, match="1 entries for 2 prompts"):
            llm.generate(["a", "b"], params[:1], use_tqdm=False)


def test_outputs_exist_before_the_first_response(cluster):
    with LLM(cluster.address) as llm:
        result = llm.generate_async("early", SamplingParams(max_tokens=4, n=2, temperature=0.8))
        assert [o.index for o in result.outputs] == [0, 1]
        assert all(o.token_ids == [] and o.finish_reason is None for o in result.outputs)
        done = result.result()
        assert all(len(o.token_ids) == 4 or o.finish_reason == "stop" for o in done.outputs)


def test_an_early_abort_yields_one_cancelled_output(cluster):
    async def run():
        async with AsyncLLM(cluster.address) as llm:
            result = llm.generate_async(
                "abort me", SamplingParams(max_tokens=2000, ignore_eos=True), streaming=True
            )
            result.abort()
            return [(o.outputs[0].finish_reason, result.finished) async for o in result]

    seen = asyncio.run(run())
    assert seen and seen[-1] == ("cancelled", True)
