"""A pull that fails part-way keeps what landed (issue 39): the decode computes only the rest of
the prompt, counted recomputed:pull_failed with the blocks it did pull, and the tokens are the
aggregated path's. Real processes; the decode's READ number 1 (of 2 blocks each) fails as a NIXL
failure would (TANDEM_TEST_KV_PULL_FAULT)."""

from __future__ import annotations

import pytest
from test_disagg import worker_state

from tandem.client import LLM, SamplingParams
from tandem.testing.cluster import LocalCluster

BLOCK = 8
PROMPT = 100  # 13 blocks: READs of 2 blocks, the second fails, 2 blocks land before it
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "128",
            "--block-size",
            str(BLOCK),
            "--no-prefix-caching",
        ],
        env={"TANDEM_TEST_KV_PULL_FAULT": "2:1"},
    ) as c:
        yield c


def test_a_pull_that_fails_part_way_computes_only_the_rest(cluster, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    prompt = [1] + [(7 * i) % 370 + 4 for i in range(PROMPT - 1)]
    decode = cluster.workers[1].address
    before = worker_state(decode)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(cluster.address) as llm:
        out = llm.generate(prompt, params, use_tqdm=False)
    assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
    handoff = out.metrics.kv_handoff
    assert (handoff.outcome, handoff.reason) == ("recomputed", "pull_failed")
    assert handoff.num_pulled_blocks == 2
    after = worker_state(decode)
    # The decode computed the prompt past the 2 blocks that landed, not the whole prompt.
    computed = after.num_prompt_tokens_computed - before.num_prompt_tokens_computed
    assert computed == PROMPT - 2 * BLOCK
    assert (
        after.kv_handoff_outcomes["recomputed:pull_failed"]
        == before.kv_handoff_outcomes.get("recomputed:pull_failed", 0) + 1
    )
