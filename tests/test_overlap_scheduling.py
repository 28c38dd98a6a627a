"""Overlap scheduling: the engine launches step N+1 before reading step N's ids (they stay on the
device), and the outputs are those of the plain schedule -> run -> postprocess loop."""

from __future__ import annotations

import random

import pytest
from conftest import run_to_completion

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence import Phase


def _engine(model_dir, overlap: bool, **kwargs) -> LLMEngine:
    config = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=24)
    config.update(kwargs)
    return LLMEngine(EngineConfig(str(model_dir), overlap_scheduling=overlap, **config))


def _mixed_options(prompts, stop_token: int) -> dict[str, SamplingOptions]:
    kinds = [
        SamplingOptions(max_tokens=14, ignore_eos=True),
        SamplingOptions(max_tokens=14, temperature=0.9, top_p=0.9, seed=3, ignore_eos=True),
        SamplingOptions(
            max_tokens=14,
            temperature=0.7,
            seed=4,
            presence_penalty=0.5,
            frequency_penalty=0.3,
            repetition_penalty=1.2,
            ignore_eos=True,
        ),
        SamplingOptions(
            max_tokens=14, min_tokens=6, stop_token_ids=(stop_token,), temperature=1.5, seed=5
        ),
        SamplingOptions(
            max_tokens=14, logprobs=2, temperature=1.0, top_k=5, seed=6, ignore_eos=True
        ),
        SamplingOptions(max_tokens=3, ignore_eos=True),
    ]
    return {rid: kinds[i % len(kinds)] for i, rid in enumerate(prompts)}


@pytest.mark.parametrize("num_blocks", [64, 14])
def test_overlap_gives_the_outputs_of_the_plain_loop(model_dirs, num_blocks):
    """Greedy, seeded, penalised (the engine reads ids back first), min_tokens + stop ids, logprobs
    and short requests together; with 14 blocks, preemption too."""
    rng = random.Random(num_blocks)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(3, 22))]
        for i in range(9)
    }
    options = _mixed_options(prompts, stop_token=17)
    overlapped = _engine(model_dirs["llama"], True, num_blocks=num_blocks)
    got = run_to_completion(overlapped, prompts, options)
    assert got == run_to_completion(
        _engine(model_dirs["llama"], False, num_blocks=num_blocks), prompts, options
    )
    assert overlapped.block_manager.num_free_blocks == num_blocks
    if num_blocks == 14:
        assert overlapped.scheduler.num_preemptions > 0


def test_a_request_is_not_scheduled_after_its_last_draw(model_dirs):
    """max_tokens ends a request whatever its last id: no step computes a row for it after that."""
    engine = _engine(model_dirs["llama"], True)
    run_to_completion(engine, {"a": [1, 5, 6, 7]}, SamplingOptions(max_tokens=3, ignore_eos=True))
    assert engine.counters.num_steps == 3  # the prompt, then two decode steps


def test_stop_token_ends_the_output_exactly(model_dirs):
    engine = _engine(model_dirs["llama"], False)
    free_run = run_to_completion(
        engine, {"a": [1, 9, 10]}, SamplingOptions(max_tokens=12, ignore_eos=True)
    )["a"]
    stop = free_run[4]
    expected = free_run[: free_run.index(stop) + 1]
    overlapped = _engine(model_dirs["llama"], True)
    assert (
        run_to_completion(
            overlapped, {"a": [1, 9, 10]}, SamplingOptions(max_tokens=12, stop_token_ids=(stop,))
        )["a"]
        == expected
    )
    assert overlapped.block_manager.num_free_blocks == 64


def test_abort_while_a_draw_is_in_flight(model_dirs):
    engine = _engine(model_dirs["llama"], True)
    opts = SamplingOptions(max_tokens=30, ignore_eos=True)
    engine.add_request("a", [1, 5, 6], opts)
    engine.add_request("b", [1, 7, 8], opts)
    seen = {"a": 0, "b": 0}
    for _ in range(4):
        for out in engine.step():
            seen[out.request_id] += 1
    assert engine._in_flight is not None  # b's next id is still on the device
    assert engine.abort_request("a")
    before = seen["a"]
    while engine.num_unfinished:
        for out in engine.step():
            seen[out.request_id] += 1
    assert seen["a"] == before and seen["b"] == 30
    assert engine.block_manager.num_free_blocks == 64


def test_a_context_only_request_hands_off_without_an_extra_step(model_dirs):
    from conftest import ImmediateEngineThread

    from tandem.prefill.lease_keeper import LeaseEnd, LeaseKeeper

    keeper = LeaseKeeper(lease_seconds=60)
    engine = LLMEngine(
        EngineConfig(
            str(model_dirs["llama"]),
            overlap_scheduling=True,
            block_size=4,
            num_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=24,
        ),
        hands_off=True,
    )
    keeper.attach(ImmediateEngineThread(engine))
    engine.add_request(
        "p",
        [1, 5, 6, 7, 8],
        SamplingOptions(max_tokens=8, ignore_eos=True),
        phase=Phase.CONTEXT_ONLY,
    )
    outs = []
    while engine.num_unfinished:
        outs += engine.step()
    (handoff,) = outs
    assert handoff.kept_block_ids and engine.counters.num_steps == 1
    lease = keeper.open("p", handoff.kept_block_ids)
    assert (
        keeper.release(lease.lease_id, LeaseEnd.PULLED)
        and engine.block_manager.num_free_blocks == 64
    )
