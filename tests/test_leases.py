"""Every way a prefill worker's KV lease can end, over real processes, and the one lease table
empty afterwards: pulled by the decode, released by the router, expired, the decode falling
back to computing the prompt, requests aborted before / during / after the pull, and paused."""

from __future__ import annotations

import asyncio
import random
import time

import pytest
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, DisaggregatedParams, SamplingParams
from tandem.common.callers import SPLIT_METADATA
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc

LEASE_SECONDS = 6.0
CONTEXT_ONLY = DisaggregatedParams(request_type="context_only")


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "128",
            "--block-size",
            "8",
            "--kv-lease-seconds",
            str(LEASE_SECONDS),
        ],
    ) as c:
        c.add_router("router-no-direct", ["--no-direct-handoff"])
        yield c


def endings(cluster) -> dict[str, int]:
    return dict(worker_state(cluster.workers[0].address).lease_endings)


def wait_for(predicate, timeout: float):
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value or time.monotonic() > deadline:
            return value
        time.sleep(0.05)


def ended_by(cluster, before: dict[str, int], way: str, timeout: float = 5.0) -> bool:
    return wait_for(lambda: endings(cluster).get(way, 0) > before.get(way, 0), timeout)


def test_pulled(cluster):
    before = endings(cluster)
    with LLM(cluster.address) as llm:
        out = llm.generate(
            "pulled by the decode", SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False
        )
    assert len(out.outputs[0].token_ids) == 6
    assert ended_by(cluster, before, "pulled")


@pytest.mark.parametrize("direct", [False, True])
def test_released_by_the_router_when_a_stop_string_ends_the_first_token(cluster, direct):
    """The router's text front finds a stop string in the context phase's token: no decode phase;
    the router's ReleaseKv ends the lease at once. With the prefill's handoff straight to the
    announced decode (the default router), the decode may have pulled it meanwhile: the lease
    ends released, pulled or fallback (the decode's pull cancelled), and the decode computes
    nothing and sends nothing."""
    address = cluster.address if direct else cluster.service("router-no-direct").address
    with LLM(address) as llm:
        for i in range(40):  # a prompt whose first token decodes to printable text of its own
            prompt = f"stop at once {i}"
            first = llm.generate(prompt, SamplingParams(max_tokens=1), use_tqdm=False).outputs[0]
            if first.text.strip() and first.text.isprintable():
                break
        else:
            pytest.fail("no prompt among 40 starts with a printable token")
        before = endings(cluster)
        out = llm.generate(
            prompt, SamplingParams(max_tokens=8, ignore_eos=True, stop=[first.text]), use_tqdm=False
        ).outputs[0]
    # The stop string is the whole first token: trimmed from token_ids, as TensorRT-LLM does.
    assert out.finish_reason == "stop" and out.stop_reason == first.text and out.token_ids == []
    # With the direct handoff the decode may be pulling when the router drops it: it ends the
    # lease itself then (fallback: not read), or had pulled it already.
    ways = ("released", "pulled", "fallback") if direct else ("released",)
    assert wait_for(lambda: any(ended_by(cluster, before, way, 0) for way in ways), 5.0)
    decode = worker_state(cluster.workers[1].address)
    assert decode.num_prompt_tokens_computed == 0  # no decode phase computed anything
    assert wait_for(lambda: worker_state(cluster.workers[1].address).num_active_requests == 0, 5.0)


def test_expired_and_decode_fell_back(cluster):
    """A handoff nobody pulls expires; one presented with less than a second of lease left is not
    pulled: the decode computes the prompt itself and tells the prefill to free its copy."""
    with (
        LLM(cluster.address) as llm,
        LLM(cluster.workers[1].address, **cluster.worker_client_kwargs()) as decode,
    ):
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        expected = llm.generate("fall back", params, use_tqdm=False).outputs[0].token_ids
        before = endings(cluster)
        outcomes_before = worker_state(cluster.workers[1].address).kv_handoff_outcomes
        llm.generate("nobody pulls this", params, use_tqdm=False, disaggregated_params=CONTEXT_ONLY)
        ctx = llm.generate("fall back", params, use_tqdm=False, disaggregated_params=CONTEXT_ONLY)
        h = ctx.outputs[0].disaggregated_params
        expires_at = worker_pb2.KvHandoff.FromString(h.opaque_state).lease_expires_at
        time.sleep(
            max(0.0, expires_at - time.time() - 0.5)
        )  # inside the decode's margin, before the prefill frees
        gen = decode.generate(
            ctx.prompt_token_ids,
            params,
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(
                request_type="generation_only",
                first_gen_tokens=h.first_gen_tokens,
                ctx_request_id=h.ctx_request_id,
                opaque_state=h.opaque_state,
            ),
        )
    assert gen.outputs[0].token_ids == expected  # the first token included, as TensorRT-LLM
    assert ended_by(cluster, before, "fallback")
    # The decode counts why it computed the prompt itself (and logs it).
    outcomes = worker_state(cluster.workers[1].address).kv_handoff_outcomes
    assert (
        outcomes["recomputed:lease_expiring"]
        == outcomes_before.get("recomputed:lease_expiring", 0) + 1
    )
    assert f"(lease_expiring); decode {cluster.workers[1].address} computes" in cluster.workers[
        1
    ].log_path.read_text(errors="replace")
    assert ended_by(cluster, before, "expired", timeout=LEASE_SECONDS + 3)


def test_aborted_before_during_and_after_the_pull(cluster):
    rng = random.Random(11)

    async def one(aio, i: int) -> str:
        result = aio.generate_async(
            f"abort me {i}", SamplingParams(max_tokens=30, ignore_eos=True), streaming=True
        )
        abort_after = rng.choice([0, 0, 1, 2, 5])  # messages seen before the abort
        if abort_after == 0:
            await asyncio.sleep(rng.uniform(0, 0.05))
            result.abort()
        seen = 0
        async for _ in result:
            seen += 1
            if seen == abort_after:
                result.abort()
        return (await result).outputs[0].finish_reason

    async def storm() -> list[str]:
        aio = await AsyncLLM(cluster.address)
        try:
            return await asyncio.gather(*(asyncio.wait_for(one(aio, i), 30) for i in range(24)))
        finally:
            aio.close()

    state = worker_state(cluster.workers[0].address)
    opened_before = state.num_leases_opened
    reasons = asyncio.run(storm())
    assert "cancelled" in reasons
    state = wait_for(
        lambda: (s := worker_state(cluster.workers[0].address)).num_leases == 0 and s, timeout=5
    )
    assert state, "leases still out seconds after their requests ended (long before they expire)"
    assert state.num_leases_opened > opened_before


def test_a_split_whose_reply_the_router_lost_is_released_by_its_disagg_request_id(cluster):
    """The router cancels a split's context call when its client aborts: if the prefill had just
    finished, its reply (the handoff) is lost with the call. The router then names the split's
    disagg_request_id; the prefill frees that lease at once rather than at its expiry."""
    prefill = cluster.workers[0].address
    request = llm_pb2.GenerateRequest(request_id="lost-reply")
    request.prompt.token_ids.ids[:] = [1, 5, 6, 7, 8, 9, 10, 11, 12]
    request.sampling_params.max_tokens = 4
    request.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
    request.disaggregated_params.disagg_request_id = 7_000_001
    with cluster.channel(prefill) as channel:
        (reply,) = list(
            llm_pb2_grpc.AsyncLLMStub(channel).Generate(
                request, metadata=((SPLIT_METADATA, "1"),), timeout=30
            )
        )
        assert reply.outputs[0].disaggregated_params.opaque_state  # a lease is out
        before = endings(cluster)
        internal = worker_pb2_grpc.WorkerStub(channel)
        other = internal.ReleaseKv(
            worker_pb2.ReleaseKvRequest(disagg_request_id=7_000_002), timeout=10
        )
        released = internal.ReleaseKv(
            worker_pb2.ReleaseKvRequest(disagg_request_id=7_000_001), timeout=10
        )
        again = internal.ReleaseKv(
            worker_pb2.ReleaseKvRequest(disagg_request_id=7_000_001), timeout=10
        )
    assert (other.released, released.released, again.released) == (False, True, False)
    assert endings(cluster).get("released", 0) == before.get("released", 0) + 1
    assert worker_state(prefill).num_leases == 0


def test_a_client_handoff_is_not_released_by_its_disagg_request_id(cluster):
    """A client's own context_only request may carry any disagg_request_id (TensorRT-LLM's
    field): only the router's splits, whose ids the router draws, are released by it."""
    with LLM(cluster.address) as llm:
        ctx = llm.generate(
            "keep my handoff",
            SamplingParams(max_tokens=4),
            use_tqdm=False,
            disaggregated_params=DisaggregatedParams(
                request_type="context_only", disagg_request_id=7_000_003
            ),
        )
    handoff = ctx.outputs[0].disaggregated_params
    with cluster.channel(cluster.workers[0].address) as channel:
        internal = worker_pb2_grpc.WorkerStub(channel)
        by_disagg = internal.ReleaseKv(
            worker_pb2.ReleaseKvRequest(disagg_request_id=7_000_003), timeout=10
        )
        by_lease = internal.ReleaseKv(
            worker_pb2.ReleaseKvRequest(ctx_request_id=handoff.ctx_request_id), timeout=10
        )
    assert (by_disagg.released, by_lease.released) == (False, True)


def test_paused(cluster):
    with LLM(cluster.address) as llm:
        before = endings(cluster)
        llm.generate(
            "pause me",
            SamplingParams(max_tokens=4),
            use_tqdm=False,
            disaggregated_params=CONTEXT_ONLY,
        )
        assert worker_state(cluster.workers[0].address).num_leases >= 1

        async def pause_and_resume():
            aio = await AsyncLLM(cluster.address)
            try:
                await aio.pause_generation()
                await aio.resume_generation()
            finally:
                aio.close()

        asyncio.run(pause_and_resume())
    assert ended_by(cluster, before, "paused", timeout=1)


def test_the_lease_table_is_empty_afterwards(cluster):
    """Runs last in this module: every lease any test opened has ended, and each one once."""
    state = wait_for(
        lambda: (s := worker_state(cluster.workers[0].address)).num_leases == 0 and s,
        timeout=LEASE_SECONDS + 3,
    )
    assert state and state.num_leased_blocks == 0
    assert sum(state.lease_endings.values()) == state.num_leases_opened
    assert {"pulled", "released", "expired", "fallback", "paused"} <= set(state.lease_endings)
    for worker in cluster.workers:
        s = wait_for(
            lambda: (w := worker_state(worker.address)).num_free_blocks == w.num_total_blocks and w,
            5,
        )
        assert s and s.num_active_requests == 0, worker.address
