"""The host KV tier (issue 36, --host-kv-cache-gb): prefix blocks the device pool evicts go down
to host memory and come back up on a later prefix hit. The tier's bookkeeping alone; the engine
on the CPU with a pool too small for every session: greedy tokens identical with and without the
tier, the returning session's prompt served from the tier (not computed), TensorRT-LLM's KV
events (updated cache_level 0 -> 1 -> 0, removed once the tier pushes a block out)."""

from __future__ import annotations

import random

import pytest

from tandem.engine.block_manager import BlockManager
from tandem.engine.config import EngineConfig
from tandem.engine.kv_tier import HostKvTier, runs
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions


def test_the_tier_keeps_the_most_recent_blocks_and_owes_copies_in_order():
    tier = HostKvTier(2)
    assert tier.offload(101, 7) is None and tier.offload(102, 8) is None
    assert tier.offload(103, 9) == 101  # full: the least recently used goes
    assert 101 not in tier and 102 in tier and 103 in tier
    slot = tier.claim(102)
    assert 102 in tier  # a block copied up stays: its KV is still valid
    # A claimed slot is not reused before its copy up ran, even as the least recently used.
    assert tier.offload(104, 3) == 103
    other = tier.claim(104)
    assert tier.offload(105, 4) == 105  # every slot owed a copy up: nothing goes down now
    tier.copy_up(slot, 5)
    tier.copy_up(other, 6)
    copies = tier.take_copies()
    # Down first (the slot 104 came up from is read by its copy up after 104 went down).
    assert copies.down == [(7, 0), (8, 1), (9, 0), (3, 0)]
    assert copies.up == [(slot, 5), (other, 6)]
    # The device blocks about to be written again whose KV went down (105's did not).
    assert copies.reused == [7, 8, 9, 3]
    # Kept after the copy up: storing the block again copies nothing.
    assert tier.store_many([(102, 11)]) == [] and tier.take_copies() == ([], [], [])
    assert tier.offload(106, 6) == 104  # the slots came free once their copies up ran
    assert tier.clear() == [102, 106] and len(tier) == 0
    with pytest.raises(ValueError, match="at least one block"):
        HostKvTier(0)


class _Seq:  # what the block manager reads of a sequence
    def __init__(self, ids):
        self.all_token_ids = ids
        self.num_computed_tokens = len(ids)
        self.num_tokens = len(ids)
        self.block_table, self.block_hashes = [], []
        self.cache_salt, self.lora_fingerprint, self.adapter = None, None, None
        self.caches_blocks, self.kv_unconfirmed = True, False

    def token_slice(self, a, b):
        return self.all_token_ids[a:b]


def test_a_freed_block_is_written_through_and_its_eviction_copies_nothing():
    bm = BlockManager(4, 2, host_tier=HostKvTier(3))
    first = _Seq([1, 2, 3, 4])
    first.block_table = bm.allocate(2)
    bm.register_computed(first)
    held, hashes = list(first.block_table), list(first.block_hashes)
    take = bm.host_tier.take_copies
    assert take() == ([], [], [])  # held by a request: nothing goes down yet
    bm.release(first)
    # Freed: both blocks go down now, while they idle (tail first), and stay cached on the device.
    copies = take()
    assert sorted(b for b, _ in copies.down) == sorted(held) and copies.reused == []
    assert bm.match_prefix([1, 2, 3, 4], None, 4)[0] == held
    bm.drain_events()
    other = _Seq([9, 9, 9, 9, 9, 9, 9, 9])
    other.block_table = bm.allocate(4)  # evicts first's two blocks: no copy, but reused
    copies = take()
    assert copies.down == [] and sorted(copies.reused) == sorted(held)
    assert [e["type"] for e in bm.drain_events()] == ["updated", "updated"]
    bm.register_computed(other)
    other_hashes = list(other.block_hashes)
    bm.release(other)  # 4 blocks down into a 3-slot tier holding 2: first's prefix pushed out
    copies = take()
    # 3 slots for 4 blocks: the tail (least recently used) is not kept; the rest go down paired
    # in block order with their slots (one range: one copy).
    assert len(copies.down) == 3 and len(runs(copies.down)) == 1
    assert other_hashes[-1] not in bm.host_tier and other_hashes[0] in bm.host_tier
    removed = [h for e in bm.drain_events() if e["type"] == "removed" for h in e["block_hashes"]]
    # Only what left both tiers is removed: other's blocks pushed out are still on the device.
    assert sorted(removed) == sorted(hashes)
    assert all(h in bm.match_prefix(other.all_token_ids, None, 8)[1] for h in other_hashes)


def test_an_evicted_prefix_is_found_in_the_tier_and_taken_into_fresh_blocks():
    bm = BlockManager(4, 2, host_tier=HostKvTier(8))

    first = _Seq([1, 2, 3, 4])
    first.block_table = bm.allocate(2)
    bm.register_computed(first)
    first_hashes = list(first.block_hashes)
    bm.release(first)
    other = _Seq([9, 9, 9, 9, 9, 9, 9, 9])
    other.block_table = bm.allocate(4)  # every block: first's two are evicted, down to the tier
    bm.register_computed(other)
    events = bm.drain_events()
    assert [e["cache_level"]["new_value"] for e in events if e["type"] == "updated"] == [1, 1]
    assert not any(e["type"] == "removed" for e in events)
    bm.release(other)
    blocks, hashes = bm.match_prefix(first.all_token_ids, None, 4)
    assert blocks == [-1, -1] and hashes == first_hashes
    assert bm.num_free_needed(blocks, 0) == 2
    again = _Seq([1, 2, 3, 4])
    bm.take_cached(again, blocks, hashes, 4)
    assert again.num_computed_tokens == 4 and -1 not in again.block_table
    assert bm.match_prefix(first.all_token_ids, None, 4)[0] == again.block_table  # on the device
    assert [b for _, b in bm.host_tier.take_copies().up] == again.block_table
    levels = [
        (e["cache_level"]["old_value"], e["cache_level"]["new_value"])
        for e in bm.drain_events()
        if e["type"] == "updated"
    ]
    assert levels.count((1, 0)) == 2


BLOCK = 8


def _engine(model_dir, host_gb: float) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            str(model_dir),
            device="cpu",
            block_size=BLOCK,
            num_blocks=24,  # 192 tokens: one session's history at a time
            max_num_seqs=4,
            host_kv_cache_gb=host_gb,
        )
    )


def _turns(engine, sessions: list[list[int]], rounds: int) -> tuple[list, list]:
    """Each round, every session in turn: its history + its answer + a new question; returns each
    turn's tokens and the prompt tokens it found cached."""
    options = SamplingOptions(max_tokens=8, ignore_eos=True)
    rng = random.Random(5)
    tokens, cached = [], []
    history = [list(s) for s in sessions]
    for r in range(rounds):
        for i, h in enumerate(history):
            rid = f"s{i}-r{r}"
            engine.add_request(rid, h, options)
            out, num_cached = [], 0
            while engine.num_unfinished:
                for step in engine.step():
                    out += step.new_token_ids
                    num_cached = max(num_cached, step.num_cached_prompt_tokens)
            tokens.append(out)
            cached.append(num_cached)
            h += out + [rng.randrange(4, 380) for _ in range(6)]
    return tokens, cached


def test_sessions_that_outgrow_the_pool_come_back_from_the_tier(model_dirs):
    rng = random.Random(3)
    sessions = [[1] + [rng.randrange(4, 380) for _ in range(100)] for _ in range(3)]
    plain = _engine(model_dirs["llama"], 0)
    want, cached_plain = _turns(plain, sessions, 2)
    tiered = _engine(model_dirs["llama"], 0.001)
    got, cached_tier = _turns(tiered, sessions, 2)
    assert got == want  # the KV copied down and up is the KV computed
    # Round 2: the device pool held only the last session; the tier held all three.
    assert cached_plain[3:5] == [0, 0]
    assert all(c >= 100 for c in cached_tier[3:]), cached_tier
    tier = tiered.block_manager.host_tier
    assert tier.num_copied_down > 0 and tier.num_copied_up > 0
    events = tiered.block_manager.drain_events()
    assert any(e["type"] == "updated" for e in events)


def test_a_bad_host_tier_is_refused_at_start(model_dirs):
    with pytest.raises(ValueError, match="needs prefix caching"):
        EngineConfig(str(model_dirs["llama"]), host_kv_cache_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match=r"host_kv_cache_gb must be in \[0, 4096\]"):
        EngineConfig(str(model_dirs["llama"]), host_kv_cache_gb=-1)
    with pytest.raises(ValueError, match="holds no KV block"):
        LLMEngine(EngineConfig(str(model_dirs["llama"]), num_blocks=8, host_kv_cache_gb=1e-9))


def test_split_sessions_reuse_both_workers_tiers_with_the_oracles_tokens(model_dirs, oracle):
    """Prefill and decode each with a pool too small for the sessions and a host tier: a
    returning session's prefix comes back from the prefill's tier (computed there: only the new
    tokens) and from the decode's (pulled: only the new blocks), and the tokens are
    transformers' greedy tokens. Real processes."""
    from test_disagg import worker_state

    from tandem.client import LLM, SamplingParams
    from tandem.testing.cluster import LocalCluster

    ref = oracle(model_dirs["llama"])
    rng = random.Random(11)
    histories = [[1] + [rng.randrange(4, 380) for _ in range(90)] for _ in range(3)]
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    engine = ["--model", str(model_dirs["llama"]), "--block-size", str(BLOCK), "--num-blocks", "24"]
    with LocalCluster(
        roles=["prefill", "decode"], engine_args=[*engine, "--host-kv-cache-gb", "0.002"]
    ) as cluster:
        prefill = cluster.workers[0].address
        computed, cached = [], []
        with LLM(cluster.address) as llm:
            for _ in range(2):
                for history in histories:
                    before = worker_state(prefill).num_prompt_tokens_computed
                    out = llm.generate(history, params, use_tqdm=False)
                    assert out.outputs[0].token_ids == ref.greedy(history, 6)
                    computed.append(worker_state(prefill).num_prompt_tokens_computed - before)
                    cached.append(out.metrics.kv_handoff.num_cached_blocks)
                    history += out.outputs[0].token_ids + [rng.randrange(4, 380) for _ in range(5)]
    # Round 2: each session's history (~100 tokens) was evicted from both pools by the others.
    assert all(c <= 16 for c in computed[3:]), computed  # the prefill computed the new tokens
    assert all(c >= 10 for c in cached[3:]), cached  # the decode pulled only the new blocks


def test_a_block_computed_again_while_in_the_tier_keeps_one_slot(model_dirs):
    """A prompt's last block is computed again (its logits are what the step samples) even when
    the tier holds it: evicted again, it must not take a second slot nor be reported removed."""
    engine = LLMEngine(
        EngineConfig(
            str(model_dirs["llama"]),
            device="cpu",
            block_size=BLOCK,
            num_blocks=6,
            host_kv_cache_gb=0.0002,
        )
    )
    tier = engine.block_manager.host_tier
    rng = random.Random(2)
    prompts = [[1] + [rng.randrange(4, 380) for _ in range(4 * BLOCK - 1)] for _ in range(2)]
    options = SamplingOptions(max_tokens=1, ignore_eos=True)
    for turn in range(6):
        engine.add_request(f"r{turn}", prompts[turn % 2], options)
        while engine.num_unfinished:
            engine.step()
        tier.take_copies()
        # Every slot free or holding a block (a claimed one stays mapped; none is after the copies).
        assert not tier._copying_up
        held = len(tier._slot_of) + len(tier._free_slots)
        assert held == tier.num_slots, (turn, held)
        removed = {
            h
            for e in engine.block_manager.drain_events()
            if e["type"] == "removed"
            for h in e["block_hashes"]
        }
        assert not removed & set(tier._slot_of), turn


def test_copies_run_as_ranges_consecutive_on_both_sides():
    # A session's blocks freed tail first: its slots and blocks run downwards together.
    assert runs([(9, 3), (8, 2), (7, 1), (4, 0)]) == [(4, 0, 1), (7, 1, 3)]
    assert runs([(1, 5), (2, 6), (3, 9)]) == [(1, 5, 2), (3, 9, 1)]
    # Two copies into one destination: the later one alone.
    assert runs([(1, 5), (2, 5), (3, 6)]) == [(2, 5, 2)]
    rng = random.Random(4)
    for _ in range(200):
        pairs = [(rng.randrange(40), rng.randrange(40)) for _ in range(rng.randrange(1, 30))]
        want = {dst: src for src, dst in pairs}
        got = {}
        for src, dst, n in runs(pairs):
            for i in range(n):
                assert dst + i not in got
                got[dst + i] = src + i
        assert got == want


def test_a_weight_reset_reports_a_block_held_by_both_tiers_once():
    bm = BlockManager(4, 2, host_tier=HostKvTier(4))
    seq = _Seq([1, 2, 3, 4])
    seq.block_table = bm.allocate(2)
    bm.register_computed(seq)
    bm.release(seq)  # written through: both hashes on the device and in the tier
    bm.drain_events()
    bm.reset_prefix_cache()
    (event,) = bm.drain_events()
    assert event["type"] == "removed" and len(event["block_hashes"]) == 2


def test_an_admitted_pull_synchronizes_only_for_blocks_it_reuses(model_dirs):
    """Copies written through after a request ended do not make the next KV pull wait for the
    whole device: only blocks it reuses before their copies landed (or copies up) would."""
    engine = LLMEngine(
        EngineConfig(
            str(model_dirs["llama"]),
            device="cpu",
            block_size=8,
            num_blocks=64,
            max_num_seqs=4,
            host_kv_cache_gb=0.001,
        )
    )
    rng = random.Random(1)
    options = SamplingOptions(max_tokens=2, ignore_eos=True)
    engine.add_request("a", [1] + [rng.randrange(4, 380) for _ in range(40)], options)
    while engine.num_unfinished:
        engine.step()
    syncs = []
    engine.runner.synchronize = lambda: syncs.append(1)
    other = [1] + [rng.randrange(4, 380) for _ in range(40)]
    engine.add_remote_kv_request("b", other, [5], options)  # fresh blocks: none cached reused
    assert syncs == []
    assert engine.block_manager.host_tier.num_copied_down > 0  # "a" went down meanwhile
