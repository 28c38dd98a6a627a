"""The router announces a split's generation phase to its decode worker when the context phase
starts (SessionSubmit.awaits_handoff); only the handoff crosses after it (SessionRequest.handoffs).

In-process: the worker's Session hands each announced request its handoff, ignores a handoff for
a tag that is not waiting, and drops (uncounted) an announcement cancelled before its handoff.
Real processes: the split with and without announcing (--no-announce-decode) gives the aggregated
worker's greedy tokens and pulls the KV; a request that ends in the context phase, and one whose
context phase fails, leave the decode with nothing running, no block held and no Generate counted."""

from __future__ import annotations

import asyncio
import random

import grpc
import pytest
from test_disagg import worker_state
from test_metrics import scrape, value

from tandem.client import LLM, RequestError, SamplingParams
from tandem.common.engine_messages import engine_request
from tandem.testing.cluster import LocalCluster
from tandem.v1 import internal_pb2, llm_pb2, types_pb2, worker_pb2


def _announced(tag: int) -> worker_pb2.SessionSubmit:
    request = llm_pb2.GenerateRequest(request_id=f"r{tag}")
    request.prompt.token_ids.ids.extend([1, 5, 7])
    request.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
    return worker_pb2.SessionSubmit(tag=tag, request=engine_request(request), awaits_handoff=True)


def test_the_session_hands_each_announced_request_its_handoff():
    from tandem.common.drain import InFlightCalls
    from tandem.worker import session_server

    got: dict[int, internal_pb2.KvParams] = {}
    counted: list[grpc.StatusCode] = []

    async def run(submit, stream, owner, handoff=None):
        assert submit.awaits_handoff == (handoff is not None)
        got[submit.tag] = await handoff

    async def main():
        in_flight = InFlightCalls()
        session = session_server.Session(
            "owner", run, in_flight, lambda method, code: counted.append(code), 1 << 20
        )
        messages: asyncio.Queue = asyncio.Queue()

        async def requests():
            while (message := await messages.get()) is not None:
                yield message

        reader = asyncio.create_task(session.read(requests()))
        await messages.put(worker_pb2.SessionRequest(submits=[_announced(1), _announced(2)]))
        await asyncio.sleep(0.05)
        assert sorted(session.handoffs) == [1, 2] and in_flight.count == 2 and not got
        params = internal_pb2.KvParams(first_gen_tokens=[42], ctx_request_id=7)
        await messages.put(
            worker_pb2.SessionRequest(
                handoffs=[
                    worker_pb2.SessionHandoff(tag=9, kv_params=params),  # no such tag: ignored
                    worker_pb2.SessionHandoff(tag=1, kv_params=params),
                ]
            )
        )
        await asyncio.sleep(0.05)
        assert list(got) == [1] and list(got[1].first_gen_tokens) == [42]
        assert counted == [grpc.StatusCode.OK] and sorted(session.handoffs) == [2]
        # Cancelled before its handoff (the context phase failed or ended the request): dropped,
        # no call counted; a late handoff for it is ignored.
        await messages.put(worker_pb2.SessionRequest(cancels=[2]))
        await asyncio.sleep(0.05)
        await messages.put(
            worker_pb2.SessionRequest(handoffs=[worker_pb2.SessionHandoff(tag=2, kv_params=params)])
        )
        await asyncio.sleep(0.05)
        assert list(got) == [1] and counted == [grpc.StatusCode.OK]
        assert not session.handoffs and not session.tasks and in_flight.count == 0
        await messages.put(None)
        await asyncio.wait_for(reader, 5)

    asyncio.run(main())


def test_a_message_with_too_many_handoffs_ends_the_session(monkeypatch):
    from tandem.common.drain import InFlightCalls
    from tandem.common.errors import RpcError
    from tandem.worker import session_server

    monkeypatch.setattr(session_server, "MAX_REQUESTS_PER_SESSION", 2)

    async def main():
        session = session_server.Session(
            "owner", None, InFlightCalls(), lambda method, code: None, 1 << 20
        )

        async def requests():
            yield worker_pb2.SessionRequest(
                handoffs=[worker_pb2.SessionHandoff(tag=t) for t in range(3)]
            )

        with pytest.raises(RpcError) as err:
            await session.read(requests())
        assert (
            err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "3 handoffs" in err.value.message
        )

    asyncio.run(main())


@pytest.fixture(scope="module")
def split(model_dirs):
    """prefill + decode + an aggregated worker; the default router announces, a second one does not."""
    engine_args = ["--model", str(model_dirs["llama"]), "--num-blocks", "128", "--block-size", "8"]
    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=engine_args,
        # The prefill takes shorter prompts than the decode: a context phase that fails.
        worker_args={"prefill-1": ["--max-model-len", "64"]},
    ) as c:
        unannounced = c.add_router("router-unannounced", ["--no-announce-decode"])
        with (
            LLM(c.address) as llm,
            LLM(unannounced.address) as llm_unannounced,
            LLM(c.workers[2].address, **c.worker_client_kwargs()) as aggregated,
        ):
            yield c, llm, llm_unannounced, aggregated


def _decode_generates(cluster) -> float:
    decode = next(s for s in cluster.services if s.role == "decode")
    return value(scrape(decode), "tandem:grpc_server_handled_total", grpc_method="Generate")


def _leak_free(cluster) -> None:
    for worker in cluster.workers:
        state = worker_state(worker.address)
        assert state.num_free_blocks == state.num_total_blocks and state.num_active_requests == 0


def test_announced_and_unannounced_splits_give_the_aggregated_tokens(split):
    cluster, llm, llm_unannounced, aggregated = split
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(4, 250) for _ in range(rng.randrange(8, 50))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in aggregated.generate(prompts, params, use_tqdm=False)]
    before = worker_state(cluster.workers[1].address).kv_handoff_outcomes["pulled"]
    for client in (llm, llm_unannounced):
        outs = client.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.metrics.kv_handoff.outcome == "pulled" for o in outs)
        assert all(o.metrics.served_by[-1] == cluster.workers[1].address for o in outs)
    assert worker_state(cluster.workers[1].address).kv_handoff_outcomes["pulled"] == before + 12
    _leak_free(cluster)


def test_an_announcement_the_context_phase_ends_or_fails_is_dropped(split):
    cluster, llm, _, _ = split
    generates = _decode_generates(cluster)
    # Ends in the context phase: the decode's announced request is dropped, no call counted.
    out = llm.generate([1, 5, 9, 11], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.metrics.served_by == [cluster.workers[0].address]
    # The prefill refuses the prompt (its --max-model-len 64): the client gets the prefill's error.
    with pytest.raises(RequestError) as err:
        llm.generate([1] + [7] * 80, SamplingParams(max_tokens=4), use_tqdm=False)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT and "64" in err.value.details
    _leak_free(cluster)
    assert _decode_generates(cluster) == generates
    # The decode still serves the next split.
    out = llm.generate([1, 5, 9, 11], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.metrics.kv_handoff.outcome == "pulled"
    assert _decode_generates(cluster) == generates + 1
