"""Speculative decoding across the split (engine/llm_engine.py, prefill/context.py,
decode/generation.py): a prefill that speculates proposes drafts after the first token and hands
them over in DisaggregatedParams.draft_tokens; a decode that speculates verifies them at its first
step, in the same forward as that token. Outputs stay those of plain decoding whatever the drafts
(verification keeps the target's own draws), a decode that does not speculate ignores them, and
bad ones are refused before anything is reserved."""

from __future__ import annotations

import json
import random

import pytest
from conftest import run_to_completion

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence import Phase

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}


def copy_heavy_prompt(greedy) -> tuple[list[int], list[int]]:
    """(prompt, its greedy continuation) where the prompt holds a passage and its greedy
    continuation, then the passage again: after its first token (the continuation's second) prompt
    lookup drafts what followed it the first time, and the tiny model's greedy tokens go on as
    they did there for a few tokens. greedy(prompt, n): a plain greedy continuation."""
    rng = random.Random(0)
    passage = [1] + [rng.randrange(4, 380) for _ in range(6)]
    continuation = greedy(passage, 12)
    prompt = passage + continuation + passage + continuation[:1]
    return prompt, greedy(prompt, 24)


@pytest.fixture(scope="module")
def copy_heavy(model_dirs):
    plain = _engine(model_dirs["llama"], None)

    def greedy(prompt: list[int], n: int) -> list[int]:
        options = SamplingOptions(max_tokens=n, ignore_eos=True)
        return run_to_completion(plain, {"p": prompt}, options)["p"]

    prompt, want = copy_heavy_prompt(greedy)
    return prompt, want


def _engine(model_dir, spec: dict | None, hands_off: bool = False, **kwargs) -> LLMEngine:
    config = dict(block_size=4, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=64)
    config.update(kwargs)
    return LLMEngine(
        EngineConfig(str(model_dir), speculative_config=json.dumps(spec) if spec else "", **config),
        hands_off=hands_off,
    )


def _context(prefill: LLMEngine, rid: str, prompt: list[int], options: SamplingOptions):
    """The context phase's one output (its first token, kept blocks and drafts)."""
    prefill.add_request(rid, prompt, options, phase=Phase.CONTEXT_ONLY)
    outputs = []
    while prefill.num_unfinished:
        outputs += prefill.step()
    (out,) = outputs
    assert out.kept_block_ids
    return out


def _generation(decode, prefill, rid, prompt, options, ctx_out, drafts, early=False) -> list:
    """The generation phase on decode from ctx_out's KV (copied from prefill's pool, as the NIXL
    READ would), handed `drafts`: its outputs, step by step. early: the blocks reserved before
    the handoff (an announced request's), its first tokens and drafts given when it comes."""
    if early:  # the arrival brings the first tokens and drafts
        plan = decode.add_remote_kv_request(rid, prompt, [], options, ahead_of_handoff=True)
        assert decode.num_waiting_for_remote_kv == 1
    else:
        plan = decode.add_remote_kv_request(
            rid, prompt, ctx_out.new_token_ids, options, draft_token_ids=drafts
        )
    num_prompt_blocks = -(-len(prompt) // prefill.config.block_size)
    source = ctx_out.kept_block_ids[plan.num_cached_blocks : num_prompt_blocks]
    decode.runner.kv_cache[plan.block_ids] = prefill.runner.kv_cache[source]
    prefill.free_blocks(ctx_out.kept_block_ids)
    if early:
        decode.remote_kv_arrived(rid, first_token_ids=ctx_out.new_token_ids, draft_token_ids=drafts)
    else:
        decode.remote_kv_arrived(rid)
    steps = []
    while decode.num_unfinished:
        steps.append([out for out in decode.step() if out.request_id == rid])
    return steps


def _tokens(ctx_out, steps) -> list[int]:
    return ctx_out.new_token_ids + [t for step in steps for out in step for t in out.new_token_ids]


@pytest.mark.parametrize("max_tokens", [1, 40])
def test_a_speculating_prefill_hands_over_its_drafts_after_the_first_token(
    model_dirs, copy_heavy, max_tokens
):
    """Prompt lookup over the prompt and the first token: what followed the passage before, as
    many as num_speculative_tokens, whatever the context phase's own max_tokens (TensorRT-LLM's
    flow sends 1). A prefill without speculation hands none."""
    model = model_dirs["llama"]
    prompt, want = copy_heavy
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    out = _context(_engine(model, NGRAM, hands_off=True), "a", prompt, options)
    assert out.new_token_ids == want[:1]
    # The passage (7 tokens) and its continuation's first two came before: then prompt[9:13].
    assert out.draft_token_ids == prompt[9:13]
    plain = _context(_engine(model, None, hands_off=True), "a", prompt, options)
    assert plain.draft_token_ids == []


@pytest.mark.parametrize("early", [False, True])
def test_the_decode_verifies_handed_drafts_at_its_first_step(model_dirs, copy_heavy, early):
    """The first decode step computes the first token and the 4 drafts in one forward and keeps
    the draws up to the first rejected draft: the split's tokens are the aggregated plain
    engine's, several of them from that one step. The same when the decode reserved the blocks
    before the handoff came (early: an announced request's), taking the first token and the
    drafts with it."""
    model = model_dirs["llama"]
    prompt, want = copy_heavy
    options = SamplingOptions(max_tokens=24, ignore_eos=True, return_perf_metrics=True)
    prefill = _engine(model, NGRAM, hands_off=True)
    ctx_out = _context(prefill, "a", prompt, options)
    decode = _engine(model, NGRAM)
    steps = _generation(
        decode, prefill, "a", prompt, options, ctx_out, ctx_out.draft_token_ids, early
    )
    assert _tokens(ctx_out, steps) == want
    (first,) = steps[0]
    accepted = first.perf.num_accepted_draft_tokens
    assert first.perf.num_draft_tokens == 4 and accepted >= 2
    assert first.new_token_ids == want[1 : 2 + accepted]
    c = decode.counters  # counted as the decode's own drafts are (stats, Prometheus)
    assert c.num_drafted_steps >= 1 and c.num_draft_tokens >= 4
    assert c.num_accepted_draft_tokens >= accepted
    assert decode.block_manager.num_free_blocks == 96
    assert prefill.block_manager.num_free_blocks == 96


def test_handed_drafts_are_cut_to_the_decodes_room(model_dirs, copy_heavy):
    """More drafts than the decode verifies (a prefill configured with more), or than the
    request's max_tokens leaves room for: the first ones are verified, the rest dropped."""
    model = model_dirs["llama"]
    prompt, want = copy_heavy
    prefill = _engine(model, {**NGRAM, "num_speculative_tokens": 8}, hands_off=True)
    options = SamplingOptions(max_tokens=24, ignore_eos=True, return_perf_metrics=True)
    ctx_out = _context(prefill, "a", prompt, options)
    assert len(ctx_out.draft_token_ids) == 8
    decode = _engine(model, {**NGRAM, "num_speculative_tokens": 2})
    steps = _generation(decode, prefill, "a", prompt, options, ctx_out, ctx_out.draft_token_ids)
    assert _tokens(ctx_out, steps) == want
    assert steps[0][0].perf.num_draft_tokens == 2 and steps[0][0].new_token_ids == want[1:4]
    short = SamplingOptions(max_tokens=3, ignore_eos=True, return_perf_metrics=True)
    ctx_out = _context(prefill, "b", prompt, short)
    steps = _generation(decode, prefill, "b", prompt, short, ctx_out, ctx_out.draft_token_ids)
    assert _tokens(ctx_out, steps) == want[:3]
    assert steps[0][0].perf.num_draft_tokens == 1  # the first token, 1 draft, 1 draw: max_tokens


def _adversarial(rng: random.Random, vocab_size: int, k: int) -> list[int]:
    return [rng.randrange(vocab_size) for _ in range(rng.randrange(1, k + 1))]


@pytest.mark.parametrize("seeded", [False, True], ids=["greedy", "seeded"])
def test_adversarial_drafts_never_change_the_output(model_dirs, copy_heavy, seeded):
    """Drafts from nowhere (random ids, a wrong continuation, the right one with a wrong tail):
    the decode emits exactly plain decoding's tokens, greedy or seeded."""
    model = model_dirs["llama"]
    prefill = _engine(model, None, hands_off=True)
    decode = _engine(model, NGRAM)
    plain = _engine(model, None)
    vocab = decode.model_config.vocab_size
    rng = random.Random(7)
    prompts = [copy_heavy[0], [1] + [rng.randrange(4, vocab) for _ in range(20)]]
    for i, prompt in enumerate(prompts):
        options = SamplingOptions(
            max_tokens=16,
            ignore_eos=True,
            **({"temperature": 0.9, "top_p": 0.95, "seed": 100 + i} if seeded else {}),
        )
        want = run_to_completion(plain, {f"p{i}": prompt}, options)[f"p{i}"]
        candidates = [
            _adversarial(rng, vocab, 4),
            [(t + 1) % vocab for t in want[1:5]],
            want[1:3] + [(want[3] + 1) % vocab, want[4]],
            want[1:5],
        ]
        for j, drafts in enumerate(candidates):
            rid = f"p{i}-{j}"
            ctx_out = _context(prefill, rid, prompt, options)
            steps = _generation(decode, prefill, rid, prompt, options, ctx_out, drafts)
            assert _tokens(ctx_out, steps) == want, (rid, drafts)
    assert decode.counters.num_draft_tokens > decode.counters.num_accepted_draft_tokens > 0
    assert decode.block_manager.num_free_blocks == 96


def test_bad_drafts_are_refused_by_a_speculating_decode_and_ignored_by_a_plain_one(
    model_dirs, copy_heavy
):
    """Ids outside the vocabulary, or more drafts than any worker proposes: refused (ValueError,
    INVALID_ARGUMENT at the worker) before a block is reserved. A decode that does not speculate
    never reads them: its tokens are plain decoding's."""
    model = model_dirs["llama"]
    prompt, want = copy_heavy
    options = SamplingOptions(max_tokens=8, ignore_eos=True)
    decode = _engine(model, NGRAM)
    vocab = decode.model_config.vocab_size
    for drafts, message in (([5, vocab], "out of vocabulary"), ([-1], "out of vocabulary")):
        with pytest.raises(ValueError, match=message):
            decode.add_remote_kv_request("x", prompt, want[:1], options, draft_token_ids=drafts)
    with pytest.raises(ValueError, match="at most 16"):
        decode.add_remote_kv_request("x", prompt, want[:1], options, draft_token_ids=[5] * 17)
    assert decode.block_manager.num_free_blocks == 96 and not decode.has_request("x")
    prefill = _engine(model, None, hands_off=True)
    plain_decode = _engine(model, None)
    ctx_out = _context(prefill, "a", prompt, options)
    junk = [vocab + 5] * 100
    steps = _generation(plain_decode, prefill, "a", prompt, options, ctx_out, junk)
    assert _tokens(ctx_out, steps) == want[:8]
    assert plain_decode.counters.num_draft_tokens == 0


def test_a_draft_model_prefill_hands_over_what_the_decode_accepts_whole(model_dirs):
    """The target as its own draft model: the prefill's drafts are the greedy continuation, and
    the decode (which rebuilds the draft's KV itself) accepts all of them at its first step."""
    model = model_dirs["llama"]
    spec = {"method": "draft_model", "model": str(model), "num_speculative_tokens": 3}
    prompt = [1, 40, 41, 42, 43, 44]
    options = SamplingOptions(max_tokens=12, ignore_eos=True, return_perf_metrics=True)
    prefill = _engine(model, spec, hands_off=True)
    ctx_out = _context(prefill, "a", prompt, options)
    plain = run_to_completion(_engine(model, None), {"a": prompt}, options)["a"]
    assert ctx_out.draft_token_ids == plain[1:4]
    decode = _engine(model, spec)
    steps = _generation(decode, prefill, "a", prompt, options, ctx_out, ctx_out.draft_token_ids)
    assert _tokens(ctx_out, steps) == plain
    assert steps[0][0].new_token_ids == plain[1:5]
    assert steps[0][0].perf.num_accepted_draft_tokens == 3
