"""The router announces a split's generation phase to its decode worker when the context phase
starts (SessionSubmit.awaits_handoff); only the handoff crosses after it (SessionRequest.handoffs).

In-process: the worker's Session hands each announced request its handoff, ignores a handoff for
a tag that is not waiting, and drops (uncounted) an announcement cancelled before its handoff.
Real processes: the split with and without announcing (--no-announce-decode) gives the aggregated
worker's greedy tokens and pulls the KV; a request that ends in the context phase leaves the
decode with nothing running, no block held and no Generate counted; a decode that refuses its
announcement gets the request whole (the error it would have given unannounced)."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from test_disagg import worker_state
from test_metrics import scrape, value

from tandem.client import LLM, AsyncLLM, RequestError, SamplingParams
from tandem.common.engine_messages import engine_request
from tandem.testing.cluster import LocalCluster
from tandem.v1 import internal_pb2, llm_pb2, types_pb2, worker_pb2


def _announced(tag: int) -> worker_pb2.SessionSubmit:
    request = llm_pb2.GenerateRequest(request_id=f"r{tag}")
    request.prompt.token_ids.ids.extend([1, 5, 7])
    request.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
    return worker_pb2.SessionSubmit(tag=tag, request=engine_request(request), awaits_handoff=True)


async def _two_announced(run, in_flight, counted: list):
    """A session (run: its RunSubmitted) given announced requests of tags 1 and 2: (the session,
    the queue its caller's messages go on, None ending them, the reading task)."""
    from tandem.worker import session_server

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
    return session, messages, reader


def test_the_session_hands_each_announced_request_its_handoff():
    from tandem.common.drain import InFlightCalls

    got: dict[int, internal_pb2.KvParams] = {}
    counted: list[grpc.StatusCode] = []

    async def run(submit, stream, owner, handoff=None):
        assert submit.awaits_handoff == (handoff is not None)
        got[submit.tag], from_prefill = await handoff
        assert not from_prefill

    async def main():
        in_flight = InFlightCalls()
        session, messages, reader = await _two_announced(run, in_flight, counted)
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


def test_the_prefills_handoff_goes_first_and_the_routers_must_match_it():
    """A prefill's handoff (Worker/HandOff) takes the announced request's future by its split id;
    the router's that follows is ignored when it is the same handoff and cancels the request
    when it differs; ids nobody awaits, or awaited twice, are not taken."""
    from tandem.common.drain import InFlightCalls
    from tandem.decode.awaited_handoffs import AwaitedHandoffs

    awaited = AwaitedHandoffs()
    got: dict[int, tuple] = {}
    counted: list[grpc.StatusCode] = []
    release = asyncio.Event()

    async def run(submit, stream, owner, handoff=None):
        split_id = 100 + submit.tag
        assert awaited.register(split_id, handoff)
        assert not awaited.register(split_id, handoff)  # one request per split id
        try:
            got[submit.tag] = await handoff
            await release.wait()
        finally:
            awaited.forget(split_id, handoff)

    async def main():
        session, messages, reader = await _two_announced(run, InFlightCalls(), counted)
        params = internal_pb2.KvParams(first_gen_tokens=[42], opaque_state=b"signed")
        # The same signed state with another first token (first tokens are not signed).
        other = internal_pb2.KvParams(first_gen_tokens=[43], opaque_state=b"signed")
        assert not awaited.hand_off(999, params)  # nobody awaits it
        assert awaited.hand_off(101, params) and awaited.hand_off(102, params)
        assert not awaited.hand_off(101, params)  # taken already
        await asyncio.sleep(0)
        assert got[1] == (params, True) and got[2] == (params, True)
        # The router's handoffs follow: tag 1's is the same (ignored), tag 2's differs.
        await messages.put(
            worker_pb2.SessionRequest(
                handoffs=[
                    worker_pb2.SessionHandoff(tag=1, kv_params=params),
                    worker_pb2.SessionHandoff(tag=2, kv_params=other),
                ]
            )
        )
        await asyncio.sleep(0.05)
        assert sorted(session.tasks) == [1]  # tag 2 was cancelled
        release.set()
        await asyncio.sleep(0.05)
        assert not session.tasks and len(awaited) == 0
        assert sorted(counted, key=str) == [grpc.StatusCode.CANCELLED, grpc.StatusCode.OK]
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
    """prefill + decode + an aggregated worker; the default router announces (and its prefill
    hands off to the decode itself), a second one does not announce, a third announces but hands
    off itself only."""
    engine_args = ["--model", str(model_dirs["llama"]), "--num-blocks", "128", "--block-size", "8"]
    with LocalCluster(roles=["prefill", "decode", "both"], engine_args=engine_args) as c:
        unannounced = c.add_router("router-unannounced", ["--no-announce-decode"])
        routed = c.add_router("router-no-direct", ["--no-direct-handoff"])
        with (
            LLM(c.address) as llm,
            LLM(unannounced.address) as llm_unannounced,
            LLM(routed.address) as llm_routed,
            LLM(c.workers[2].address, **c.worker_client_kwargs()) as aggregated,
        ):
            # A router opens its session to a worker on first use: the first split of a cold
            # router is not announced (the session opens meanwhile).
            for client in (llm, llm_unannounced, llm_routed):
                client.generate([1, 5, 9], SamplingParams(max_tokens=2), use_tqdm=False)
            yield c, llm, llm_unannounced, aggregated, llm_routed


def _decode_generates(cluster) -> float:
    decode = next(s for s in cluster.services if s.role == "decode")
    return value(scrape(decode), "tandem:grpc_server_handled_total", grpc_method="Generate")


def _announcements(service, outcome: str) -> float:
    return value(scrape(service), "tandem:router_decode_announcements_total", outcome=outcome)


def _leak_free(cluster) -> None:
    for worker in cluster.workers:
        state = worker_state(worker.address)
        assert state.num_free_blocks == state.num_total_blocks and state.num_active_requests == 0


def test_announced_and_unannounced_splits_give_the_aggregated_tokens(split):
    cluster, llm, llm_unannounced, aggregated, llm_routed = split
    rng = random.Random(7)
    prompts = [[1] + [rng.randrange(4, 250) for _ in range(rng.randrange(8, 50))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    want = [o.outputs[0].token_ids for o in aggregated.generate(prompts, params, use_tqdm=False)]
    before = worker_state(cluster.workers[1].address).kv_handoff_outcomes["pulled"]
    unannounced = cluster.service("router-unannounced")
    handed_off = _announcements(cluster.router, "handed_off")
    for client in (llm, llm_unannounced, llm_routed):
        outs = client.generate(prompts, params, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        assert all(o.metrics.kv_handoff.outcome == "pulled" for o in outs)
        # Announced: the decode reserved the blocks while the prompt was computed.
        early = [o.metrics.kv_handoff.reserved_early for o in outs]
        assert early == [client is not llm_unannounced] * len(outs)
        # Only the default router's prefills send the handoff to the announced decode themselves.
        if client is not llm:
            assert not any(o.metrics.kv_handoff.from_prefill for o in outs)
        assert all(o.metrics.served_by[-1] == cluster.workers[1].address for o in outs)
    # One at a time, the prefill's handoff comes ahead of the router's (a batch's handoffs race
    # the router's, which come in one message; on this 2-core machine a few lose).
    outs = [llm.generate(p, params, use_tqdm=False) for p in prompts]
    assert [o.outputs[0].token_ids for o in outs] == want
    assert any(o.metrics.kv_handoff.from_prefill for o in outs)
    assert worker_state(cluster.workers[1].address).kv_handoff_outcomes["pulled"] == before + 24
    # The announcing routers announced each split; the other one none.
    assert _announcements(cluster.router, "handed_off") == handed_off + 12
    assert _announcements(cluster.service("router-no-direct"), "handed_off") >= 6
    assert _announcements(unannounced, "handed_off") == 0
    _leak_free(cluster)


def test_an_announcement_the_context_phase_ends_is_dropped(split):
    cluster, llm, _, _, _ = split
    generates = _decode_generates(cluster)
    dropped = _announcements(cluster.router, "dropped")
    # Ends in the context phase: the decode's announced request is dropped, no call counted.
    out = llm.generate([1, 5, 9, 11], SamplingParams(max_tokens=1), use_tqdm=False)
    assert out.metrics.served_by == [cluster.workers[0].address]
    _leak_free(cluster)
    assert _decode_generates(cluster) == generates
    assert _announcements(cluster.router, "dropped") == dropped + 1
    # The decode still serves the next split.
    out = llm.generate([1, 5, 9, 11], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 6 and out.metrics.kv_handoff.outcome == "pulled"
    assert _decode_generates(cluster) == generates + 1


class _FakeCall:
    """A Session call that records what the router writes and never answers."""

    def __init__(self):
        self.written: list[worker_pb2.SessionRequest] = []
        self._never = asyncio.Event()

    async def write(self, message):
        self.written.append(message)

    async def read(self):
        await self._never.wait()

    def cancel(self):
        pass


def test_a_handoff_is_written_after_its_submit_and_dropped_with_a_cancel():
    from tandem.router.session_client import OpenSession

    def gen(tag: int, prompt_len: int) -> llm_pb2.GenerateRequest:
        request = llm_pb2.GenerateRequest(request_id=f"r{tag}")
        request.prompt.token_ids.ids.extend(range(1, prompt_len + 1))
        request.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        return request

    handoff = types_pb2.DisaggregatedParams(first_gen_tokens=[3], opaque_state=b"x" * 30)

    async def main():
        call = _FakeCall()
        # A message holds ~1 KB: the 600-token submit of t2 does not fit after t1's and goes in
        # the next message; t2's small handoff would fit in the first but waits for its submit.
        session = OpenSession(
            call, "s", max_message_bytes=1024, max_request_bytes=1 << 20, takes_handoffs=True
        )
        (t1, _), (t2, _), (t3, _) = session.attach(), session.attach(), session.attach()
        session.submit(t1, gen(t1, 4), "", False, None, awaits_handoff=True)
        session.submit(t2, gen(t2, 600), "", False, None, awaits_handoff=True)
        session.submit(t3, gen(t3, 4), "", False, None, awaits_handoff=True)
        session.hand_off(t2, handoff)
        session.hand_off(t1, handoff)
        session.hand_off(t3, handoff)
        session.cancel(t3)  # its submit and handoff never go
        await asyncio.sleep(0.05)
        submitted, handed = [], []
        for message in call.written:
            submitted += [s.tag for s in message.submits]
            for h in message.handoffs:
                assert h.tag in submitted  # never before its submit
                handed.append(h.tag)
                assert list(h.kv_params.first_gen_tokens) == [3]
        assert sorted(submitted) == [t1, t2] and sorted(handed) == [t1, t2]
        assert len(call.written) >= 2  # (the case above did arise)
        assert all(s.awaits_handoff for m in call.written for s in m.submits)
        session.close()

    asyncio.run(main())


class _FakePoller:
    """pull_blocks' poller: each READ lands (or fails) at once, calling on_landed as the poller's
    thread would, before its future resolves."""

    def __init__(self, fail: bool = False):
        self.fail = fail

    def read(self, agent, remote, local, notify, timeout_s, on_landed=None):
        from tandem.kvtransfer.errors import TransferError
        from tandem.kvtransfer.poller import PendingRead, ReadDone

        loop = asyncio.get_running_loop()
        pending = PendingRead(loop.create_future(), loop.create_future(), 0.0)
        if self.fail:
            pending.done.set_exception(TransferError("READ failed"))
        else:
            if on_landed is not None:
                on_landed()
            pending.done.set_result(ReadDone(len(remote), 0.001))
        pending.settled.set_result(True)
        return pending

    async def settle(self, pending, timeout_s=2.0):
        await pending.settled


@pytest.mark.parametrize(
    ("num_blocks", "fail", "cancel", "told"),
    [(300, False, False, 1), (0, False, False, 1), (300, True, False, 0), (300, False, True, 0)],
)
def test_a_pull_tells_the_engine_once_when_its_last_read_lands(
    monkeypatch, num_blocks, fail, cancel, told
):
    """Three READs of at most 128 blocks each (0 blocks: nothing to read, told at once); a failed
    READ, or a pull cancelled before its READs landed, tells nothing."""
    import threading

    from tandem.decode import generation

    monkeypatch.delenv(generation.PULL_FAULT_ENV, raising=False)
    calls = []
    cancelled = threading.Event()
    if cancel:
        cancelled.set()

    async def main():
        return await generation.pull_blocks(
            _FakePoller(fail),
            "peer",
            list(range(num_blocks)),
            list(range(num_blocks)),
            [],
            lambda: calls.append(1),
            cancelled,
        )

    num_landed, _, _, error = asyncio.run(main())
    assert len(calls) == told
    assert (error is not None) == fail and num_landed == (0 if fail else num_blocks)


def test_a_decode_that_refuses_its_announcement_gets_the_request_whole(model_dirs):
    """The decode's pool holds shorter prompts than the prefill's (8 blocks of 8 tokens, a limit
    the router's front does not know): it refuses the announced request at once (before its
    handoff); the context phase still runs, and the router sends the decode the request whole,
    which meets the same refusal as without announcing: the client gets the decode's
    RESOURCE_EXHAUSTED, the prefill's lease is released, nothing is left anywhere."""
    engine_args = ["--model", str(model_dirs["llama"]), "--block-size", "8"]
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=engine_args,
        worker_args={"prefill-1": ["--num-blocks", "128"], "decode-1": ["--num-blocks", "8"]},
    ) as c:
        unannounced = c.add_router("router-unannounced", ["--no-announce-decode"])
        for address in (c.address, unannounced.address):  # the routers' sessions open
            with LLM(address) as llm:
                llm.generate([1, 5, 9], SamplingParams(max_tokens=2), use_tqdm=False)
        codes = []
        for address in (c.address, unannounced.address):
            with LLM(address) as llm, pytest.raises(RequestError) as err:
                llm.generate([1] + [7] * 80, SamplingParams(max_tokens=4), use_tqdm=False)
            codes.append((err.value.code, "the pool has 8" in err.value.details))
        assert codes == [(grpc.StatusCode.RESOURCE_EXHAUSTED, True)] * 2
        assert _announcements(c.router, "resent") == 1
        for worker in c.workers:
            state = worker_state(worker.address)
            assert state.num_free_blocks == state.num_total_blocks and state.num_leases == 0
        with LLM(c.address) as llm:  # a prompt both take still splits and pulls
            out = llm.generate(
                [1, 5, 9, 11], SamplingParams(max_tokens=6, ignore_eos=True), use_tqdm=False
            )
        assert len(out.outputs[0].token_ids) == 6 and out.metrics.kv_handoff.outcome == "pulled"


def test_the_decode_reserves_an_announced_requests_blocks_while_its_prompt_is_computed(
    model_dirs,
):
    """The prefill computes a 1,000-token prompt 8 tokens a step (125 steps): meanwhile the
    decode holds the prompt's blocks for the announced request (WAITING_FOR_REMOTE_KV, before any
    handoff), and the request pulls into them (reserved_early). A request of the same id that starts
    on the decode meanwhile (as the router's resend would) takes the id: the reservation gives way
    (dropped before that request reaches the engine, never freed under a pull), and the announced
    request reserves anew when its handoff comes. A pause of the decode drops such a
    reservation at once (its pool whole when the pause returns, no drain waits on it); the request
    still ends (its handoff meets the pause: an error or a retry, never a hang) and leaves nothing
    held; after resume the next one reserves early again."""
    engine_args = ["--model", str(model_dirs["llama"]), "--block-size", "8", "--num-blocks", "256"]
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=engine_args,
        worker_args={"prefill-1": ["--max-num-batched-tokens", "8"]},
    ) as c:
        decode = c.workers[1].address
        rng = random.Random(3)

        def prompt():
            return [1] + [rng.randrange(4, 250) for _ in range(999)]

        async def main():
            llm = await AsyncLLM(c.address)
            admin = await AsyncLLM(decode, **c.worker_client_kwargs())
            params = SamplingParams(max_tokens=4, ignore_eos=True)
            try:
                await llm.generate_async([1, 5, 9], params)  # the router's session opens
                for pause in (False, True, None):
                    rid = f"announced-{pause}"
                    request = asyncio.ensure_future(
                        llm.generate_async(prompt(), params, request_id=rid)
                    )
                    deadline = time.monotonic() + 20
                    while worker_state(decode).num_waiting_for_remote_kv == 0:
                        assert not request.done() and time.monotonic() < deadline
                        await asyncio.sleep(0.005)
                    state = worker_state(decode)
                    assert state.num_free_blocks <= state.num_total_blocks - 126  # 1,001 tokens
                    if pause is None:  # another request of the id starts meanwhile
                        other = await admin.generate_async([1, 5, 9], params, request_id=rid)
                        assert len(other.outputs[0].token_ids) == 4
                        assert worker_state(decode).num_waiting_for_remote_kv == 0
                        out = await asyncio.wait_for(request, 30)
                        assert out.metrics.kv_handoff.outcome == "pulled"
                        assert not out.metrics.kv_handoff.reserved_early
                        continue
                    if not pause:
                        out = await asyncio.wait_for(request, 30)
                        assert out.metrics.kv_handoff.outcome == "pulled"
                        assert out.metrics.kv_handoff.reserved_early
                        continue
                    await admin.pause_generation()
                    # At once: the prompt is still being computed (no drain waited for its handoff).
                    assert worker_state(c.workers[0].address).num_active_requests == 1
                    state = worker_state(decode)
                    assert state.num_free_blocks == state.num_total_blocks
                    assert state.num_waiting_for_remote_kv == 0
                    try:
                        await asyncio.wait_for(request, 30)
                    except RequestError:
                        pass
                    await admin.resume_generation()
                out = await llm.generate_async(prompt(), params)
                assert out.metrics.kv_handoff.outcome == "pulled"
                assert out.metrics.kv_handoff.reserved_early
            finally:
                llm.close()
                admin.close()

        asyncio.run(main())
        for worker in c.workers:
            state = worker_state(worker.address)
            assert state.num_free_blocks == state.num_total_blocks and state.num_leases == 0


def test_a_reservation_is_taken_once_given_back_at_once_and_never_across_new_weights():
    """EarlyReservation: a drop aborts the id at once, even before the engine answered (the abort
    follows the reservation in the engine's queue); a taken one is the pull's (a drop after it
    does nothing); one reserved under other weights is given back (its cached prefix may be the
    old weights' KV); no room, or a refused request, gives None and nothing to abort."""
    from tandem.decode.early_reservation import EarlyReservation

    class Core:
        def __init__(self):
            self.aborted: list[str] = []

        def abort(self, request_id: str) -> None:
            self.aborted.append(request_id)

    async def main():
        loop = asyncio.get_running_loop()
        core, pending = Core(), {}

        def reserve(rid: str, answer=None, answered: bool = True) -> EarlyReservation:
            plan = loop.create_future()
            if answered:
                plan.set_result(answer)
            return EarlyReservation(core, rid, "weights-1", plan, pending)

        r = reserve("a", answered=False)
        assert pending == {"a": r}
        r.drop()
        assert core.aborted == ["a"] and pending == {}
        assert await r.take("weights-1") is None
        b = reserve("b", "plan")
        assert await b.take("weights-1") == "plan" and pending == {}
        b.drop()
        assert core.aborted == ["a"]
        c = reserve("c", "plan")
        assert await c.take("weights-2") is None and core.aborted == ["a", "c"] and pending == {}
        d = reserve("d", None)
        assert await d.take("weights-1") is None and core.aborted == ["a", "c"]
        # Refused by the engine (here after the drop): its error is retrieved, nobody's to report.
        e_plan = loop.create_future()
        e = EarlyReservation(core, "e", "weights-1", e_plan, pending)
        e.drop()
        e_plan.set_exception(ValueError("refused"))
        await asyncio.sleep(0)
        assert core.aborted == ["a", "c", "e"] and pending == {}

    asyncio.run(main())


def test_the_prefills_handoff_stream_is_opened_again_after_its_decode_ends_it():
    """handoff_push.py: a stream the decode ends (a restart, a refusal) is forgotten, its
    consumer ends, and the next handoff to that decode opens another; after close() nothing is
    sent and nothing is left running."""
    from tandem.common.channels import ClusterCredentials
    from tandem.prefill.handoff_push import HandoffPush
    from tandem.v1 import worker_pb2_grpc

    got: list[int] = []

    class Decode(worker_pb2_grpc.WorkerServicer):
        async def HandOff(self, request_iterator, context):
            async for request in request_iterator:
                got.append(request.disagg_request_id)
                if request.disagg_request_id == 2:  # ends the stream, as a restart would
                    await context.abort(grpc.StatusCode.UNAVAILABLE, "going away")
            return worker_pb2.HandOffResponse(num_taken=0)

    async def main():
        server = grpc.aio.server()
        worker_pb2_grpc.add_WorkerServicer_to_server(Decode(), server)
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        endpoint = f"127.0.0.1:{port}"
        push = HandoffPush(ClusterCredentials())
        params = types_pb2.DisaggregatedParams(first_gen_tokens=[5], opaque_state=b"x")
        try:
            push.send(endpoint, 1, params)
            push.send(endpoint, 2, params)
            for _ in range(100):
                await asyncio.sleep(0.02)
                if not push._streams:
                    break
            assert got == [1, 2] and not push._streams  # the ended stream is forgotten
            push.send(endpoint, 3, params)  # a new stream
            for _ in range(100):
                await asyncio.sleep(0.02)
                if got[-1] == 3:
                    break
            assert got == [1, 2, 3]
            await push.close()
            push.send(endpoint, 4, params)  # closed: not sent
            await asyncio.sleep(0.1)
            assert got == [1, 2, 3] and not push._streams
        finally:
            await server.stop(0)
        others = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
        await asyncio.wait_for(asyncio.gather(*others, return_exceptions=True), 5)

    asyncio.run(main())


class _FakeSession:
    """What a Leg asks of its session: the router's handoffs it was given."""

    def __init__(self):
        self.handed_off = []
        self.failure = None

    def hand_off(self, tag, params):
        self.handed_off.append(tag)


class _FakeInbox:
    def __init__(self, items):
        self.items = items

    async def take(self):
        items, self.items = self.items, []
        return items


def _announced_leg(items: list, worker=None):
    """An announced Leg on a fake session and relay, its inbox holding items (a worker's failure,
    say), without a router around it."""
    import types as pytypes

    from tandem.router.legs import Leg

    leg = object.__new__(Leg)
    # (the watchdog hand_off starts is cancelled before it fires)
    leg.relay = pytypes.SimpleNamespace(leg=None, cancelled=False, progress_timeout_s=60.0)
    leg.session, leg.tag, leg.inbox = _FakeSession(), 7, _FakeInbox(items)
    leg.announced, leg.watchdog, leg.ended, leg._items, leg._is_over = True, None, False, [], False
    leg.worker = worker or pytypes.SimpleNamespace(address="d:1", ready=True)
    return leg


def _kv_load_failure():
    from tandem.common.errors import KV_LOAD_FAILED
    from tandem.router.inbox import stream_failure

    return stream_failure(
        grpc.StatusCode.UNAVAILABLE, "the lease expires", reason=f"{KV_LOAD_FAILED}:lease_expiring"
    )


def test_a_decode_that_failed_the_prefills_own_handoff_keeps_the_request_as_a_failed_pull():
    """Under --kv-load-failure-policy fail, the announced decode can fail the pull of the handoff
    the prefill sent it before the router's handoff comes: that leg is the pair's failed pull (the
    relay counts it and retries on another pair), not a failed announcement; the router's
    handoff is not sent to it, and reading it raises the decode's failure."""
    from tandem.common.errors import BEFORE_HANDOFF, FAILURE_REASON_METADATA, KV_LOAD_FAILED
    from tandem.router.inbox import stream_failure

    async def run():
        leg = _announced_leg([_kv_load_failure()])
        assert leg.failed_loading_kv and not leg.is_waiting
        leg.hand_off(types_pb2.DisaggregatedParams(opaque_state=b"x"))
        assert leg.session.handed_off == [] and not leg.announced and leg.relay.leg is leg
        with pytest.raises(grpc.aio.AioRpcError) as raised:
            await leg.next()
        assert (FAILURE_REASON_METADATA, f"{KV_LOAD_FAILED}:lease_expiring") in tuple(
            raised.value.trailing_metadata()
        )
        leg.watchdog.cancel()
        # A decode that failed before any handoff (refused, paused) is a failed announcement.
        before = _announced_leg(
            [stream_failure(grpc.StatusCode.UNAVAILABLE, "paused", reason=BEFORE_HANDOFF)]
        )
        assert not before.failed_loading_kv and not before.is_waiting
        # One waiting for its handoff gets the router's.
        waiting = _announced_leg([])
        assert not waiting.failed_loading_kv and waiting.is_waiting
        waiting.hand_off(types_pb2.DisaggregatedParams(opaque_state=b"x"))
        assert waiting.session.handed_off == [7]
        waiting.watchdog.cancel()

    asyncio.run(run())


def test_the_relay_retries_a_failed_pull_of_the_prefills_own_handoff_and_counts_each_failure():
    """The relay's side of the test above: the split's generation phase stays on the decode whose
    pull of the prefill's own handoff failed (no 'resent' announcement); its failure is counted
    for that pair and the request goes once more to another pair, whose failure is counted too
    before the request fails."""
    import types as pytypes

    from tandem.router.relay import Relay, _Split

    failure = _kv_load_failure()
    prefill, decode, other_decode = (
        pytypes.SimpleNamespace(address=a, ready=True) for a in ("p:1", "d:1", "d:2")
    )
    leg = _announced_leg([failure], decode)
    counted, dropped = [], []

    async def another_pair(split):
        split.prefill, split.decode = prefill, other_decode
        return True

    relay = pytypes.SimpleNamespace(
        announced=leg,
        _drop_announced=dropped.append,
        _other_decode=lambda worker: other_decode,
        _pick_or_none=lambda roles, exclude: other_decode,
        metrics=pytypes.SimpleNamespace(kv_handoff_ended=lambda *a: counted.append(a)),
        _another_pair=another_pair,
        cancelled=False,
    )
    handoff = types_pb2.DisaggregatedParams(opaque_state=b"state", first_gen_tokens=[5])
    first = types_pb2.RequestOutput(prompt_token_ids=[1, 2, 3])
    first.outputs.add(cumulative_logprob=-0.5)
    split = _Split(prefill, llm_pb2.GenerateRequest(), first, handoff, time.monotonic())
    request = llm_pb2.GenerateRequest(request_id="r")
    seq = Relay._decode_phase(relay, request, split)
    assert seq.worker is decode and split.decode is decode and split.pulls and dropped == []

    async def run():
        assert await Relay._retry_handoff(relay, seq, failure) is None
        assert counted == [("p:1", "d:1", "failed", "lease_expiring")]
        assert seq.is_handoff_retried and seq.worker is other_decode
        with pytest.raises(grpc.aio.AioRpcError):
            await Relay._retry_handoff(relay, seq, failure)
        assert counted[1] == ("p:1", "d:2", "failed", "lease_expiring")

    asyncio.run(run())
