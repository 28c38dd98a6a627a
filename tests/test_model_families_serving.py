"""A Gemma 2 checkpoint (sliding window 8 on alternate layers, soft-capped scores and logits,
sandwich norms) served by real processes: through the router's split (prefill worker -> KV
handoff -> decode worker) and on an aggregated worker, prompts longer than the window give
transformers' greedy tokens, again when their prefix is cached."""

from __future__ import annotations

import pytest
import torch
import transformers
from conftest import assert_all_blocks_free, split_or_aggregated_client
from tiny_families import WINDOW, write_family_checkpoint

from tandem.client import SamplingParams
from tandem.testing.cluster import LocalCluster

MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    model_dir = write_family_checkpoint(tmp_path_factory.mktemp("gemma2"), "gemma2")
    engine_args = ["--model", str(model_dir), "--num-blocks", "64", "--block-size", "8"]
    # Chunked prefill: a prompt runs in steps of at most 16 tokens, across the window.
    engine_args += ["--max-num-batched-tokens", "16"]
    with LocalCluster(roles=["prefill", "decode", "both"], engine_args=engine_args) as cluster:
        yield model_dir, cluster


def _expected(model_dir, prompts: list[list[int]]) -> list[list[int]]:
    """transformers' greedy tokens (eager attention: its SDPA path drops the soft-cap), cut after
    the first EOS as tandem's output is."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    eos = model.generation_config.eos_token_id
    out = []
    for ids in prompts:
        with torch.no_grad():
            tokens = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=eos,
            )[0, len(ids) :].tolist()
        out.append(tokens[: tokens.index(eos) + 1] if eos in tokens else tokens)
    return out


def test_each_worker_logs_the_path_its_model_takes(served):
    _, cluster = served
    for worker in cluster.workers:
        log = worker.log_path.read_text(errors="replace")
        assert "model gemma2: tandem's native decoder, paged attention (sliding window 8" in log


@pytest.mark.parametrize("which", ["split", "aggregated"])
def test_greedy_tokens_past_the_window_match_transformers(served, which):
    model_dir, cluster = served
    gen = torch.Generator().manual_seed(11)
    prompts = [
        [1] + torch.randint(4, 380, (length,), generator=gen).tolist() for length in (20, 33, 47)
    ]
    assert min(map(len, prompts)) > 2 * WINDOW
    expected = _expected(model_dir, prompts)
    with split_or_aggregated_client(cluster, which) as llm:
        for attempt in ("cold", "prefix cached"):
            outs = llm.generate(prompts, SamplingParams(max_tokens=MAX_TOKENS), use_tqdm=False)
            got = [out.outputs[0].token_ids for out in outs]
            assert got == expected, attempt
        assert_all_blocks_free(llm)


@pytest.mark.timeout(120)
def test_tp2_engine_gives_the_tp1_tokens(tmp_path):
    """A 2-rank engine (a follower process over gloo, each rank reading its share of the file):
    Gemma 2's sandwich norms, scaled embedding, soft-caps and windows hold per rank. (Phi-3's
    fused projections cut per rank: test_model_families' share test.)"""
    from conftest import run_to_completion

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    model_dir = write_family_checkpoint(tmp_path, "gemma2")
    gen = torch.Generator().manual_seed(2)
    prompts = {
        f"r{i}": [1] + torch.randint(4, 380, (n,), generator=gen).tolist()
        for i, n in enumerate((19, 27))
    }
    options = SamplingOptions(max_tokens=8, ignore_eos=True)
    tokens = {}
    for size in (1, 2):
        engine = LLMEngine(
            EngineConfig(
                str(model_dir),
                block_size=4,
                num_blocks=64,
                max_num_batched_tokens=16,
                tensor_parallel_size=size,
                max_loras=0,
            )
        )
        try:
            tokens[size] = run_to_completion(engine, prompts, options)
        finally:
            engine.close()
    assert tokens[2] == tokens[1]
