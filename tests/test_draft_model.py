"""Speculative decoding with a draft model (engine/draft_model.py): the drafts of a second
checkpoint with the target's vocabulary, verified by the target, give plain decoding's tokens;
the draft engine computes only what its prefix cache lacks; a split cluster's decode drafts
after a handoff (the draft's KV rebuilt there)."""

from __future__ import annotations

import json

import pytest
from conftest import run_to_completion
from test_overlap_scheduling import _mixed_options
from test_speculative import _engine, _repetitive_prompts, assert_same_as_plain

from tandem.engine.sampling_options import SamplingOptions


def _draft(model_dir, k: int) -> dict:
    return {"method": "draft_model", "model": str(model_dir), "num_speculative_tokens": k}


@pytest.mark.parametrize("draft", ["llama", "qwen2"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_a_draft_models_drafts_give_the_tokens_of_plain_decoding(model_dirs, draft, k):
    """The target itself as its draft (every greedy draft accepted) and another architecture with
    the same vocabulary (few accepted): greedy, seeded, penalised, min_tokens + stop id and
    logprob requests get plain decoding's tokens, logprobs and cumulative logprobs."""
    prompts = _repetitive_prompts(10 + k, 7)
    options = _mixed_options(prompts, stop_token=17)
    engine = _engine(model_dirs["llama"], _draft(model_dirs[draft], k))
    assert_same_as_plain(engine, model_dirs["llama"], prompts, options)
    c = engine.counters
    assert c.num_draft_tokens > 0
    if draft == "llama":
        assert c.num_accepted_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == 96
    draft_engine = engine.proposer.engine
    assert draft_engine.num_unfinished == 0 and not draft_engine.has_request("draft:r0")


def test_the_target_as_its_own_draft_decodes_k_plus_one_tokens_a_step(model_dirs):
    prompts = {"a": [1, 40, 41, 42, 43, 44, 45, 46, 47, 48, 49]}
    options = SamplingOptions(max_tokens=41, ignore_eos=True)
    engine = _engine(model_dirs["llama"], _draft(model_dirs["llama"], 4))
    plain = _engine(model_dirs["llama"], None)
    assert run_to_completion(engine, prompts, options) == run_to_completion(plain, prompts, options)
    c = engine.counters
    # The first step computes the prompt and its first token; each later one 4 drafts + 1.
    assert c.num_accepted_draft_tokens == c.num_draft_tokens == 40 - 40 // 5
    assert c.num_steps == 1 + 40 // 5


def test_the_draft_engine_computes_only_what_its_prefix_cache_lacks(model_dirs):
    """Each step resends the sequence's tokens to the draft engine; its cache holds every full
    block of the step before, so it computes at most a block's worth plus the k drafts."""
    prompt = [1] + list(range(50, 110))
    options = SamplingOptions(max_tokens=48, ignore_eos=True)
    engine = _engine(model_dirs["llama"], _draft(model_dirs["qwen2"], 3), max_num_batched_tokens=64)
    run_to_completion(engine, {"a": prompt}, options)
    draft = engine.proposer.engine
    resent = draft.block_manager.num_prefix_query_tokens
    computed = draft.counters.num_prompt_tokens_computed
    steps = engine.counters.num_steps - 1  # the first step is the prompt's: no drafts
    assert resent > 4 * len(prompt)  # each step resent the whole sequence
    assert computed <= len(prompt) + steps * (4 + 3)  # the first: the prompt; then a block + k


def test_a_draft_model_with_another_vocabulary_is_refused(model_dirs, tmp_path):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=256,
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="vocabulary of 97 tokens.*share the target's tokenizer"):
        _engine(model_dirs["llama"], _draft(tmp_path, 2))


def test_a_released_and_resumed_engine_drafts_again(model_dirs):
    engine = _engine(model_dirs["llama"], _draft(model_dirs["llama"], 2))
    prompts = {"a": [1, 7, 8, 9, 10]}
    options = SamplingOptions(max_tokens=12, ignore_eos=True)
    first = run_to_completion(engine, prompts, options)
    engine.release_memory(["model", "kv_cache"])
    assert engine.proposer.engine.released_tags == ["model", "kv_cache"]
    engine.resume_memory(["model", "kv_cache"])
    assert run_to_completion(engine, {"b": prompts["a"]}, options) == {"b": first["a"]}
    assert engine.counters.num_accepted_draft_tokens > 0


def test_a_split_cluster_drafts_with_a_draft_model_after_the_handoff(model_dirs, oracle):
    """The decode gets the target's KV over NIXL and rebuilds the draft's: the client streams
    transformers' greedy tokens and the decode reports its drafts accepted."""
    from tandem.client import LLM, SamplingParams
    from tandem.testing.cluster import LocalCluster, client_kwargs_for

    ref = oracle(model_dirs["llama"])
    spec = json.dumps(_draft(model_dirs["llama"], 3))
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "96"],
        worker_args={"decode-1": ["--speculative-config", spec]},
    ) as cluster:
        prompts = [ref.tokenizer.encode(f"draft {i} " * (3 + i)) for i in range(3)]
        params = SamplingParams(max_tokens=24, ignore_eos=True, return_perf_metrics=True)
        with LLM(cluster.address, **client_kwargs_for(cluster.address)) as llm:
            outs = llm.generate(prompts, params, use_tqdm=False)
        for prompt, out in zip(prompts, outs):
            seq = out.outputs[0]
            assert seq.token_ids == ref.greedy(prompt, 24)
            perf = seq.request_perf_metrics.speculative_decoding
            assert perf.total_accepted_draft_tokens == perf.total_draft_tokens > 0
            assert out.outputs[0].request_perf_metrics.kv_handoff.outcome == "pulled"
