"""Router + aggregated worker as real processes; the client over real sockets;
transformers as the oracle for greedy tokens."""

from __future__ import annotations

import asyncio
import random

import pytest
from conftest import assert_all_blocks_free

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.testing.cluster import LocalCluster

ENGINE_ARGS = ["--num-blocks", "96", "--block-size", "8", "--max-num-batched-tokens", "96"]


@pytest.fixture(scope="module", params=["llama", "qwen2", "qwen3"])
def served(request, model_dirs):
    model_dir = model_dirs[request.param]
    with LocalCluster(
        roles=["both"], engine_args=["--model", str(model_dir), *ENGINE_ARGS]
    ) as cluster:
        llm = LLM(cluster.address)
        yield model_dir, cluster, llm
        llm.close()


@pytest.fixture(autouse=True)
def no_leaked_blocks(served):
    yield
    assert_all_blocks_free(served[2])


def _random_prompts(vocab_size: int, num: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [
        [1] + [rng.randrange(4, vocab_size) for _ in range(rng.randrange(3, 60))]
        for _ in range(num)
    ]


def test_concurrent_greedy_matches_transformers(served, oracle):
    model_dir, cluster, llm = served
    ref = oracle(model_dir)
    prompts = _random_prompts(ref.model.config.vocab_size, 8, seed=7)
    texts = ["Hello, world", "The capital of France is", "1 2 3 4 5"]
    params = SamplingParams(max_tokens=24)

    async def run_all():
        aio = AsyncLLM(cluster.address)
        await aio.setup_async()
        try:
            outs = await asyncio.gather(*(aio.generate_async(p, params) for p in prompts + texts))
        finally:
            aio.close()
        return outs

    outs = asyncio.run(run_all())
    for out in outs:
        expected = ref.greedy(out.prompt_token_ids, 24)
        assert out.outputs[0].token_ids == expected, f"prompt {out.prompt_token_ids}"
        assert out.outputs[0].finish_reason == ("stop" if expected[-1] == ref.eos else "length")
    for text, out in zip(texts, outs[len(prompts) :]):
        assert out.prompt == text
        if type(ref.tokenizer).__name__ == "PreTrainedTokenizerFast":
            # transformers loads the tiny Qwen fixtures with its Qwen2Tokenizer, whose digit
            # splitting is not in their tokenizer.json; the Llama fixture uses tokenizer.json as is.
            assert out.prompt_token_ids == ref.tokenizer(text)["input_ids"]
        assert out.outputs[0].text == ref.tokenizer.decode(
            out.outputs[0].token_ids, skip_special_tokens=True
        )
