"""Cross-worker prefix pulls (issue 36): two aggregated workers with --kv-prefix-pulls behind a
router with --prefix-pulls. A prompt served on one worker (S), then a longer prompt with the same
prefix sent to the other (W, by attention_dp_rank): W leases the prefix on S, pulls it over NIXL
and computes only the new tail; the greedy tokens are transformers' either way. When S does not
answer (SIGSTOPped), W computes the whole prompt, the tokens are the same, and no block or lease
is left behind on either worker. Real processes on loopback, the tiny Llama on the CPU."""

from __future__ import annotations

import os
import signal
import time

import pytest
from test_disagg import worker_state

from tandem.client import LLM, SamplingParams, SchedulingParams
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, types_pb2, worker_pb2

BLOCK = 8
NUM_BLOCKS = 128
MAX_TOKENS = 8


def _engine_args(model_dirs) -> list[str]:
    return [
        "--model",
        str(model_dirs["llama"]),
        "--num-blocks",
        str(NUM_BLOCKS),
        "--block-size",
        str(BLOCK),
    ]


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both", "both"],
        engine_args=_engine_args(model_dirs),
        worker_args={name: ["--kv-prefix-pulls"] for name in ("both-1", "both-2")},
        # Any pull of a block wins here (the model is tiny: its compute is cheap, but the test is
        # of the path, not of the cost model, which test_prefix_source.py covers).
        router_args=[
            "--prefix-pulls",
            "--prefix-pull-min-blocks",
            "1",
            "--prefix-compute-tokens-per-s",
            "1",
        ],
    ) as c:
        yield c


def _ranked(cluster) -> list[str]:
    """The workers' addresses in attention_dp_rank order (address order)."""
    return sorted(w.address for w in cluster.workers)


def _generate(cluster, prompt: list[int], rank: int):
    params = SamplingParams(
        max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, return_perf_metrics=True
    )
    with LLM(cluster.address) as llm:
        return llm.generate(
            prompt,
            params,
            use_tqdm=False,
            scheduling_params=SchedulingParams(attention_dp_rank=rank),
        )


def _prompt(seed: int, length: int) -> list[int]:
    return [1] + [(seed * 31 + 7 * i) % 370 + 4 for i in range(length - 1)]


def _wait_idle(address: str, timeout: float = 10.0) -> worker_pb2.WorkerState:
    """The worker's state once every block is back in its pool and no lease is open."""
    deadline = time.monotonic() + timeout
    while True:
        state = worker_state(address)
        idle = state.num_free_blocks == state.num_total_blocks and not state.num_leases
        if idle or time.monotonic() > deadline:
            return state
        time.sleep(0.05)


def test_a_prefix_on_another_worker_is_pulled_and_only_the_tail_computed(
    cluster, model_dirs, oracle
):
    ref = oracle(model_dirs["llama"])
    source, target = _ranked(cluster)
    prefix = _prompt(1, 100)  # 12 full blocks
    first = _generate(cluster, prefix, 0)
    assert first.outputs[0].token_ids == ref.greedy(prefix, MAX_TOKENS)
    time.sleep(0.5)  # the router's index learns S's blocks from its KV events
    prompt = prefix + _prompt(2, 21)
    before = worker_state(target)
    out = _generate(cluster, prompt, 1)
    assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
    pull = out.metrics.prefix_pull
    assert (pull.outcome, pull.reason, pull.source) == ("pulled", "", source)
    assert pull.num_pulled_blocks == 12 and pull.num_cached_blocks == 0
    assert out.metrics.num_computed_prompt_tokens == len(prompt) - 12 * BLOCK
    perf = out.outputs[0].request_perf_metrics
    assert perf.prefix_pull == pull and perf.kv_cache_metrics.num_reused_blocks == 0
    after = worker_state(target)
    assert after.num_prompt_tokens_computed - before.num_prompt_tokens_computed == 21 + 4
    assert after.prefix_pull_outcomes["pulled"] == before.prefix_pull_outcomes.get("pulled", 0) + 1
    s_state = _wait_idle(source)
    assert s_state.leases_prefixes and s_state.num_prefix_leases_opened >= 1
    assert s_state.lease_endings["pulled"] >= 1
    assert s_state.num_free_blocks == NUM_BLOCKS and not s_state.num_leases
    assert _wait_idle(target).num_free_blocks == NUM_BLOCKS
    # The pulled blocks are W's own cached blocks now: the same prompt again computes only its
    # last token there, with no pull (its own cache holds as much as S's).
    again = _generate(cluster, prompt, 1)
    assert again.outputs[0].token_ids == out.outputs[0].token_ids
    assert again.metrics.num_computed_prompt_tokens <= BLOCK
    assert again.metrics.prefix_pull is None


def test_a_source_that_does_not_answer_leaves_the_prompt_computed_and_nothing_leaked(
    cluster, model_dirs, oracle
):
    ref = oracle(model_dirs["llama"])
    source, target = _ranked(cluster)
    prefix = _prompt(3, 90)
    _generate(cluster, prefix, 0)
    time.sleep(0.5)
    prompt = prefix + _prompt(4, 13)
    pid = next(w.process.pid for w in cluster.workers if w.address == source)
    os.kill(pid, signal.SIGSTOP)
    try:
        out = _generate(cluster, prompt, 1)
    finally:
        os.kill(pid, signal.SIGCONT)
    assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
    pull = out.metrics.prefix_pull
    assert (pull.outcome, pull.reason) == ("computed", "peer_unreachable")
    assert out.metrics.num_computed_prompt_tokens == len(prompt)
    # S answered LeasePrefix late, after W's deadline: it opened no lease (or, had it, the lease
    # would end by expiry); every block is back in both pools.
    assert _wait_idle(source, 15.0).num_free_blocks == NUM_BLOCKS
    assert not worker_state(source).num_leases
    assert _wait_idle(target).num_free_blocks == NUM_BLOCKS
    assert worker_state(target).prefix_pull_outcomes["computed:peer_unreachable"] >= 1


def test_a_public_client_has_no_way_to_name_a_prefix_source():
    """The hint exists only on the internal plane (a session's submit, which needs the cluster
    credential); nothing a client sends to the router or a worker's AsyncLLM face carries it."""

    def fields(descriptor, seen):
        if descriptor.full_name in seen:
            return set()
        seen.add(descriptor.full_name)
        names = set()
        for f in descriptor.fields:
            names.add(f.name)
            if f.message_type is not None:
                names |= fields(f.message_type, seen)
        return names

    public = fields(llm_pb2.GenerateRequest.DESCRIPTOR, set())
    assert not {"prefix_source", "address"} & public
    assert "prefix_source" in fields(worker_pb2.SessionSubmit.DESCRIPTOR, set())
    assert "prefix_source" not in fields(types_pb2.DisaggregatedParams.DESCRIPTOR, set())


def test_lease_prefix_refuses_a_prefix_that_is_not_whole_blocks(cluster):
    import grpc

    from tandem.testing.cluster import channel_to
    from tandem.v1 import worker_pb2_grpc

    with channel_to(cluster.workers[0].address) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.LeasePrefix(worker_pb2.LeasePrefixRequest(token_ids=[1, 2, 3]), timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "whole KV blocks" in err.value.details()
        # A prefix nobody computed: nothing leased, no lease opened.
        reply = stub.LeasePrefix(
            worker_pb2.LeasePrefixRequest(token_ids=[9] * BLOCK * 2), timeout=10
        )
        assert reply.num_blocks == 0 and not reply.opaque_state


def test_prefixes_leased_to_peers_pin_at_most_their_share_of_the_pool(cluster):
    """--max-prefix-lease-kv-fraction (0.25: 32 of 128 blocks): a lease past the share is cut to
    what is left, then none opens, counted; each ends by ConfirmLease and the blocks come back.
    The share counts every lease's blocks, also blocks two leases share: a peer cannot hold more
    leases by asking for the same prefix again."""
    from tandem.common.limits import RequestLimits
    from tandem.testing.cluster import channel_to
    from tandem.v1 import worker_pb2_grpc

    source = _ranked(cluster)[0]
    prefix = _prompt(5, 41 * BLOCK + 3)  # 41 full blocks cached once it has run
    _generate(cluster, prefix, 0)
    _wait_idle(source)
    ask = worker_pb2.LeasePrefixRequest(token_ids=prefix[: 20 * BLOCK])
    with channel_to(source) as channel:
        stub = worker_pb2_grpc.WorkerStub(channel)
        before = worker_state(source)
        replies = [stub.LeasePrefix(ask, timeout=10) for _ in range(3)]
        assert [r.num_blocks for r in replies] == [20, 12, 0]  # 20 + 12 = 32: the share
        state = worker_state(source)
        # Both leases hold the same leading blocks (20 pinned); the share counts each lease's.
        assert state.num_leases == 2 and state.num_free_blocks == NUM_BLOCKS - 20
        assert state.num_prefix_leases_trimmed - before.num_prefix_leases_trimmed == 2
        handoffs = [worker_pb2.KvHandoff.FromString(r.opaque_state) for r in replies[:2]]
        for handoff in handoffs:
            confirmed = stub.ConfirmLease(
                worker_pb2.ConfirmLeaseRequest(ctx_request_id=handoff.ctx_request_id, pulled=False),
                timeout=10,
            )
            assert confirmed.confirmed
        assert _wait_idle(source).num_free_blocks == NUM_BLOCKS
        # The share is free again: a whole lease opens.
        again = stub.LeasePrefix(ask, timeout=10)
        assert again.num_blocks == 20
        handoff = worker_pb2.KvHandoff.FromString(again.opaque_state)
        stub.ConfirmLease(
            worker_pb2.ConfirmLeaseRequest(ctx_request_id=handoff.ctx_request_id, pulled=False),
            timeout=10,
        )
        assert _wait_idle(source).num_free_blocks == NUM_BLOCKS
    for bad in (0, 1.5):
        with pytest.raises(ValueError, match="max_prefix_lease_kv_fraction"):
            RequestLimits(max_prefix_lease_kv_fraction=bad)


@pytest.fixture(scope="module")
def split_cluster(model_dirs):
    """Two prefill workers with --kv-prefix-pulls and a decode worker: the router splits."""
    with LocalCluster(
        roles=["prefill", "prefill", "decode"],
        engine_args=_engine_args(model_dirs),
        worker_args={name: ["--kv-prefix-pulls"] for name in ("prefill-1", "prefill-2")},
        router_args=["--prefix-pulls", "--prefix-pull-min-blocks", "1"]
        + ["--prefix-compute-tokens-per-s", "1"],
    ) as c:
        yield c


def test_a_prefill_pulls_the_prefix_from_the_other_prefill_and_hands_off_the_whole_prompt(
    split_cluster, model_dirs, oracle
):
    ref = oracle(model_dirs["llama"])
    prefills = sorted(w.address for w in split_cluster.workers if w.role == "prefill")
    decode = next(w.address for w in split_cluster.workers if w.role == "decode")
    prefix = _prompt(5, 80)  # 10 full blocks

    def generate(prompt, rank):
        # Relaxed: the rank names the prefill; the one decode worker is the router's pick.
        params = SamplingParams(
            max_tokens=MAX_TOKENS, ignore_eos=True, temperature=0, return_perf_metrics=True
        )
        with LLM(split_cluster.address) as llm:
            return llm.generate(
                prompt,
                params,
                use_tqdm=False,
                scheduling_params=SchedulingParams(attention_dp_rank=rank, attention_dp_relax=True),
            )

    assert generate(prefix, 0).outputs[0].token_ids == ref.greedy(prefix, MAX_TOKENS)
    time.sleep(0.5)
    prompt = prefix + _prompt(6, 17)
    out = generate(prompt, 1)
    assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
    pull = out.metrics.prefix_pull
    assert (pull.outcome, pull.source, pull.num_pulled_blocks) == ("pulled", prefills[0], 10)
    assert out.metrics.num_computed_prompt_tokens == len(prompt) - 10 * BLOCK
    assert out.metrics.kv_handoff.outcome == "pulled"  # the decode pulled the whole prompt's KV
    assert out.outputs[0].request_perf_metrics.prefix_pull == pull
    source = _wait_idle(prefills[0])
    assert source.lease_endings["pulled"] >= 2  # the first request's handoff and the prefix lease
    for address in (*prefills, decode):
        assert _wait_idle(address).num_free_blocks == NUM_BLOCKS, address


@pytest.fixture(scope="module")
def faulty_cluster(model_dirs):
    """Two aggregated workers whose pulls fail at their second READ (2 blocks a READ), each with
    its engine core in a process of its own (LeasePrefix and the pull's reservation cross it)."""
    with LocalCluster(
        roles=["both", "both"],
        engine_args=_engine_args(model_dirs),
        worker_args={
            name: ["--kv-prefix-pulls", "--engine-process"] for name in ("both-1", "both-2")
        },
        router_args=["--prefix-pulls", "--prefix-pull-min-blocks", "1"]
        + ["--prefix-compute-tokens-per-s", "1"],
        env={"TANDEM_TEST_KV_PULL_FAULT": "2:1"},
    ) as c:
        yield c


def test_a_prefix_pull_that_fails_part_way_keeps_what_landed(faulty_cluster, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    source, target = _ranked(faulty_cluster)
    prefix = _prompt(7, 100)
    _generate(faulty_cluster, prefix, 0)
    time.sleep(0.5)
    prompt = prefix + _prompt(8, 9)
    out = _generate(faulty_cluster, prompt, 1)
    assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
    pull = out.metrics.prefix_pull
    assert (pull.outcome, pull.num_pulled_blocks) == ("partly_pulled", 2)
    assert out.metrics.num_computed_prompt_tokens == len(prompt) - 2 * BLOCK
    # The lease was confirmed after the READs (what landed is used), and nothing is left held.
    assert _wait_idle(source).lease_endings["pulled"] == 1
    assert _wait_idle(source).num_free_blocks == NUM_BLOCKS
    assert _wait_idle(target).num_free_blocks == NUM_BLOCKS
