"""An attacker against a running 1 prefill + 1 decode cluster with credentials (a cluster
token, which every split cluster has, and an admin token), over real processes and sockets.

The attacker is a client without tokens, and it runs a NIXL agent of its own (as
test_kvtransfer.py does). It gets nothing: no transceiver state (the NIXL memory keys), no KV
events (other tenants' token ids), no worker RPC, no lease freed by its notifications (even
holding leaked agent metadata), no replayed handoff used once its lease has ended (the victim's
greedy output stays right), no connection to an address it forges into a handoff.
"""

from __future__ import annotations

import asyncio
import socket
import time

import grpc
import pytest
import torch
from conftest import assert_all_blocks_free
from test_disagg import worker_state

from tandem.client import LLM, DisaggregatedParams, RequestError, SamplingParams
from tandem.kvtransfer import TransceiverState
from tandem.testing.cluster import LocalCluster
from tandem.v1 import internal_pb2, llm_pb2, llm_pb2_grpc, worker_pb2, worker_pb2_grpc

ADMIN_TOKEN = "attacker-test-admin-token"
BLOCK_SIZE = 8
NUM_BLOCKS = 32
GREEDY = SamplingParams(max_tokens=8, ignore_eos=True)
CONTEXT_ONLY = DisaggregatedParams(request_type="context_only")

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            str(NUM_BLOCKS),
            "--block-size",
            str(BLOCK_SIZE),
            "--kv-lease-seconds",
            "60",
        ],
        env={"TANDEM_ADMIN_TOKEN": ADMIN_TOKEN},
    ) as c:
        yield c


@pytest.fixture(autouse=True)
def no_leaked_blocks(cluster):
    yield
    with LLM(cluster.address) as llm:
        assert_all_blocks_free(llm)


def _refused(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


# Every RPC that exposes the internal plane, as (service stub, method, request).
INTERNAL_CALLS = [
    (
        llm_pb2_grpc.AsyncLLMStub,
        "GetDataTransceiverState",
        llm_pb2.GetDataTransceiverStateRequest(),
    ),
    (llm_pb2_grpc.AsyncLLMStub, "GetKvCacheEvents", llm_pb2.EventsRequest(timeout=0.1)),
    (llm_pb2_grpc.AsyncLLMStub, "StreamKvCacheEvents", llm_pb2.EventsRequest(timeout=0.1)),
    (llm_pb2_grpc.AsyncLLMStub, "GetStats", llm_pb2.EventsRequest(timeout=0.1)),
    (llm_pb2_grpc.AsyncLLMStub, "Generate", llm_pb2.GenerateRequest()),
    (worker_pb2_grpc.WorkerStub, "GetWorkerState", worker_pb2.WorkerStateRequest()),
    (worker_pb2_grpc.WorkerStub, "ReleaseKv", worker_pb2.ReleaseKvRequest(ctx_request_id=1)),
    (worker_pb2_grpc.WorkerStub, "StopSequences", worker_pb2.StopSequencesRequest(request_id="x")),
    (
        worker_pb2_grpc.WorkerStub,
        "ConfirmLease",
        worker_pb2.ConfirmLeaseRequest(ctx_request_id=1, pulled=True),
    ),
    (worker_pb2_grpc.WorkerStub, "SubscribeKvBlocks", worker_pb2.SubscribeKvBlocksRequest()),
    # A peer's lease on our cached prefix (cross-worker prefix pulls).
    (worker_pb2_grpc.WorkerStub, "LeasePrefix", worker_pb2.LeasePrefixRequest(token_ids=[1] * 8)),
    # A prefill's handoffs straight to an announced decode: a stream of requests.
    (
        worker_pb2_grpc.WorkerStub,
        "HandOff",
        worker_pb2.HandOffRequest(disagg_request_id=1, kv_params=internal_pb2.KvParams()),
    ),
    # The router's channel for Generates: a stream of requests (a submit here).
    (
        worker_pb2_grpc.WorkerStub,
        "Session",
        worker_pb2.SessionRequest(
            submits=[
                worker_pb2.SessionSubmit(
                    tag=1,
                    request=internal_pb2.EngineRequest(prompt_token_ids=[1, 2]),
                )
            ]
        ),
    ),
]
STREAMS = {"StreamKvCacheEvents", "Generate", "SubscribeKvBlocks", "Session"}


def _call(channel, stub_type, method, request, metadata=()):
    argument = iter([request]) if method in ("Session", "HandOff") else request
    result = getattr(stub_type(channel), method)(argument, metadata=metadata, timeout=10)
    return list(result) if method in STREAMS else result


def test_workers_refuse_every_call_without_the_cluster_token(cluster):
    """26 calls on each worker (13 RPCs, no token and a wrong one): all refused."""
    for worker in cluster.workers:
        with grpc.insecure_channel(worker.address) as channel:
            for stub_type, method, request in INTERNAL_CALLS:
                assert (
                    _refused(lambda: _call(channel, stub_type, method, request))
                    == grpc.StatusCode.UNAUTHENTICATED
                )
                wrong = (("tandem-cluster-token", "x" * 32),)
                assert (
                    _refused(lambda: _call(channel, stub_type, method, request, wrong))
                    == grpc.StatusCode.PERMISSION_DENIED
                ), method


def test_the_router_keeps_memory_keys_and_kv_events_to_the_admin(cluster):
    with grpc.insecure_channel(cluster.address) as channel:
        for stub_type, method, request in INTERNAL_CALLS[:3]:
            assert (
                _refused(lambda: _call(channel, stub_type, method, request))
                == grpc.StatusCode.UNAUTHENTICATED
            )
            bad = (("authorization", "Bearer guessed"),)
            assert (
                _refused(lambda: _call(channel, stub_type, method, request, bad))
                == grpc.StatusCode.PERMISSION_DENIED
            )
    with LLM(cluster.address, auth_token=ADMIN_TOKEN) as admin:  # the admin has them
        assert (
            TransceiverState.from_bytes(admin.get_data_transceiver_state()).num_blocks == NUM_BLOCKS
        )
        admin.generate("an event", SamplingParams(max_tokens=1), use_tqdm=False)
        assert admin.get_kv_cache_events(timeout=2)


def _handoff(llm, prompt) -> tuple[list[int], DisaggregatedParams]:
    ctx = llm.generate(prompt, GREEDY, use_tqdm=False, disaggregated_params=CONTEXT_ONLY)
    return ctx.prompt_token_ids, ctx.outputs[0].disaggregated_params


def _generation_only(
    llm, prompt_ids, handoff: DisaggregatedParams, opaque_state: bytes | None = None
):
    params = DisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=handoff.first_gen_tokens,
        ctx_request_id=handoff.ctx_request_id,
        opaque_state=handoff.opaque_state if opaque_state is None else opaque_state,
    )
    out = llm.generate(prompt_ids, GREEDY, use_tqdm=False, disaggregated_params=params)
    return list(out.outputs[0].token_ids)  # it starts with the context phase's first token


def test_notifications_from_an_outside_nixl_agent_free_no_lease(cluster):
    """Even with the prefill's agent metadata leaked to it, an outside agent's release
    notifications are dropped: the victim's lease stays live and its handoff works."""
    from nixl._api import nixl_agent, nixl_agent_config

    prefill = cluster.workers[0].address
    with cluster.channel(prefill) as channel:  # the leak: what the attacker could not fetch itself
        state = TransceiverState.from_bytes(
            llm_pb2_grpc.AsyncLLMStub(channel)
            .GetDataTransceiverState(llm_pb2.GetDataTransceiverStateRequest(), timeout=10)
            .state
        )
    with LLM(cluster.address) as llm:
        prompt_ids, victim = _handoff(llm, "the victim's lease")
        before = worker_state(prefill)
        agent = nixl_agent("attacker", nixl_agent_config(backends=["UCX"]))
        pool = torch.zeros(4096, dtype=torch.uint8)
        registration = agent.register_memory(pool)
        name = agent.add_remote_agent(state.agent_metadata)
        name = name.decode() if isinstance(name, bytes) else name
        messages = [
            f"release:{victim.ctx_request_id}:pulled".encode(),
            f"release:{victim.ctx_request_id}:fallback".encode(),
        ]
        messages += [f"release:{lease_id}:pulled".encode() for lease_id in range(1, 33)]  # guessing
        try:
            for message in messages:
                agent.send_notif(name, message)
            deadline = time.monotonic() + 10
            while worker_state(
                prefill
            ).num_ignored_notifications < before.num_ignored_notifications + len(messages):
                assert time.monotonic() < deadline, (
                    "the prefill never received the attacker's notifications"
                )
                time.sleep(0.05)
        finally:
            agent.remove_remote_agent(name)
            agent.deregister_memory(registration)
        after = worker_state(prefill)
        assert after.num_leases == before.num_leases >= 1
        assert dict(after.lease_endings) == dict(before.lease_endings)
        # The victim's handoff is intact: pulled and confirmed now, with the right tokens.
        tokens = _generation_only(llm, prompt_ids, victim)
        assert worker_state(prefill).lease_endings["pulled"] == before.lease_endings["pulled"] + 1
        assert tokens == _whole(llm, prompt_ids)


def _whole(llm, prompt_ids) -> list[int]:
    return llm.generate(prompt_ids, GREEDY, use_tqdm=False).outputs[0].token_ids


def test_a_replayed_handoff_is_recomputed_never_cached(cluster):
    """The attacker pulls its handoff once (the lease ends), lets other requests reuse the
    prefill's blocks and evict the decode's copy, then replays the handoff: the decode reads
    foreign KV but its confirm fails, so it drops it and computes the prompt. A victim's later
    request for the same prompt is not poisoned."""
    prompt = [1] + [(11 * i) % 250 + 4 for i in range(40)]  # 5 full blocks of 8 and a tail
    fillers = [[1] + [(13 * i + 7 * j) % 250 + 4 for i in range(100)] for j in range(1, 6)]
    decode = cluster.workers[1].address
    with LLM(cluster.address) as attacker, LLM(cluster.address) as victim:
        prompt_ids, handoff = _handoff(attacker, prompt)
        first = _generation_only(attacker, prompt_ids, handoff)  # genuine: pulled and confirmed
        for filler in fillers:  # 13 blocks each: every block of both pools is reused
            attacker.generate(filler, SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)
        before = worker_state(decode)
        replayed = _generation_only(attacker, prompt_ids, handoff)
        after = worker_state(decode)
        assert after.num_unconfirmed_handoffs == before.num_unconfirmed_handoffs + 1
        assert after.kv_handoff_outcomes["recomputed:unconfirmed"] == (
            before.kv_handoff_outcomes.get("recomputed:unconfirmed", 0) + 1
        )
        assert (
            after.kv_bytes_received > before.kv_bytes_received
        )  # it did read, and dropped what it read
        assert replayed == first
        assert victim.generate(prompt_ids, GREEDY, use_tqdm=False).outputs[0].token_ids == first


def test_a_forged_endpoint_makes_the_decode_connect_nowhere(cluster):
    with socket.socket() as trap, LLM(cluster.address) as llm:
        trap.bind(("127.0.0.1", 0))
        trap.listen()
        trap.settimeout(1.0)
        prompt_ids, handoff = _handoff(llm, "forged endpoint")
        forged = worker_pb2.KvHandoff.FromString(handoff.opaque_state)
        forged.ctx_endpoint = f"127.0.0.1:{trap.getsockname()[1]}"
        unsigned = worker_pb2.KvHandoff()
        unsigned.CopyFrom(forged)
        unsigned.signature = b""
        for opaque in (forged.SerializeToString(), unsigned.SerializeToString()):
            with pytest.raises(RequestError) as err:
                _generation_only(llm, prompt_ids, handoff, opaque)
            assert (
                err.value.code == grpc.StatusCode.FAILED_PRECONDITION
                and "signature" in err.value.details
            )
        with pytest.raises(socket.timeout):
            trap.accept()
        _generation_only(
            llm, prompt_ids, handoff
        )  # the genuine one still works (and ends the lease)


def test_kv_events_stream_refused_to_a_tokenless_client(cluster):
    """The client library's streaming KV events: refused, nothing leaks before the refusal."""

    async def stream():
        llm = LLM(cluster.address)
        try:
            return [e async for e in llm.get_kv_cache_events_async(timeout=2)]
        finally:
            llm.close()

    with pytest.raises(RequestError) as err:
        asyncio.run(stream())
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
