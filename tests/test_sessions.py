"""Sessions (Worker.Session): the router's requests to a worker go in as messages on one bidi
stream, and their outputs come back on it, a batch per engine step for all of them.

Real worker and router processes on loopback; the tests open sessions the way the router does
(the cluster's credentials, one connection per channel), and against the router's own session
code with scripted calls where a real worker cannot be made to produce an interleaving."""

from __future__ import annotations

import asyncio
import random
import time

import grpc
import pytest
from test_disagg import worker_state

from tandem.client import LLM, SamplingParams
from tandem.common.engine_messages import OutputBuilder, engine_request
from tandem.common.errors import RpcError
from tandem.router import inbox as inboxes
from tandem.router import session_client as sessions
from tandem.testing.cluster import LocalCluster
from tandem.v1 import internal_pb2, llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc

NUM_REQUESTS, MAX_TOKENS = 12, 24
SESSION = "/tandem.v1.Worker/Session"
INVALID = grpc.StatusCode.INVALID_ARGUMENT.value[0]


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "256",
            "--block-size",
            "8",
        ],
    ) as c:
        yield c


def _channel(cluster) -> grpc.aio.Channel:
    """A channel of its own connection (gRPC shares a connection between channels of equal arguments)."""
    return grpc.aio.insecure_channel(
        cluster.workers[0].address, options=[("grpc.use_local_subchannel_pool", 1)]
    )


def _request(i: int, max_tokens: int = MAX_TOKENS) -> llm_pb2.GenerateRequest:
    rng = random.Random(i)
    request = llm_pb2.GenerateRequest(request_id=f"session-{i}", streaming=True)
    request.prompt.token_ids.ids[:] = [1] + [
        rng.randrange(4, 200) for _ in range(rng.randrange(3, 30))
    ]
    request.sampling_params.max_tokens = max_tokens
    request.sampling_params.ignore_eos = True
    request.sampling_params.detokenize = False
    return request


def _engine(i: int, max_tokens: int = MAX_TOKENS):
    """_request(i) as a session carries it."""
    return engine_request(_request(i, max_tokens))


def _submit(tag: int, request: llm_pb2.GenerateRequest, **fields) -> worker_pb2.SessionRequest:
    return worker_pb2.SessionRequest(
        submits=[worker_pb2.SessionSubmit(tag=tag, request=engine_request(request), **fields)]
    )


def _entries(batch: worker_pb2.EngineOutputs):
    """(tag, message) per entry: the message each entry stands for on its own."""
    for entry in batch.outputs:
        builder = OutputBuilder("")
        builder.add(entry)
        yield entry.tag, builder.build()


async def _open(cluster, channel):
    call = cluster.credentials.stub(worker_pb2_grpc.WorkerStub, channel).Session()
    first = await asyncio.wait_for(call.read(), 10)
    assert first.stream_id and not first.outputs and first.max_request_bytes == 16 << 20
    return call


async def _read_until_over(call, tags: set[int], on_batch=None):
    """Reads batches until every tag has ended or failed: (outputs by tag, ended, failures by tag, batches)."""
    outputs: dict[int, list] = {tag: [] for tag in tags}
    ended: set[int] = set()
    failed: dict[int, worker_pb2.SessionFailure] = {}
    batches = []
    while not tags <= ended | set(failed):
        batch = await asyncio.wait_for(call.read(), 30)
        assert batch is not grpc.aio.EOF
        batches.append(batch)
        for tag, out in _entries(batch):
            assert tag not in ended and tag not in failed, "an entry after its request's end"
            outputs.setdefault(tag, []).append(out)
        ended.update(batch.ended)
        failed.update((f.tag, f) for f in batch.failed)
        if on_batch is not None:
            await on_batch(batch, outputs)
    return outputs, ended, failed, batches


async def _read_to_the_end(call) -> list[worker_pb2.EngineOutputs]:
    """Every batch until the call ends (raises its error status)."""
    batches = []
    while (batch := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
        batches.append(batch)
    return batches


def _tokens(messages) -> list[int]:
    return [t for msg in messages for out in msg.outputs for t in out.token_ids]


async def _tokens_on_their_own_calls(cluster, requests) -> dict[str, list[int]]:
    async with _channel(cluster) as channel:
        llm = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)

        async def one(request):
            return _tokens([msg async for msg in llm.Generate(request)])

        return dict(
            zip((r.request_id for r in requests), await asyncio.gather(*map(one, requests)))
        )


def test_requests_in_one_message_share_batches_and_get_their_own_tokens(
    cluster, no_leaked_worker_blocks
):
    requests = [_request(i) for i in range(NUM_REQUESTS)]

    async def run():
        expected = await _tokens_on_their_own_calls(cluster, requests)
        async with _channel(cluster) as channel:
            call = await _open(cluster, channel)
            await call.write(
                worker_pb2.SessionRequest(
                    submits=[
                        worker_pb2.SessionSubmit(tag=tag, request=engine_request(r))
                        for tag, r in enumerate(requests, start=100)
                    ]
                )
            )
            outputs, ended, failed, batches = await _read_until_over(
                call, set(range(100, 100 + NUM_REQUESTS))
            )
            num_sessions = worker_state(cluster.workers[0].address).num_sessions
            call.cancel()
        return expected, outputs, failed, batches, num_sessions

    expected, outputs, failed, batches, num_sessions = asyncio.run(run())
    assert not failed and num_sessions >= 1
    assert {tag - 100: _tokens(msgs) for tag, msgs in outputs.items()} == {
        i: expected[r.request_id] for i, r in enumerate(requests)
    }
    assert all(len(_tokens(msgs)) == MAX_TOKENS for msgs in outputs.values())
    num_outputs = sum(len(b.outputs) for b in batches)
    # A step's outputs of every running request go in one message.
    assert len(batches) < num_outputs / 3, (len(batches), num_outputs)
    # Every entry but a request's first and last holds its new token and nothing else.
    bare = {"tag", "new_token_ids", "cumulative_logprob"}
    num_bare = sum(
        1 for b in batches for e in b.outputs if {f.name for f, _ in e.ListFields()} <= bare
    )
    assert num_bare == num_outputs - 2 * len(requests), (num_bare, num_outputs)


def test_a_failing_request_ends_with_its_calls_status_and_the_others_run_on(
    cluster, no_leaked_worker_blocks
):
    """Out of vocabulary, a negative or NaN timeout, a deadline that passes: each fails with the status
    and message its own call would get, after its outputs; the request beside them completes."""

    async def run():
        async with _channel(cluster) as channel:
            call = await _open(cluster, channel)
            bad = _request(1)
            bad.prompt.token_ids.ids.append(10**6)
            slow = _request(2, max_tokens=1900)
            good = _request(3)
            await call.write(
                worker_pb2.SessionRequest(
                    submits=[
                        worker_pb2.SessionSubmit(tag=1, request=engine_request(bad)),
                        worker_pb2.SessionSubmit(
                            tag=2, request=engine_request(slow), timeout_s=0.3
                        ),
                        worker_pb2.SessionSubmit(tag=3, request=engine_request(good)),
                        worker_pb2.SessionSubmit(tag=5, request=_engine(5), timeout_s=-1),
                        worker_pb2.SessionSubmit(tag=6, request=_engine(6), timeout_s=float("nan")),
                    ]
                )
            )
            result = await _read_until_over(call, {1, 2, 3, 5, 6})
            call.cancel()
            return result

    outputs, ended, failed, _ = asyncio.run(run())
    assert ended == {3} and len(_tokens(outputs[3])) == MAX_TOKENS
    assert failed[1].code == INVALID and "out of vocabulary" in failed[1].details and not outputs[1]
    assert (
        failed[2].code == grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
        and "deadline" in failed[2].details
    )
    assert 0 < len(_tokens(outputs[2])) < 1900  # it ran until the deadline
    for tag in (5, 6):
        assert (
            failed[tag].code == INVALID
            and "timeout_s must be a number of seconds >= 0" in failed[tag].details
        )


def test_a_cancel_stops_its_request_and_an_abort_ends_it_as_cancelled(
    cluster, no_leaked_worker_blocks
):
    """A cancel (the router's relay is over) stops the request at once: nothing more comes for
    it and its blocks are freed. An Abort from the session's own connection ends a request with
    finish_reason cancelled; from another connection it aborts nothing. A request of n=2 (the
    worker's usual path, not the fast one) streams both sequences beside them."""

    async def run():
        async with _channel(cluster) as channel, _channel(cluster) as other:
            call = await _open(cluster, channel)
            llm = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)
            stranger = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, other)
            pair = _request(201)
            pair.sampling_params.n = 2
            pair.sampling_params.temperature = 0.8
            pair.sampling_params.seed = 5
            await call.write(
                worker_pb2.SessionRequest(
                    submits=[
                        worker_pb2.SessionSubmit(tag=1, request=_engine(200, max_tokens=1900)),
                        worker_pb2.SessionSubmit(tag=2, request=_engine(202, max_tokens=1900)),
                        worker_pb2.SessionSubmit(tag=3, request=engine_request(pair)),
                    ]
                )
            )
            actions = {}

            async def act(batch, outputs):
                if outputs[1] and outputs[2] and not actions:
                    actions["stranger"] = (
                        await stranger.Abort(llm_pb2.AbortRequest(request_id="session-200"))
                    ).aborted
                    actions["owner"] = (
                        await llm.Abort(llm_pb2.AbortRequest(request_id="session-200"))
                    ).aborted
                    await call.write(
                        worker_pb2.SessionRequest(cancels=[2, 77])
                    )  # 77: never submitted
                    actions["tokens of 2 at the cancel"] = len(_tokens(outputs[2]))

            outputs, ended, failed, _ = await _read_until_over(call, {1, 3}, act)
            await asyncio.sleep(0.3)
            state = worker_state(cluster.workers[0].address)
            call.cancel()
            return actions, outputs, ended, failed, state

    actions, outputs, ended, failed, state = asyncio.run(run())
    assert actions["owner"] and not actions["stranger"]
    assert ended == {1, 3} and not failed
    last = outputs[1][-1]
    assert last.finished and last.outputs[0].finish_reason == types_pb2.FINISH_REASON_CANCELLED
    # Entries of 2 written before the worker read the cancel can follow it: a few steps (a
    # loaded 2-core machine has shown 20 and more), far from its 1900.
    assert len(_tokens(outputs[2])) < actions["tokens of 2 at the cancel"] + 100 < 1900
    tokens = {0: [], 1: []}
    for out in outputs[3]:
        for comp in out.outputs:
            tokens[comp.index].extend(comp.token_ids)
    assert outputs[3][-1].finished and [len(t) for t in tokens.values()] == [MAX_TOKENS, MAX_TOKENS]
    assert state.num_active_requests == 0


def test_closing_a_session_stops_its_requests(cluster, no_leaked_worker_blocks):
    async def run():
        async with _channel(cluster) as channel:
            call = await _open(cluster, channel)
            await call.write(
                worker_pb2.SessionRequest(
                    submits=[
                        worker_pb2.SessionSubmit(tag=i, request=_engine(300 + i, max_tokens=1900))
                        for i in range(4)
                    ]
                )
            )
            batch = await asyncio.wait_for(call.read(), 30)  # they run
            assert batch.outputs
            call.cancel()
        for _ in range(100):
            state = worker_state(cluster.workers[0].address)
            if state.num_active_requests == 0:
                return state
            await asyncio.sleep(0.1)
        return state

    assert asyncio.run(run()).num_active_requests == 0


def test_a_caller_that_stops_writing_gets_its_requests_to_the_end_then_the_sessions_end(
    cluster, no_leaked_worker_blocks
):
    async def run():
        async with _channel(cluster) as channel:
            call = await _open(cluster, channel)
            await call.write(_submit(1, _request(400)))
            await call.done_writing()
            return await _read_to_the_end(call), await call.code()

    batches, code = asyncio.run(run())
    assert code == grpc.StatusCode.OK
    assert sum(len(b.outputs) for b in batches) > 0 and [t for b in batches for t in b.ended] == [1]


def test_a_message_that_is_not_a_session_request_ends_the_session_with_invalid_argument(
    cluster, no_leaked_worker_blocks
):
    async def run():
        async with _channel(cluster) as channel:
            session = channel.stream_stream(
                SESSION,
                request_serializer=lambda raw: raw,
                response_deserializer=worker_pb2.EngineOutputs.FromString,
            )
            call = session(metadata=cluster.credentials.metadata_for(SESSION, ()))
            await call.write(b"\xff\xff\xff")
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await _read_to_the_end(call)
            return ended.value

    error = asyncio.run(run())
    assert (
        error.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "not a valid SessionRequest" in error.details()
    )


def test_the_handoff_stream_takes_what_is_awaited_and_refuses_what_does_not_parse(cluster):
    """Worker/HandOff (a prefill's handoffs straight to a decode): handoffs that no announced
    request awaits are dropped (num_taken 0); bytes that are not a HandOffRequest end the
    stream with INVALID_ARGUMENT, and the worker goes on serving."""
    method = "/tandem.v1.Worker/HandOff"

    async def run(messages):
        async with _channel(cluster) as channel:
            hand_off = channel.stream_unary(
                method,
                request_serializer=lambda raw: raw,
                response_deserializer=worker_pb2.HandOffResponse.FromString,
            )
            return await hand_off(
                iter(messages), metadata=cluster.credentials.metadata_for(method, ()), timeout=10
            )

    unknown = worker_pb2.HandOffRequest(
        disagg_request_id=12345, kv_params=internal_pb2.KvParams(first_gen_tokens=[7])
    )
    assert asyncio.run(run([unknown.SerializeToString()] * 3)).num_taken == 0
    with pytest.raises(grpc.aio.AioRpcError) as err:
        asyncio.run(run([unknown.SerializeToString(), b"\xff\xff\xff"]))
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "not a valid HandOffRequest" in err.value.details()
    with LLM(cluster.workers[0].address, **cluster.worker_client_kwargs()) as llm:
        out = llm.generate([1, 5, 9], SamplingParams(max_tokens=2), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 2


def test_a_tag_used_twice_ends_the_session_and_its_requests(cluster, no_leaked_worker_blocks):
    """Entries of two requests under one tag could not be told apart: a caller that does that is
    broken, and its session ends with every request on it."""

    async def run():
        async with _channel(cluster) as channel:
            call = await _open(cluster, channel)
            await call.write(_submit(1, _request(500, max_tokens=1900)))
            await call.write(_submit(2, _request(501, max_tokens=1900)))
            await call.write(_submit(1, _request(502)))
            with pytest.raises(grpc.aio.AioRpcError) as ended:
                await _read_to_the_end(call)
        for _ in range(100):
            if worker_state(cluster.workers[0].address).num_active_requests == 0:
                break
            await asyncio.sleep(0.1)
        return ended.value

    error = asyncio.run(run())
    assert (
        error.code() == grpc.StatusCode.INVALID_ARGUMENT
        and "tag 1 is already running" in error.details()
    )


def test_sessions_are_bounded(cluster):
    async def run():
        channels = [_channel(cluster) for _ in range(70)]
        try:
            calls = [
                cluster.credentials.stub(worker_pb2_grpc.WorkerStub, ch).Session()
                for ch in channels
            ]
            codes = []
            for c in calls:
                try:
                    await asyncio.wait_for(c.read(), 10)
                    codes.append(grpc.StatusCode.OK)
                except grpc.aio.AioRpcError as exc:
                    codes.append(exc.code())
            for c in calls:
                c.cancel()
            return codes
        finally:
            for ch in channels:
                await ch.close()

    codes = asyncio.run(run())
    assert codes.count(grpc.StatusCode.OK) == 64
    assert codes.count(grpc.StatusCode.RESOURCE_EXHAUSTED) == 6


def test_the_router_sends_its_requests_on_one_session(cluster, no_leaked_worker_blocks):
    """Through the router: every client stream gets its tokens (equal to the worker's own calls)
    while the router holds one session with the worker."""
    requests = [_request(50 + i) for i in range(NUM_REQUESTS)]

    async def run():
        expected = await _tokens_on_their_own_calls(cluster, requests)
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            router = llm_pb2_grpc.AsyncLLMStub(channel)

            async def one(request):
                return _tokens([msg async for msg in router.Generate(request)])

            got = await asyncio.gather(*map(one, requests))
        return expected, dict(zip((r.request_id for r in requests), got))

    expected, got = asyncio.run(run())
    assert got == expected
    assert worker_state(cluster.workers[0].address).num_sessions == 1  # the router's


def test_a_session_keeps_its_messages_under_the_workers_bound(model_dirs):
    """A worker whose --max-request-bytes is small: the router writes a burst of requests in as
    many messages as fit under it, refuses a request larger than the worker takes
    (RESOURCE_EXHAUSTED, as gRPC refuses such a call), and the session carries on."""
    bound = 2048  # ~1.4 KB a 700-token request: one a message
    with LocalCluster(
        roles=["both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "256",
            "--block-size",
            "8",
        ],
        worker_args={"both-1": ["--max-request-bytes", str(bound)]},
    ) as c:

        def prompt(i: int, n: int) -> list[int]:
            rng = random.Random(i)
            return [1] + [rng.randrange(200, 380) for _ in range(n)]

        params = SamplingParams(max_tokens=4, ignore_eos=True, detokenize=False)
        with LLM(c.address) as llm:
            outs = llm.generate([prompt(i, 700) for i in range(16)], params, use_tqdm=False)
            with pytest.raises(Exception) as too_large:
                llm.generate(prompt(99, 1500), params, use_tqdm=False)
            again = llm.generate(prompt(0, 700), params, use_tqdm=False)
        state = worker_state(c.workers[0].address)
        log = c.service("router").log_tail()
    assert (
        all(len(o.outputs[0].token_ids) == 4 for o in outs)
        and again.outputs[0].token_ids == outs[0].outputs[0].token_ids
    )
    assert "RESOURCE_EXHAUSTED" in str(too_large.value)
    assert state.num_sessions == 1 and not [
        line for line in log.splitlines() if "session" in line and "ended" in line
    ]


class _ScriptedCall:
    """A Session call that reads a fixed list of batches, then EOF, and keeps what is written (the
    router's session code is tested against the exact interleavings a real worker cannot be made
    to produce)."""

    def __init__(self, batches, read_gate: asyncio.Event | None = None):
        self.batches = list(batches)
        self.written: list[worker_pb2.SessionRequest] = []
        self.cancelled = False
        self.read_gate = read_gate

    async def read(self):
        if self.read_gate is not None:
            await self.read_gate.wait()
        await asyncio.sleep(0)
        return self.batches.pop(0) if self.batches else grpc.aio.EOF

    async def write(self, message):
        self.written.append(message)

    def cancel(self):
        self.cancelled = True


def test_a_burst_of_submits_goes_in_as_few_messages_as_fit_and_an_unsent_cancelled_submit_is_dropped():
    async def run():
        gate = asyncio.Event()  # the worker says nothing meanwhile
        call = _ScriptedCall([], gate)
        session = sessions.OpenSession(call, "s", max_message_bytes=200)
        tags = [session.attach()[0] for _ in range(6)]
        requests = [_request(i) for i in range(6)]
        big = llm_pb2.GenerateRequest(request_id="big")
        big.prompt.token_ids.ids[:] = range(1000, 1700)
        big_tag = session.attach()[0]
        with pytest.raises(RpcError, match="the worker takes at most 200") as too_large:
            session.submit(big_tag, big, "client", False, None)
        assert too_large.value.code is grpc.StatusCode.RESOURCE_EXHAUSTED
        session.detach(big_tag)
        for tag, request in zip(tags, requests):
            deadline = time.monotonic() + 2.5 if tag == tags[1] else None
            session.submit(tag, request, "client", tag == tags[0], deadline)
        session.cancel(tags[2])  # never sent: dropped, no cancel goes out
        await asyncio.sleep(0.01)
        session.cancel(tags[3])  # sent already: a cancel goes out
        await asyncio.sleep(0.01)
        session.close()
        return tags, requests, call.written

    tags, requests, written = asyncio.run(run())
    submits = [s for m in written for s in m.submits]
    assert [s.tag for s in submits] == [tags[i] for i in (0, 1, 3, 4, 5)]
    assert all(m.ByteSize() <= 200 for m in written) and len(written) >= 3  # 50-80 bytes a submit
    # timeout_s: what is left of the deadline when the submit is written
    assert (
        submits[0].split
        and not submits[1].split
        and 2.4 < submits[1].timeout_s <= 2.5
        and submits[0].timeout_s == 0
    )
    assert submits[0].client == "client" and submits[2].request == engine_request(requests[3])
    assert [t for m in written for t in m.cancels] == [tags[3]]


def test_a_submit_too_large_to_share_a_message_goes_alone_within_the_workers_bound():
    async def run():
        gate = asyncio.Event()
        call = _ScriptedCall([], gate)
        session = sessions.OpenSession(call, "s", max_message_bytes=200, max_request_bytes=4096)
        small, big, after = (session.attach()[0] for _ in range(3))
        request = llm_pb2.GenerateRequest(request_id="big")
        request.prompt.token_ids.ids[:] = range(1000, 1700)  # ~1.4 KB
        session.submit(small, _request(1), "client", False, None)
        session.submit(big, request, "client", False, None)
        session.submit(after, _request(2), "client", False, None)
        await asyncio.sleep(0.01)
        session.close()
        return call.written, (small, big, after)

    written, tags = asyncio.run(run())
    assert [[s.tag for s in m.submits] for m in written] == [[tags[0]], [tags[1]], [tags[2]]]
    assert written[1].ByteSize() > 200 and written[1].submits[0].request.request_id == "big"


def test_a_request_waits_for_room_on_a_full_session():
    """The router never passes the session's bound (a refused submit would fail its request):
    a request past it waits until one of the session's requests leaves."""

    async def run():
        gate = asyncio.Event()
        session = sessions.OpenSession(_ScriptedCall([], gate), "s", max_requests=2)
        first, _ = session.attach()
        session.attach()
        assert session.attach() is None
        waiting = asyncio.create_task(session.wait_for_room())
        await asyncio.sleep(0.01)
        assert not waiting.done()
        session.detach(first)
        await asyncio.wait_for(waiting, 1)
        third = session.attach()
        session.close()
        return third

    assert asyncio.run(run()) is not None


async def _read_all(inbox, got: list) -> None:
    """What the relay reads from an inbox up to the request's end, into got (its error raised)."""
    while True:
        for item in await inbox.take():
            msg = inboxes.message_of(item)
            if msg is None:
                return
            got.append(msg)


def test_a_failure_entry_raises_the_calls_error_with_its_retry_hint():
    async def run():
        failed = worker_pb2.SessionFailure(
            tag=1,
            code=grpc.StatusCode.RESOURCE_EXHAUSTED.value[0],
            details="the pool is full",
            retry_pushback_ms=1500,
        )
        first = internal_pb2.EngineOutput(tag=1, index=0, new_token_ids=[7])
        session = sessions.OpenSession(
            _ScriptedCall(
                [
                    worker_pb2.EngineOutputs(outputs=[first]),
                    worker_pb2.EngineOutputs(failed=[failed]),
                ]
            ),
            "s",
        )
        _, inbox = session.attach()
        got = []
        with pytest.raises(grpc.aio.AioRpcError) as error:
            await _read_all(inbox, got)
        session.close()
        return got, error.value

    got, error = asyncio.run(run())
    assert [list(m.outputs[0].token_ids) for m in got] == [
        [7]
    ]  # its outputs first, then its status
    assert (
        error.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and error.details() == "the pool is full"
    )
    from tandem.common.errors import retry_pushback_ms

    assert retry_pushback_ms(error) == 1500


def test_a_lagging_clients_outputs_fold_into_one_message_in_the_routers_inbox():
    """The router reads a worker's stream as it comes; what a slow client has not taken yet is
    held as one message, built as the entries come, not one message per engine step."""
    from tandem.router.inbox import Inbox

    num_steps = 200

    async def run():
        inbox = Inbox("slow")
        for step in range(num_steps):
            inbox.put_entry(
                internal_pb2.EngineOutput(
                    tag=1, index=0, new_token_ids=[step, step + 1000], cumulative_logprob=-step
                )
            )
        assert len(inbox.items) == 1
        inbox.put(inboxes.ENDED)
        got = []
        await _read_all(inbox, got)
        return got

    messages = asyncio.run(run())
    assert len(messages) == 1 and messages[0].request_id == "slow"
    assert list(messages[0].outputs[0].token_ids) == [
        t for step in range(num_steps) for t in (step, step + 1000)
    ]
    assert messages[0].outputs[0].cumulative_logprob == -(num_steps - 1)


def test_an_output_for_an_ended_relay_goes_to_the_orphan_handler_and_eof_fails_the_rest():
    """A handoff that arrives after its relay ended (it was cancelled just as the prefill
    answered) is handed to on_orphan (the pool releases its lease); the stream's end fails the
    relays still attached and cancels the call."""

    async def run():
        orphans = []
        handoff = internal_pb2.EngineOutput(tag=9, index=0, finished=True)
        handoff.kv_params.ctx_request_id = 42
        mine = internal_pb2.EngineOutput(tag=1, index=0, new_token_ids=[3])
        call = _ScriptedCall([worker_pb2.EngineOutputs(outputs=[handoff, mine])])
        stream = sessions.OpenSession(call, "s", orphans.append)
        tag, inbox = stream.attach()
        assert tag == 1
        inbox.request_id = "live"
        first = await inbox.take()
        second = await inbox.take()
        await asyncio.sleep(0)
        return orphans, first, second, call.cancelled, stream.attach()

    orphans, first, second, cancelled, late_attach = asyncio.run(run())
    assert [o.kv_params.ctx_request_id for o in orphans] == [42]
    assert [o.build().request_id for o in first] == ["live"]
    assert (
        isinstance(second[0], inboxes.SessionBroken)
        and second[0].code() == grpc.StatusCode.UNAVAILABLE
    )
    assert cancelled and late_attach is None  # a failed stream takes no new relay


def test_entries_read_as_the_messages_they_stand_for_in_order():
    """Each request's entries become its messages in order, under the id it was submitted with:
    several tokens in one entry, several entries of one request in one batch (one message), the
    request's fields (prompt ids, handoff, metrics, finish) where they came."""

    def entry(tag, tokens, **fields):
        return internal_pb2.EngineOutput(
            tag=tag, index=0, new_token_ids=tokens, cumulative_logprob=-float(sum(tokens)), **fields
        )

    async def run(batches):
        stream = sessions.OpenSession(_ScriptedCall(batches), "s")
        attached = [stream.attach()[1], stream.attach()[1]]
        for request_id, inbox in zip("ab", attached):
            inbox.request_id = request_id
        received = {1: [], 2: []}
        for tag, inbox in enumerate(attached, start=1):
            while True:
                items = await inbox.take()
                received[tag] += [i.build() if isinstance(i, OutputBuilder) else i for i in items]
                if not all(isinstance(i, OutputBuilder) for i in items):
                    break
        return received

    handoff = internal_pb2.KvParams(ctx_request_id=7, opaque_state=b"x")
    batches = [
        worker_pb2.EngineOutputs(
            outputs=[entry(1, [5], prompt_token_ids=[1, 2]), entry(2, [6, 7], prompt_token_ids=[3])]
        ),
        worker_pb2.EngineOutputs(
            outputs=[
                entry(2, [8]),
                entry(1, [9, 10, 11]),
                entry(1, [12], finished=True, finish_reason=types_pb2.FINISH_REASON_LENGTH),
                entry(2, [13]),
            ],
            ended=[1],
        ),
        worker_pb2.EngineOutputs(
            outputs=[entry(2, [14], finished=True, kv_params=handoff)], ended=[2]
        ),
    ]
    received = asyncio.run(run(batches))
    a, b = received[1], received[2]
    assert a[-1] is inboxes.ENDED and b[-1] is inboxes.ENDED
    assert [
        (m.request_id, list(m.prompt_token_ids), list(m.outputs[0].token_ids), m.finished)
        for m in a[:-1]
    ] == [("a", [1, 2], [5], False), ("a", [], [9, 10, 11, 12], True)]
    assert a[1].outputs[0].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert a[1].outputs[0].cumulative_logprob == -12.0
    # Read after it all came: what came while nobody took it is one message.
    assert [t for m in b[:-1] for t in m.outputs[0].token_ids] == [6, 7, 8, 13, 14]
    assert [m.finished for m in b[:-1]] == [False] * (len(b) - 2) + [True]
    assert list(b[0].prompt_token_ids) == [3]
    last = b[-2]
    assert last.outputs[0].disaggregated_params.ctx_request_id == 7
    assert last.disaggregated_params.opaque_state == b"x"


def test_a_session_opened_before_the_worker_is_ready_is_refused_unavailable():
    """The readiness refusal answers a stream of requests in its own kind (a handler of another
    kind would fail the call with a status that says nothing)."""
    from tandem.common.interceptors import Readiness
    from tandem.common.server import GrpcServer

    async def never_called(requests, context):
        yield worker_pb2.EngineOutputs(stream_id="ready")

    async def run():
        server = GrpcServer(
            "127.0.0.1", 0, ["tandem.v1.Worker"], readiness=Readiness(lambda: False, frozenset())
        )
        handler = grpc.stream_stream_rpc_method_handler(
            never_called,
            worker_pb2.SessionRequest.FromString,
            worker_pb2.EngineOutputs.SerializeToString,
        )
        server.server.add_generic_rpc_handlers(
            [grpc.method_handlers_generic_handler("tandem.v1.Worker", {"Session": handler})]
        )
        await server.start()
        try:
            async with grpc.aio.insecure_channel(server.address) as channel:
                call = worker_pb2_grpc.WorkerStub(channel).Session()
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await asyncio.wait_for(call.read(), 10)
                return refused.value
        finally:
            await server.server.stop(0)

    error = asyncio.run(run())
    assert (
        error.code() == grpc.StatusCode.UNAVAILABLE and "still loading its model" in error.details()
    )


def test_a_cancel_in_the_same_message_as_its_submit_stops_it_before_it_starts(
    cluster, no_leaked_worker_blocks
):
    """The task is cancelled before its first step: it holds no tag, no drain count, and the
    session ends once the caller stops writing (the tag can be used again meanwhile)."""

    async def run():
        async with _channel(cluster) as channel:
            call = await _open(cluster, channel)
            await call.write(
                worker_pb2.SessionRequest(
                    submits=[
                        worker_pb2.SessionSubmit(tag=1, request=_engine(600, max_tokens=1900))
                    ],
                    cancels=[1],
                )
            )
            await call.write(_submit(1, _request(601)))  # not "already running"
            await call.done_writing()
            batches = await _read_to_the_end(call)
            return batches, await call.code(), worker_state(cluster.workers[0].address)

    batches, code, state = asyncio.run(run())
    assert code == grpc.StatusCode.OK and [t for b in batches for t in b.ended] == [1]
    assert (
        len(_tokens(m for b in batches for _, m in _entries(b))) == MAX_TOKENS
    )  # the second tag-1 request
    assert state.num_active_requests == 0


class _Recorder:
    """What a worker Session reports, in-process: statuses counted and requests run."""

    def __init__(self):
        self.counted: list[grpc.StatusCode] = []
        self.started: list[int] = []

    def count(self, method, code):
        self.counted.append(code)

    async def run(self, submit, stream, owner, handoff=None):
        self.started.append(submit.tag)
        await asyncio.sleep(30)


def test_a_full_session_refuses_submits_and_bounds_each_message(monkeypatch):
    """Past the session's bound a submit is refused (nothing ran: SessionFailure.refused, which a
    caller may send again once a request ended; the router waits for that instead, see
    test_a_request_waits_for_room_on_a_full_session); a message with more submits than the bound
    ends the session before any of them is started."""
    from tandem.common.drain import InFlightCalls
    from tandem.worker import session_server

    monkeypatch.setattr(session_server, "MAX_REQUESTS_PER_SESSION", 3)

    async def requests(messages):
        for message in messages:
            yield message

    async def run(messages):
        recorder, in_flight = _Recorder(), InFlightCalls()
        session = session_server.Session("owner", recorder.run, in_flight, recorder.count, 1 << 20)
        reader = asyncio.create_task(session.read(requests(messages)))
        await asyncio.sleep(0.05)
        failed = list(session.stream._failed)
        running, in_flight_count = sorted(session.tasks), in_flight.count
        session.close()
        await asyncio.sleep(0)
        error = None
        try:
            await asyncio.wait_for(reader, 1)
        except (asyncio.CancelledError, asyncio.TimeoutError):
            pass
        except Exception as exc:  # noqa: BLE001 - what ended the session
            error = exc
        return recorder, failed, running, in_flight_count, in_flight.count, error

    submits = [worker_pb2.SessionSubmit(tag=t, request=_engine(t)) for t in range(1, 6)]
    recorder, failed, running, in_flight_during, in_flight_after, _ = asyncio.run(
        run(
            [
                worker_pb2.SessionRequest(submits=submits[:3]),
                worker_pb2.SessionRequest(submits=submits[3:4]),
                worker_pb2.SessionRequest(submits=submits[4:]),
            ]
        )
    )
    assert running == [1, 2, 3] and in_flight_during == 3 and in_flight_after == 0
    assert [(f.tag, f.refused, f.code) for f in failed] == [
        (4, True, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]),
        (5, True, grpc.StatusCode.RESOURCE_EXHAUSTED.value[0]),
    ]
    error = inboxes.failure_error(failed[0])
    assert (
        error.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
        and "wait for some to end" in error.details()
    )
    assert (
        recorder.counted.count(grpc.StatusCode.CANCELLED) == 3
    )  # closing the session cancelled the three

    recorder, failed, running, _, _, error = asyncio.run(
        run([worker_pb2.SessionRequest(submits=submits[:4])])
    )
    assert not recorder.started and not failed and "at most 3" in str(error)


def test_cancels_and_submits_waiting_together_still_fit_the_workers_bound():
    """Cancels pile up while a write is slow (clients leaving); the next messages carry them and
    the waiting submits without going over the bound the worker told."""

    async def run():
        gate = asyncio.Event()
        call = _ScriptedCall([], gate)
        session = sessions.OpenSession(call, "s", max_message_bytes=2048)
        for _ in range(600):
            tag, _inbox = session.attach()
            session.submit(tag, _request(tag), "client", False, None)
            await asyncio.sleep(0)  # written
            session.cancel(tag)
        tag, _inbox = session.attach()
        big = _request(9)
        big.prompt.token_ids.ids[:] = range(200, 800)
        session.submit(tag, big, "client", False, None)
        for _ in range(20):
            await asyncio.sleep(0)
        session.close()
        return call.written, tag

    written, last = asyncio.run(run())
    cancels = [t for m in written for t in m.cancels]
    assert len(cancels) == 600 and last in [s.tag for m in written for s in m.submits]
    assert max(m.ByteSize() for m in written) <= 2048


def test_a_session_that_ends_under_a_request_moves_it_on_whatever_the_workers_health():
    from tandem.router.relay import worker_gone

    broken = inboxes.SessionBroken(grpc.StatusCode.RESOURCE_EXHAUSTED, "message over the limit")
    assert broken.code() == grpc.StatusCode.UNAVAILABLE and "RESOURCE_EXHAUSTED" in broken.details()
    assert asyncio.run(
        worker_gone(None, broken)
    )  # no health check asked: the request stopped there
