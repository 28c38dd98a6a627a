"""Issue 9, the disaggregated flow by hand, as TensorRT-LLM users drive it.

TensorRT-LLM's own single-GPU disaggregated test (verify_disaggregated, beside
test_disaggregated_logprobs): send the context phase with request_type="context_only", take the
output's disaggregated_params, set request_type="generation_only", send the same prompt and
sampling params to the generation server; the generation output's token_ids and text equal the
expected (aggregated) ones, the first token included. test_disaggregated_logprobs there: the
context phase fills first_gen_log_probs and the generation output has one logprob per token.
executor/result.py (GenerationResultBase._handle_response) puts the context phase's params at
request level (result.disaggregated_params) and on each output.
"""

from __future__ import annotations

import asyncio
import dataclasses
import random

import pytest
from conftest import assert_all_blocks_free, tiny_split_cluster

from tandem.client import LLM, AsyncLLM, DisaggregatedParams, SamplingParams
from tandem.testing.cluster import client_kwargs_for

NUM_PROMPTS = 20
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with tiny_split_cluster(
        model_dirs, 512
    ) as c:  # 20 unpulled handoffs of one client fit its share
        yield c


def _prompts() -> list[str]:
    rng = random.Random(9)
    words = [
        "alpha",
        "beta",
        "gamma",
        "delta",
        "river",
        "stone",
        "cloud",
        "seven",
        "orange",
        "quiet",
    ]
    return [
        " ".join(rng.choice(words) for _ in range(rng.randrange(2, 12))) for _ in range(NUM_PROMPTS)
    ]


def _params(seeded: bool, i: int) -> SamplingParams:
    if seeded:
        return SamplingParams(
            max_tokens=MAX_TOKENS,
            temperature=0.9,
            top_p=0.95,
            seed=500 + i,
            ignore_eos=True,
            logprobs=1,
        )
    return SamplingParams(max_tokens=MAX_TOKENS)


async def _by_hand(ctx_target: str, gen_target: str, prompt: str, params: SamplingParams):
    """TensorRT-LLM's flow: context_only with max_tokens=1, then generation_only with the same
    prompt and params and the context output's disaggregated_params, request_type changed."""
    async with (
        AsyncLLM(ctx_target, **client_kwargs_for(ctx_target)) as ctx_llm,
        AsyncLLM(gen_target, **client_kwargs_for(gen_target)) as gen_llm,
    ):
        ctx = await ctx_llm.generate_async(
            prompt,
            dataclasses.replace(params, max_tokens=1),
            disaggregated_params=DisaggregatedParams(request_type="context_only"),
        )
        handoff = ctx.disaggregated_params
        handoff.request_type = "generation_only"
        gen = await gen_llm.generate_async(prompt, params, disaggregated_params=handoff)
        return ctx, gen


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
@pytest.mark.parametrize("path", ["router", "workers"])
def test_by_hand_equals_aggregated_first_token_included(cluster, seeded, path):
    prompts = _prompts()
    router, prefill, decode, both = (cluster.address, *(w.address for w in cluster.workers))
    ctx_target, gen_target = (router, router) if path == "router" else (prefill, decode)

    async def go():
        async with AsyncLLM(both, **client_kwargs_for(both)) as aggregated:
            expected = await asyncio.gather(
                *(aggregated.generate_async(p, _params(seeded, i)) for i, p in enumerate(prompts))
            )
        split = await asyncio.gather(
            *(
                _by_hand(ctx_target, gen_target, p, _params(seeded, i))
                for i, p in enumerate(prompts)
            )
        )
        return expected, split

    expected, split = asyncio.run(go())
    for want, (ctx, gen) in zip(expected, split):
        c, g, w = ctx.outputs[0], gen.outputs[0], want.outputs[0]
        # The context phase: one token, handed off, not finished; the handoff at request level too.
        assert len(c.token_ids) == 1 and c.token_ids[0] == w.token_ids[0]
        assert c.finish_reason == "not_finished" and c.stop_reason is None
        assert ctx.disaggregated_params is not None and c.disaggregated_params is not None
        assert ctx.disaggregated_params.opaque_state == c.disaggregated_params.opaque_state
        assert c.disaggregated_params.first_gen_tokens == c.token_ids
        # The generation phase: the aggregated run's tokens and text, the first token included.
        assert (
            g.token_ids == w.token_ids and g.text == w.text and g.finish_reason == w.finish_reason
        )
        assert gen.disaggregated_params is None
        if seeded:  # first_gen_log_probs carried the first token's logprob across
            assert len(c.disaggregated_params.first_gen_log_probs) == 1
            assert len(g.logprobs) == len(g.token_ids)
            assert [sorted(e) for e in g.logprobs] == [sorted(e) for e in w.logprobs]
            assert g.cumulative_logprob == pytest.approx(w.cumulative_logprob, abs=1e-4)
    with LLM(router) as llm:
        assert_all_blocks_free(llm)


def test_generation_that_the_first_token_ends_skips_the_pull(cluster):
    """max_tokens=1 on the generation side too: its output is the context phase's token, finished
    by length, and the prefill's lease is given back at once."""
    router = cluster.address

    async def go():
        return await _by_hand(router, router, "one token only", SamplingParams(max_tokens=1))

    ctx, gen = asyncio.run(go())
    assert ctx.outputs[0].finish_reason == "not_finished"
    assert (
        gen.outputs[0].token_ids == ctx.outputs[0].token_ids
        and gen.outputs[0].finish_reason == "length"
    )
    with LLM(router) as llm:
        assert_all_blocks_free(llm)


def test_streamed_generation_only_starts_with_the_first_token(cluster):
    router, both = cluster.address, cluster.workers[2].address
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)

    async def go():
        async with AsyncLLM(router) as llm:
            ctx = await llm.generate_async(
                "stream the split",
                dataclasses.replace(params, max_tokens=1),
                disaggregated_params=DisaggregatedParams(request_type="context_only"),
            )
            handoff = ctx.disaggregated_params
            handoff.request_type = "generation_only"
            diffs = []
            async for out in llm.generate_async(
                "stream the split", params, disaggregated_params=handoff, streaming=True
            ):
                diffs += out.outputs[0].token_ids_diff
            return out, diffs

    out, diffs = asyncio.run(go())
    with LLM(both, **client_kwargs_for(both)) as aggregated:
        want = aggregated.generate("stream the split", params, use_tqdm=False).outputs[0]
    assert diffs == out.outputs[0].token_ids == want.token_ids and out.outputs[0].text == want.text
