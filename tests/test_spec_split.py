"""Speculative decoding across the split, as real processes (router, prefill, decode over
loopback, KV pulled with NIXL): the prefill's drafts cross in DisaggregatedParams.draft_tokens,
the decode verifies them at its first step, and the client gets plain decoding's tokens whatever
the drafts say. The engine-level cases are in test_spec_handoff.py."""

from __future__ import annotations

import dataclasses
import random

import grpc
import pytest
from conftest import assert_all_blocks_free
from test_spec_handoff import copy_heavy_prompt

from tandem.client import LLM, DisaggregatedParams, SamplingParams
from tandem.client.errors import InvalidRequestError
from tandem.testing.cluster import LocalCluster, client_kwargs_for

SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'
ENGINE_ARGS = ["--num-blocks", "96", "--block-size", "4"]


@pytest.fixture(scope="module")
def ref(model_dirs, oracle):
    return oracle(model_dirs["llama"])


@pytest.fixture(scope="module")
def copy_heavy(ref):
    return copy_heavy_prompt(ref.greedy)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """A prefill and a decode that both speculate (the router splits every request between
    them), and an aggregated worker that does not: the plain path to compare with."""
    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=["--model", str(model_dirs["llama"]), *ENGINE_ARGS],
        worker_args={
            "prefill-1": ["--speculative-config", SPEC],
            "decode-1": ["--speculative-config", SPEC],
        },
    ) as c:
        yield c


def _context(llm: LLM, prompt: list[int], params: SamplingParams) -> DisaggregatedParams:
    """TensorRT-LLM's flow by hand: the context phase (max_tokens=1) and its handoff."""
    ctx = llm.generate(
        prompt,
        dataclasses.replace(params, max_tokens=1),
        disaggregated_params=DisaggregatedParams(request_type="context_only"),
    )
    handoff = ctx.outputs[0].disaggregated_params
    handoff.request_type = "generation_only"
    return handoff


def test_a_speculating_split_gives_the_plain_aggregated_tokens(cluster, ref, copy_heavy):
    """Through the router's own split: the tokens of the plain aggregated worker (and of
    transformers), the copy-heavy prompt's with drafts accepted; a prompt with nothing to copy
    the same."""
    prompt, want = copy_heavy
    rng = random.Random(3)
    prompts = [prompt, [1] + [rng.randrange(4, 380) for _ in range(30)]]
    params = SamplingParams(max_tokens=24, ignore_eos=True, return_perf_metrics=True)
    with (
        LLM(cluster.address) as llm,
        LLM(cluster.workers[2].address, **client_kwargs_for(cluster.workers[2].address)) as plain,
    ):
        split = llm.generate(prompts, params, use_tqdm=False)
        aggregated = plain.generate(prompts, params, use_tqdm=False)
        for p, s, a in zip(prompts, split, aggregated):
            assert s.outputs[0].token_ids == a.outputs[0].token_ids == ref.greedy(p, 24)
            assert s.outputs[0].request_perf_metrics.kv_handoff.outcome == "pulled"
        spec = split[0].outputs[0].request_perf_metrics.speculative_decoding
        assert spec.total_accepted_draft_tokens > 0
        assert (
            aggregated[0].outputs[0].request_perf_metrics.speculative_decoding.total_draft_tokens
            == 0
        )
        assert_all_blocks_free(llm)


def test_seeded_sampling_through_a_speculating_split_is_the_plain_aggregated_draw(
    cluster, copy_heavy
):
    """Seeded sampled requests stay reproducible: the drafts verified (the prefill's at the first
    step, the decode's after) keep the target's own seeded draws, so the split gives the plain
    aggregated worker's tokens and logprobs for each seed."""
    prompt, _ = copy_heavy
    both = cluster.workers[2].address
    params = [
        SamplingParams(
            max_tokens=20,
            temperature=0.7,
            top_p=0.9,
            seed=40 + i,
            ignore_eos=True,
            logprobs=1,
            return_perf_metrics=True,
        )
        for i in range(3)
    ]
    drafted = 0
    with LLM(cluster.address) as llm, LLM(both, **client_kwargs_for(both)) as plain:
        for p in params:
            split = llm.generate(prompt, p).outputs[0]
            want = plain.generate(prompt, p).outputs[0]
            assert split.token_ids == want.token_ids
            assert split.cumulative_logprob == pytest.approx(want.cumulative_logprob, abs=1e-3)
            drafted += split.request_perf_metrics.speculative_decoding.total_draft_tokens
        assert drafted > 0
        assert_all_blocks_free(llm)


def test_the_decodes_first_step_verifies_the_prefills_drafts(cluster, copy_heavy):
    """The context phase's handoff carries the prefill's drafts (what followed the passage the
    first time); a generation_only of max_tokens 5 with them draws its 4 tokens in one step: the
    first token's row and the 3 drafts it has room for, all accepted."""
    prompt, want = copy_heavy
    params = SamplingParams(max_tokens=5, ignore_eos=True, return_perf_metrics=True)
    with LLM(cluster.address) as llm:
        handoff = _context(llm, prompt, params)
        assert handoff.first_gen_tokens == want[:1]
        assert handoff.draft_tokens == prompt[9:13]
        out = llm.generate(prompt, params, disaggregated_params=handoff).outputs[0]
        assert out.token_ids == want[:5]
        perf = out.request_perf_metrics
        assert perf.kv_handoff.outcome == "pulled"
        spec = perf.speculative_decoding
        assert spec.total_draft_tokens == spec.total_accepted_draft_tokens == 3
        assert perf.first_iter == perf.last_iter  # one decode step drew all four
        assert_all_blocks_free(llm)


def test_adversarial_draft_tokens_on_generation_only_leave_greedy_output_unchanged(
    cluster, copy_heavy, ref
):
    """A client's own generation_only with drafts of its choosing (random ids, a wrong
    continuation, a right one gone wrong half-way): the decode verifies them and emits plain
    greedy decoding's tokens, nothing the drafts say."""
    prompt, want = copy_heavy
    vocab = ref.model.config.vocab_size
    rng = random.Random(11)
    params = SamplingParams(max_tokens=16, ignore_eos=True, return_perf_metrics=True)
    candidates = [
        [rng.randrange(vocab) for _ in range(4)],
        [(t + 1) % vocab for t in want[1:5]],
        want[1:3] + [(want[3] + 7) % vocab, want[4]],
        [want[0]] * 2,
    ]
    drafted = 0
    with LLM(cluster.address) as llm:
        for drafts in candidates:
            handoff = _context(llm, prompt, params)
            handoff.draft_tokens = drafts
            out = llm.generate(prompt, params, disaggregated_params=handoff).outputs[0]
            assert out.token_ids == want[:16], drafts
            drafted += out.request_perf_metrics.speculative_decoding.total_draft_tokens
        assert drafted > 0
        assert_all_blocks_free(llm)


@pytest.mark.parametrize(
    "drafts, message",
    [([5, 10**6], "out of vocabulary"), ([-3], "out of vocabulary"), ([5] * 17, "at most 16")],
)
def test_bad_draft_tokens_are_refused_before_the_handoff_is_used(
    cluster, copy_heavy, drafts, message
):
    """INVALID_ARGUMENT, naming the limit; the handoff is still good for a request with none."""
    prompt, want = copy_heavy
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    with LLM(cluster.address) as llm:
        handoff = _context(llm, prompt, params)
        bad = dataclasses.replace(handoff, draft_tokens=drafts)
        with pytest.raises(InvalidRequestError, match=message) as error:
            llm.generate(prompt, params, disaggregated_params=bad)
        assert error.value.code == grpc.StatusCode.INVALID_ARGUMENT
        good = dataclasses.replace(handoff, draft_tokens=None)
        assert (
            llm.generate(prompt, params, disaggregated_params=good).outputs[0].token_ids == want[:6]
        )
        assert_all_blocks_free(llm)


def test_a_decode_without_speculation_ignores_the_prefills_drafts(model_dirs, copy_heavy):
    """A speculating prefill beside a plain decode: the handoff carries drafts, the decode never
    reads them (junk ones included, however many) and decodes as it always did."""
    prompt, want = copy_heavy
    params = SamplingParams(max_tokens=12, ignore_eos=True, return_perf_metrics=True)
    with (
        LocalCluster(
            roles=["prefill", "decode"],
            engine_args=["--model", str(model_dirs["llama"]), *ENGINE_ARGS],
            worker_args={"prefill-1": ["--speculative-config", SPEC]},
        ) as c,
        LLM(c.address) as llm,
    ):
        out = llm.generate(prompt, params).outputs[0]
        assert out.token_ids == want[:12]
        assert out.request_perf_metrics.speculative_decoding.total_draft_tokens == 0
        handoff = _context(llm, prompt, params)
        assert handoff.draft_tokens == prompt[9:13]
        handoff.draft_tokens = [10**6] * 100
        out = llm.generate(prompt, params, disaggregated_params=handoff).outputs[0]
        assert out.token_ids == want[:12]
        assert out.request_perf_metrics.speculative_decoding.total_draft_tokens == 0
        assert_all_blocks_free(llm)


def test_drafts_cross_engine_processes_both_ways(model_dirs, copy_heavy):
    """Prefill and decode with their cores in processes of their own (--engine-process): the
    drafts come out of the prefill's core on its output and go into the decode's on the request,
    and the decode's first step still draws the first token's row and 3 accepted drafts."""
    prompt, want = copy_heavy
    params = SamplingParams(max_tokens=5, ignore_eos=True, return_perf_metrics=True)
    with (
        LocalCluster(
            roles=["prefill", "decode"],
            engine_args=[
                "--model",
                str(model_dirs["llama"]),
                *ENGINE_ARGS,
                "--engine-process",
                "--speculative-config",
                SPEC,
            ],
        ) as c,
        LLM(c.address) as llm,
    ):
        handoff = _context(llm, prompt, params)
        assert handoff.draft_tokens == prompt[9:13]
        out = llm.generate(prompt, params, disaggregated_params=handoff).outputs[0]
        assert out.token_ids == want[:5]
        perf = out.request_perf_metrics
        assert perf.speculative_decoding.total_accepted_draft_tokens == 3
        assert perf.first_iter == perf.last_iter
        assert_all_blocks_free(llm)


COPY_TEXT = (
    "Copy the sentence exactly.\n"
    "Sentence: The quick brown fox jumps over the lazy dog near the quiet river bank.\n"
    "Copy: The quick brown fox"
)


def test_smollm2_split_with_speculation_gives_the_plain_aggregated_tokens():
    """The default model (SmolLM2-135M-Instruct) asked to copy a sentence: the speculating split
    gives the plain aggregated worker's greedy tokens, the prefill's drafts (the sentence's next
    words) accepted whole at the decode's first step."""
    from tandem.engine.checkpoints import default_model_dir

    default_model_dir()  # converted once here rather than in three workers at once
    params = SamplingParams(max_tokens=16, return_perf_metrics=True)
    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=["--num-blocks", "64"],
        worker_args={
            "prefill-1": ["--speculative-config", SPEC],
            "decode-1": ["--speculative-config", SPEC],
        },
    ) as c:
        both = c.workers[2].address
        with LLM(c.address) as llm, LLM(both, **client_kwargs_for(both)) as plain:
            want = plain.generate(COPY_TEXT, params).outputs[0]
            split = llm.generate(COPY_TEXT, params).outputs[0]
            assert split.token_ids == want.token_ids and split.text == want.text
            assert want.text.startswith(" jumps over the lazy dog")
            assert split.request_perf_metrics.speculative_decoding.total_accepted_draft_tokens > 0
            first = dataclasses.replace(params, max_tokens=5)
            handoff = _context(llm, COPY_TEXT, first)
            assert handoff.first_gen_tokens == want.token_ids[:1]
            assert handoff.draft_tokens == want.token_ids[1:5]
            out = llm.generate(COPY_TEXT, first, disaggregated_params=handoff).outputs[0]
            assert out.token_ids == want.token_ids[:5]
            perf = out.request_perf_metrics
            assert perf.speculative_decoding.total_accepted_draft_tokens == 3
            assert perf.first_iter == perf.last_iter
            assert_all_blocks_free(llm)
