"""The engine in-process: continuous batching under pressure (chunked prefill,
preemption by recompute, priorities) still gives transformers' greedy tokens."""

from __future__ import annotations

import random

import pytest
from conftest import run_to_completion

from tandem.engine.admission import PromptNeverFitsError, PromptTooLongError
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions


@pytest.mark.parametrize("model", ["llama", "qwen3"])
@pytest.mark.parametrize("num_blocks, budget", [(200, 512), (16, 16), (12, 7)])
def test_batching_under_pressure_matches_transformers(
    model_dirs, oracle, model, num_blocks, budget
):
    ref = oracle(model_dirs[model])
    rng = random.Random(num_blocks * 31 + budget)
    prompts = {
        f"r{i}": [1]
        + [rng.randrange(4, ref.model.config.vocab_size) for _ in range(rng.randrange(4, 28))]
        for i in range(6)
    }
    engine = LLMEngine(
        EngineConfig(
            str(model_dirs[model]),
            block_size=4,
            num_blocks=num_blocks,
            max_num_seqs=4,
            max_num_batched_tokens=budget,
        )
    )
    got = run_to_completion(engine, prompts, SamplingOptions(max_tokens=16, eos_token_ids=(2,)))
    for rid, ids in prompts.items():
        assert got[rid] == ref.greedy(ids, 16), rid
    assert engine.block_manager.num_free_blocks == num_blocks
    if num_blocks <= 16:
        assert engine.scheduler.num_preemptions > 0  # the pressure was real


def test_higher_priority_finishes_first(model_dirs):
    engine = LLMEngine(
        EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=64, max_num_seqs=1)
    )
    opts = SamplingOptions(max_tokens=4, ignore_eos=True)
    engine.add_request("low", [1, 5, 6], opts, priority=0.1)
    engine.add_request("high", [1, 7, 8], opts, priority=0.9)
    finished = []
    while engine.num_unfinished:
        finished += [o.request_id for o in engine.step() if o.finished]
    assert finished == ["high", "low"]


def test_prompt_limits(model_dirs):
    engine = LLMEngine(
        EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=8, max_model_len=64)
    )
    with pytest.raises(PromptTooLongError, match="context"):
        engine.add_request("long", [1] * 64, SamplingOptions())
    with pytest.raises(PromptNeverFitsError, match="KV blocks"):
        engine.add_request("huge", [1] * 40, SamplingOptions())
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("oov", [1, 10**6], SamplingOptions())
    assert engine.block_manager.num_free_blocks == 8


def test_a_context_longer_than_the_model_positions_is_refused_at_start(model_dirs):
    """The tiny Llama has 2048 positions: a longer max_model_len used to start and then fail a
    long prompt mid-step (IndexError on the rotary table, INTERNAL to the client)."""
    with pytest.raises(
        ValueError,
        match=r"context \(2048, max_position_embeddings.*give --max-model-len 2048 or less",
    ):
        LLMEngine(
            EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=8, max_model_len=2049)
        )
    assert (
        LLMEngine(
            EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=8, max_model_len=2048)
        ).max_model_len
        == 2048
    )


def test_abort_frees_blocks(model_dirs):
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=32))
    engine.add_request("a", [1, 9, 10, 11, 12], SamplingOptions(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.block_manager.num_free_blocks < 32
    assert engine.abort_request("a") and not engine.abort_request("a")
    assert engine.block_manager.num_free_blocks == 32 and engine.num_unfinished == 0


def test_a_sequence_that_outgrows_the_pool_ends_with_length(model_dirs):
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=8, num_blocks=4))
    engine.add_request("big", [1] * 10, SamplingOptions(max_tokens=50, ignore_eos=True))
    outs = []
    for _ in range(200):
        if not engine.num_unfinished:
            break
        outs += engine.step()
    assert engine.num_unfinished == 0, "the request never finished"
    # 32 KV slots hold the prompt and all outputs but the last (whose KV is never computed)
    assert outs[-1].finish_reason.value == "length" and len(outs) == 4 * 8 - 10 + 1
    assert engine.block_manager.num_free_blocks == 4


def test_prefix_cache_reuse_eviction_and_events(model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=24))
    assert engine.block_manager.drain_events() == [
        {"type": "created", "num_blocks_per_cache_level": [24, 0]}
    ]
    shared = [1] + list(range(10, 25))  # 16 tokens: 4 full blocks
    opts = SamplingOptions(max_tokens=6, ignore_eos=True)
    first = run_to_completion(engine, {"a": shared + [40, 41]}, opts)["a"]
    computed = engine.counters.num_prompt_tokens_computed
    second = run_to_completion(engine, {"b": shared + [50, 51, 52]}, opts)["b"]
    assert engine.counters.num_prompt_tokens_computed - computed == 3  # only the new tail
    assert first == ref.greedy(shared + [40, 41], 6) and second == ref.greedy(
        shared + [50, 51, 52], 6
    )
    events = engine.block_manager.drain_events()
    stored = [b for e in events if e["type"] == "stored" for b in e["blocks"]]
    assert [t["token_id"] for t in stored[0]["tokens"]] == shared[:4]
    # Fill the pool with other prompts: cached blocks get reused and leave the cache.
    others = {f"o{i}": [1] + [100 + 20 * i + j for j in range(15)] for i in range(6)}
    got = run_to_completion(engine, others, opts)
    assert got == {k: ref.greedy(v, 6) for k, v in others.items()}
    assert any(e["type"] == "removed" for e in engine.block_manager.drain_events())
    assert engine.block_manager.num_free_blocks == 24


def test_cache_salt_separates_tenants(model_dirs):
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=32))
    prompt = [1] + list(range(30, 45))
    opts = SamplingOptions(max_tokens=2, ignore_eos=True)
    engine.add_request("a", prompt, opts, cache_salt="alice")
    while engine.num_unfinished:
        engine.step()
    before = engine.counters.num_prompt_tokens_computed
    engine.add_request("b", prompt, opts, cache_salt="bob")
    while engine.num_unfinished:
        engine.step()
    assert engine.counters.num_prompt_tokens_computed - before == len(prompt)


def test_a_parked_import_never_deadlocks_with_a_preempted_sequence(model_dirs):
    """An import holds its blocks while parked; it reserves its first token's slot too, so a
    running sequence that runs out of blocks cannot wait for it forever."""
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=8))
    opts = SamplingOptions(max_tokens=40, ignore_eos=True)
    engine.add_request("a", [1, 5, 6], opts)
    for _ in range(3):
        engine.step()
    plan = engine.add_remote_kv_request(
        "b", [1] + list(range(10, 21)), [30], opts
    )  # 12 prompt tokens: 3 full blocks
    assert plan is not None and len(plan.block_ids) == 3
    assert engine.num_waiting_for_remote_kv == 1
    engine.remote_kv_arrived("b")
    for _ in range(500):
        if not engine.num_unfinished:
            break
        engine.step()
    assert engine.num_unfinished == 0 and engine.block_manager.num_free_blocks == 8


def test_a_reservation_ahead_of_its_handoff_leaves_headroom_and_takes_its_tokens_on_arrival(
    model_dirs,
):
    """ahead_of_handoff (an announced request, reserved while its prefill runs): refused unless
    the pool keeps a block for each sequence the scheduler has and a twentieth of itself, where a
    reservation at the handoff takes the last free block; its first token comes with its
    arrival, and it decodes as one reserved with it."""
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=40))
    bm = engine.block_manager
    opts = SamplingOptions(max_tokens=4, ignore_eos=True)
    engine.add_request("a", [1, 5, 6], SamplingOptions(max_tokens=40, ignore_eos=True))
    engine.step()
    free = bm.num_free_blocks
    whole = [1] + list(range(10, 10 + 4 * free - 2))  # with its first token: every free block
    assert engine.add_remote_kv_request("x", whole, [], opts, ahead_of_handoff=True) is None
    assert engine.add_remote_kv_request("x", whole, [30], opts) is not None
    engine.abort_request("x")
    headroom = 1 + 40 // 20  # "a", and a twentieth of the pool
    fits = whole[: 4 * (free - headroom) - 1]
    plan = engine.add_remote_kv_request("y", fits, [], opts, ahead_of_handoff=True)
    assert plan is not None and engine.num_waiting_for_remote_kv == 1
    engine.remote_kv_arrived("y", first_token_ids=[30])
    outs = []
    while engine.num_unfinished:
        outs += [o for o in engine.step() if o.request_id == "y"]
    assert engine.has_request("y") is False and sum(len(o.new_token_ids) for o in outs) == 3
    assert bm.num_free_blocks == 40


def test_an_unconfirmed_import_runs_but_caches_nothing_until_confirmed(model_dirs):
    """RemoteKvArrived(confirmed=False): the sequence decodes while the decode asks the prefill
    to confirm the lease, but none of its blocks (the imported prompt's, or one its steps fill)
    is cached or announced until kv_confirmed(); aborted instead, it leaves nothing cached."""
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=32))
    bm = engine.block_manager
    prompt = [1] + list(range(10, 21))  # 12 tokens: 3 full blocks
    opts = SamplingOptions(max_tokens=6, ignore_eos=True)

    def cached_blocks(tokens):
        return len(bm.match_prefix(tokens, None, len(tokens), None)[0])

    for confirm in (False, True):
        rid = f"import-{confirm}"
        bm.drain_events()
        engine.add_remote_kv_request(rid, prompt, [30], opts)
        engine.remote_kv_arrived(rid, confirmed=False)
        outs = []
        for _ in range(3):  # the prompt's 12 tokens and 3 drawn ones: a 4th block fills
            outs += engine.step()
        assert sum(len(o.new_token_ids) for o in outs) >= 2
        assert cached_blocks(prompt) == 0 and not bm.drain_events()
        if not confirm:
            engine.abort_request(rid)
            assert cached_blocks(prompt) == 0 and not bm.drain_events()
            assert bm.num_free_blocks == 32
            continue
        engine.kv_confirmed(rid)
        assert cached_blocks(prompt) == 3
        assert {e["type"] for e in bm.drain_events()} == {"stored"}
        while engine.num_unfinished:
            engine.step()
        assert bm.num_free_blocks == 32
    # Finished before the answer: its blocks wait for it, then are cached (or freed uncached).
    other = [1] + list(range(40, 51))
    for confirm in (False, True):
        rid = f"short-{confirm}"
        engine.add_remote_kv_request(
            rid, other, [30], SamplingOptions(max_tokens=2, ignore_eos=True)
        )
        engine.remote_kv_arrived(rid, confirmed=False)
        while engine.num_unfinished:
            engine.step()
        assert bm.num_free_blocks < 32 and cached_blocks(other) == 0
        assert engine.num_waiting_for_remote_kv == 1  # a drain waits for its answer
        engine.kv_confirmed(rid) if confirm else engine.abort_request(rid)
        assert bm.num_free_blocks == 32 and cached_blocks(other) == (3 if confirm else 0)
        assert engine.num_waiting_for_remote_kv == 0


def test_resumed_tokens_are_validated_like_the_prompt(model_dirs):
    engine = LLMEngine(
        EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=8, max_model_len=64)
    )
    with pytest.raises(ValueError, match="vocabulary"):
        engine.add_request("x", [1, 2], SamplingOptions(), output_token_ids=[10**9])
    with pytest.raises(PromptNeverFitsError):
        engine.add_request("y", [1, 2], SamplingOptions(), output_token_ids=[5] * 40)
    with pytest.raises(PromptTooLongError):
        engine.add_remote_kv_request("z", [1, 2], [5] * 70, SamplingOptions())
    assert engine.block_manager.num_free_blocks == 8 and not engine.has_request("z")


def test_a_late_release_does_not_free_a_newer_lease_of_the_same_request_id(model_dirs):
    from conftest import ImmediateEngineThread

    from tandem.engine.sequence import Phase
    from tandem.prefill.lease_keeper import LeaseEnd, LeaseKeeper

    keeper = LeaseKeeper(lease_seconds=60)
    engine = LLMEngine(
        EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=16), hands_off=True
    )
    keeper.attach(ImmediateEngineThread(engine))
    opts = SamplingOptions(max_tokens=8, ignore_eos=True)

    def context_only():
        engine.add_request("same-id", [1, 5, 6, 7, 8], opts, phase=Phase.CONTEXT_ONLY)
        out = []
        while engine.num_unfinished:
            out += engine.step()
        (handoff,) = out
        assert handoff.kept_block_ids
        return keeper.open("same-id", handoff.kept_block_ids)

    old = context_only()
    assert not keeper.expire(old.expires_at + 2) and keeper.endings["expired"] == 1
    new = context_only()
    assert new.lease_id != old.lease_id
    assert not keeper.release(old.lease_id, LeaseEnd.RELEASED)  # the expired lease's late release
    assert keeper.num_leased_blocks == len(new.block_ids) > 0
    assert (
        keeper.release(new.lease_id, LeaseEnd.PULLED) and engine.block_manager.num_free_blocks == 16
    )
    assert keeper.num_leases == 0


def test_context_only_needs_a_lease_table(model_dirs):
    from tandem.common.exceptions import PreconditionError
    from tandem.engine.sequence import Phase

    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=16))
    with pytest.raises(PreconditionError, match="context_only"):
        engine.add_request("x", [1, 5, 6], SamplingOptions(), phase=Phase.CONTEXT_ONLY)
    assert engine.block_manager.num_free_blocks == 16
