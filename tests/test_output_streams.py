"""Batched output streams (Worker.StreamOutputs): the router's Generate calls on a worker name
one, and their outputs travel on it, a batch per engine step for all of them.

Real worker and router processes on loopback; the tests call the worker the way the router
does (the cluster's credentials, one connection per channel)."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from conftest import assert_all_blocks_free
from tandem.client import LLM, SamplingParams
from tandem.common.callers import OUTPUT_STREAM_METADATA, UNKNOWN_OUTPUT_STREAM
from tandem.router.output_streams import is_unknown_output_stream
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2, worker_pb2_grpc
from test_disagg import worker_state

NUM_REQUESTS, MAX_TOKENS = 12, 24
STREAM_INTERVAL = 4


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(roles=["both"], engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "256",
                                                   "--block-size", "8"]) as c:
        c.add_router("router-interval", ["--stream-interval", str(STREAM_INTERVAL)])
        yield c


@pytest.fixture
def no_leaked_blocks(cluster):
    yield
    with LLM(cluster.workers[0].address, **cluster.worker_client_kwargs()) as worker:
        assert_all_blocks_free(worker)


def _channel(cluster) -> grpc.aio.Channel:
    """A channel of its own connection (gRPC shares a connection between channels of equal arguments)."""
    return grpc.aio.insecure_channel(cluster.workers[0].address,
                                     options=[("grpc.use_local_subchannel_pool", 1)])


def _request(i: int, max_tokens: int = MAX_TOKENS) -> llm_pb2.GenerateRequest:
    rng = random.Random(i)
    request = llm_pb2.GenerateRequest(request_id=f"stream-{i}", streaming=True)
    request.prompt.token_ids.ids[:] = [1] + [rng.randrange(4, 200) for _ in range(rng.randrange(3, 30))]
    request.sampling_params.max_tokens = max_tokens
    request.sampling_params.ignore_eos = True
    request.sampling_params.detokenize = False
    return request


def _entries(batch: worker_pb2.OutputBatch):
    """(tag, message) per entry, as worker.proto says to read a batch: a lone token is the message
    of that one token."""
    if not batch.tokens:
        yield from zip(batch.tags, batch.outputs)
        return
    outputs = iter(batch.outputs)
    for tag, token, cumulative in zip(batch.tags, batch.tokens, batch.cumulative_logprobs, strict=True):
        yield tag, next(outputs) if token < 0 else types_pb2.RequestOutput(outputs=[types_pb2.CompletionOutput(
            index=0, token_ids=[token], cumulative_logprob=cumulative)])
    assert next(outputs, None) is None


async def _open(cluster, channel):
    stub = cluster.credentials.stub(worker_pb2_grpc.WorkerStub, channel)
    call = stub.StreamOutputs(worker_pb2.StreamOutputsRequest())
    first = await asyncio.wait_for(call.read(), 10)
    assert first.stream_id and not first.outputs
    return call, first.stream_id


async def _tokens_on_their_own_calls(cluster, requests) -> dict[str, list[int]]:
    async with _channel(cluster) as channel:
        llm = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)

        async def one(request):
            return [t async for msg in llm.Generate(request) for out in msg.outputs for t in out.token_ids]
        return dict(zip((r.request_id for r in requests), await asyncio.gather(*map(one, requests))))


def test_concurrent_requests_share_batches_and_get_their_own_tokens(cluster, no_leaked_blocks):
    requests = [_request(i) for i in range(NUM_REQUESTS)]

    async def run():
        expected = await _tokens_on_their_own_calls(cluster, [_request(i) for i in range(NUM_REQUESTS)])
        async with _channel(cluster) as channel:
            call, stream_id = await _open(cluster, channel)
            llm = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)
            calls = [llm.Generate(r, metadata=((OUTPUT_STREAM_METADATA, f"{stream_id}:{tag}"),))
                     for tag, r in enumerate(requests, start=100)]
            tokens: dict[int, list[int]] = {}
            ended: set[int] = set()
            num_batches = num_outputs = num_lone = 0
            while len(ended) < len(requests):
                batch = await asyncio.wait_for(call.read(), 30)
                assert batch is not grpc.aio.EOF
                num_batches += 1
                num_outputs += len(batch.tags)
                num_lone += sum(1 for t in batch.tokens if t >= 0)
                for tag, out in _entries(batch):
                    assert tag not in ended
                    tokens.setdefault(tag, []).extend(t for o in out.outputs for t in o.token_ids)
                ended.update(batch.ended)
            # The calls carry no messages: only each request's status, OK once its end was sent.
            for c in calls:
                assert [m async for m in c] == []
                assert await c.code() == grpc.StatusCode.OK
            call.cancel()
        return expected, tokens, num_batches, num_outputs, num_lone

    expected, tokens, num_batches, num_outputs, num_lone = asyncio.run(run())
    assert {tag - 100: t for tag, t in tokens.items()} == {i: expected[r.request_id]
                                                           for i, r in enumerate(requests)}
    assert all(len(t) == MAX_TOKENS for t in tokens.values())
    # A step's outputs of every running request go in one message.
    assert num_batches < num_outputs / 3, (num_batches, num_outputs)
    # Every message but a request's first and last is one token, sent without a RequestOutput.
    assert num_lone == num_outputs - 2 * len(requests), (num_lone, num_outputs)


def test_a_stream_is_named_only_by_the_connection_that_opened_it(cluster, no_leaked_blocks):
    async def run():
        async with _channel(cluster) as mine, _channel(cluster) as theirs:
            call, stream_id = await _open(cluster, mine)
            other = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, theirs)
            results = {}
            for name, value in (("other connection", f"{stream_id}:1"), ("unknown id", "0" * 32 + ":1"),
                                ("no tag", stream_id), ("bad tag", f"{stream_id}:x1"),
                                ("tag too large", f"{stream_id}:{1 << 64}")):
                with pytest.raises(grpc.aio.AioRpcError) as refused:
                    await other.Generate(_request(1), metadata=((OUTPUT_STREAM_METADATA, value),)).read()
                results[name] = (refused.value.code(), refused.value.details(),
                                 is_unknown_output_stream(refused.value))
            call.cancel()
            return results

    results = asyncio.run(run())
    # The router tells this refusal apart (it opens a new stream and sends the request again).
    for name in ("other connection", "unknown id"):
        code, details, unknown = results[name]
        assert code == grpc.StatusCode.UNAVAILABLE and details.startswith(UNKNOWN_OUTPUT_STREAM) and unknown, name
    for name in ("no tag", "bad tag", "tag too large"):
        code, details, unknown = results[name]
        assert code == grpc.StatusCode.INVALID_ARGUMENT and OUTPUT_STREAM_METADATA in details and not unknown, name


def test_closing_a_stream_ends_the_requests_writing_to_it(cluster, no_leaked_blocks):
    async def run():
        async with _channel(cluster) as channel:
            call, stream_id = await _open(cluster, channel)
            llm = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)
            calls = [llm.Generate(_request(i, max_tokens=2000), metadata=((OUTPUT_STREAM_METADATA, f"{stream_id}:{i}"),))
                     for i in range(4)]
            batch = await asyncio.wait_for(call.read(), 30)  # they run
            assert batch.tags
            call.cancel()
            codes = []
            for c in calls:
                with pytest.raises(grpc.aio.AioRpcError) as ended:
                    await asyncio.wait_for(c.read(), 30)
                codes.append(ended.value.code())
            return codes

    assert asyncio.run(run()) == [grpc.StatusCode.UNAVAILABLE] * 4


def test_open_streams_are_bounded(cluster):
    async def run():
        channels = [_channel(cluster) for _ in range(70)]
        try:
            calls = [cluster.credentials.stub(worker_pb2_grpc.WorkerStub, ch).StreamOutputs(
                worker_pb2.StreamOutputsRequest()) for ch in channels]
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


def test_the_router_streams_through_the_output_stream(cluster, no_leaked_blocks):
    """Through the router: every client stream gets its tokens (equal to the worker's own calls)
    while the router reads one output stream from the worker."""
    requests = [_request(50 + i) for i in range(NUM_REQUESTS)]

    async def run():
        expected = await _tokens_on_their_own_calls(cluster, requests)
        async with grpc.aio.insecure_channel(cluster.address) as channel:
            router = llm_pb2_grpc.AsyncLLMStub(channel)

            async def one(request):
                return [t async for msg in router.Generate(request) for out in msg.outputs for t in out.token_ids]
            got = await asyncio.gather(*map(one, requests))
        return expected, dict(zip((r.request_id for r in requests), got))

    expected, got = asyncio.run(run())
    assert got == expected
    assert worker_state(cluster.workers[0].address).num_output_streams == 1  # the router's


def test_aborted_and_several_sequence_requests_end_on_the_stream(cluster, no_leaked_blocks):
    """An Abort ends a streamed request with finish_reason cancelled in its last batch; a request
    of n=2 sequences (which takes the worker's usual path, not the fast one) streams both."""
    async def run():
        async with _channel(cluster) as channel:
            call, stream_id = await _open(cluster, channel)
            llm = cluster.credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)
            long = _request(200, max_tokens=3000)
            pair = _request(201)
            pair.sampling_params.n = 2
            pair.sampling_params.temperature = 0.8
            pair.sampling_params.seed = 5
            calls = [llm.Generate(long, metadata=((OUTPUT_STREAM_METADATA, f"{stream_id}:1"),)),
                     llm.Generate(pair, metadata=((OUTPUT_STREAM_METADATA, f"{stream_id}:2"),))]
            outputs: dict[int, list] = {1: [], 2: []}
            ended: set[int] = set()
            aborted = False
            while len(ended) < 2:
                batch = await asyncio.wait_for(call.read(), 30)
                for tag, out in _entries(batch):
                    outputs[tag].append(out)
                ended.update(batch.ended)
                if outputs[1] and not aborted:
                    aborted = (await llm.Abort(llm_pb2.AbortRequest(request_id=long.request_id))).aborted
            codes = [await c.code() for c in calls]
            call.cancel()
            return aborted, outputs, codes

    aborted, outputs, codes = asyncio.run(run())
    assert aborted and codes == [grpc.StatusCode.OK] * 2
    last = outputs[1][-1]
    assert last.finished and last.outputs[0].finish_reason == types_pb2.FINISH_REASON_CANCELLED
    tokens = {0: [], 1: []}
    for out in outputs[2]:
        for comp in out.outputs:
            tokens[comp.index].extend(comp.token_ids)
    assert outputs[2][-1].finished and [len(t) for t in tokens.values()] == [MAX_TOKENS, MAX_TOKENS]


def test_a_lagging_clients_outputs_are_merged_in_the_routers_inbox():
    """The router reads a worker's stream as it comes; what a slow client has not taken yet is
    held as one merged message, not one message per engine step."""
    from tandem.router.output_streams import MAX_PENDING_OUTPUTS, Inbox, streamed_outputs
    from tandem.router import output_streams

    async def run():
        inbox = Inbox()
        for step in range(3 * MAX_PENDING_OUTPUTS + 5):
            msg = types_pb2.RequestOutput(request_id="slow", finished=False)
            msg.outputs.add(index=0, token_ids=[step])
            inbox.put(msg)
        assert len(inbox.items) <= MAX_PENDING_OUTPUTS
        inbox.put(output_streams.ENDED)
        return [m async for m in streamed_outputs(inbox)]

    messages = asyncio.run(run())
    assert len(messages) == 1
    assert list(messages[0].outputs[0].token_ids) == list(range(3 * MAX_PENDING_OUTPUTS + 5))


class _ScriptedCall:
    """A StreamOutputs call that reads a fixed list of batches, then EOF (the router's reader
    is tested against the exact interleavings a real worker cannot be made to produce)."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.cancelled = False

    async def read(self):
        await asyncio.sleep(0)
        return self.batches.pop(0) if self.batches else grpc.aio.EOF

    def cancel(self):
        self.cancelled = True


def test_an_output_for_an_ended_relay_goes_to_the_orphan_handler_and_eof_fails_the_rest():
    """A handoff that arrives after its relay ended (its call was cancelled just as the prefill
    answered) is handed to on_orphan (the pool releases its lease); the stream's end fails the
    relays still attached and cancels the call."""
    from tandem.router import output_streams

    async def run():
        orphans = []
        handoff = types_pb2.RequestOutput(request_id="late", finished=True)
        handoff.outputs.add(index=0).disaggregated_params.ctx_request_id = 42
        mine = types_pb2.RequestOutput(request_id="live")
        call = _ScriptedCall([worker_pb2.OutputBatch(tags=[9, 1], outputs=[handoff, mine])])
        stream = output_streams._OpenStream(call, "s", orphans.append)
        tag, inbox = stream.attach()
        assert tag == 1
        first = await inbox.take()
        second = await inbox.take()
        await asyncio.sleep(0)
        return orphans, first, second, call.cancelled, stream.attach()

    orphans, first, second, cancelled, late_attach = asyncio.run(run())
    assert [o.request_id for o in orphans] == ["late"]
    assert [o.request_id for o in first] == ["live"]
    assert isinstance(second[0], grpc.aio.AioRpcError) and second[0].code() == grpc.StatusCode.UNAVAILABLE
    assert cancelled and late_attach is None  # a failed stream takes no new relay


def test_lone_tokens_read_as_the_messages_they_stand_for_in_order():
    """The router rebuilds each lone token as the message the worker would have sent (its
    request id from the request's earlier message), in entry order among full messages; a
    malformed batch fails the stream (its requests fail over) before any of it is delivered."""
    from tandem.router import output_streams

    def full(request_id, tokens, finished=False):
        msg = types_pb2.RequestOutput(request_id=request_id, finished=finished)
        msg.outputs.add(index=0, token_ids=tokens, cumulative_logprob=-float(len(tokens)))
        return msg

    async def run(batches):
        stream = output_streams._OpenStream(_ScriptedCall(batches), "s")
        inboxes = [stream.attach()[1], stream.attach()[1]]
        received = {1: [], 2: []}
        for tag, inbox in enumerate(inboxes, start=1):
            while True:
                items = await inbox.take()
                received[tag] += items
                if not all(i.__class__ is types_pb2.RequestOutput for i in items):
                    break
        return received

    batches = [
        worker_pb2.OutputBatch(tags=[1, 2], outputs=[full("a", [5]), full("b", [6, 7])]),
        worker_pb2.OutputBatch(tags=[2, 1, 1, 2], outputs=[full("a", [11], finished=True)],
                               tokens=[8, 9, -1, 10], cumulative_logprobs=[-3.0, -2.0, 0.0, -4.0], ended=[1]),
        worker_pb2.OutputBatch(tags=[2], outputs=[full("b", [12], finished=True)], ended=[2]),
    ]
    received = asyncio.run(run(batches))
    a, b = received[1], received[2]
    assert a[-1] is output_streams.ENDED and b[-1] is output_streams.ENDED
    assert [(m.request_id, list(m.outputs[0].token_ids), m.outputs[0].cumulative_logprob, m.finished)
            for m in a[:-1]] == [("a", [5], -1.0, False), ("a", [9], -2.0, False), ("a", [11], -1.0, True)]
    assert [(m.request_id, list(m.outputs[0].token_ids), m.outputs[0].cumulative_logprob)
            for m in b[:-1]] == [("b", [6, 7], -2.0), ("b", [8], -3.0), ("b", [10], -4.0), ("b", [12], -1.0)]
    lone = types_pb2.RequestOutput(request_id="b")
    lone.outputs.add(index=0, token_ids=[8], cumulative_logprob=-3.0)
    assert b[1].SerializeToString() == lone.SerializeToString()  # what the worker's full message would be

    for bad in (dict(tags=[1, 2], outputs=[full("a", [5])], tokens=[-1, 3]),  # no logprobs
                dict(tags=[1], outputs=[full("a", [5])], tokens=[4], cumulative_logprobs=[0]),  # an output too many
                dict(tags=[1, 2], outputs=[full("a", [5])], tokens=[-1, -1], cumulative_logprobs=[0, 0]),
                dict(tags=[1], outputs=[], tokens=[4, 5], cumulative_logprobs=[0, 0])):
        bad = [worker_pb2.OutputBatch(**bad)]
        received = asyncio.run(run(bad))
        failure = received[1][0]  # nothing of the batch was delivered
        assert isinstance(failure, grpc.aio.AioRpcError) and failure.code() == grpc.StatusCode.INTERNAL, failure
        assert "malformed output batch" in failure.details()


def test_a_stream_interval_sends_the_same_tokens_in_fewer_messages(cluster, no_leaked_blocks):
    """--stream-interval 4: the first message at once, then at least 4 new tokens a message, the
    last at once; the tokens, finish reasons and cumulative logprobs are those of interval 1."""
    from tandem.client import AsyncLLM

    async def stream(address, prompt, params):
        llm = await AsyncLLM(address)
        try:
            steps = []  # per message: new tokens (all sequences), finished
            async for out in llm.generate_async(prompt, params, streaming=True):
                steps.append((sum(len(o.token_ids_diff) for o in out.outputs), out.finished))
            final = [(list(o.token_ids), o.finish_reason, o.cumulative_logprob) for o in out.outputs]
            return steps, final
        finally:
            llm.close()

    async def run():
        results = []
        for seed, (max_tokens, n) in enumerate(((25, 1), (1, 1), (9, 2))):
            rng = random.Random(seed)
            prompt = [1] + [rng.randrange(4, 200) for _ in range(12)]
            params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False, n=n,
                                    **({"temperature": 0.9, "seed": 3} if n > 1 else {}))
            every = await stream(cluster.address, prompt, params)
            grouped = await stream(cluster.service("router-interval").address, prompt, params)
            results.append((max_tokens, n, every, grouped))
        return results

    for max_tokens, n, (every_steps, every_final), (steps, final) in asyncio.run(run()):
        assert final == every_final, (max_tokens, n)
        assert sum(k for k, _ in steps) == sum(k for k, _ in every_steps) == max_tokens * n
        assert steps[0][0] >= 1  # the first token at once
        assert [finished for _, finished in steps] == [False] * (len(steps) - 1) + [True]
        assert all(k >= STREAM_INTERVAL for k, _ in steps[1:-1]), steps  # between: at least the interval
        assert len(steps) <= 2 + (max_tokens * n - 1) // STREAM_INTERVAL, steps
        if max_tokens * n > 2 * STREAM_INTERVAL:
            assert len(steps) < len(every_steps), (steps, every_steps)


def test_every_n_tokens_holds_tokens_until_the_interval_and_never_drops_them():
    from tandem.common.outputs import every_n_tokens

    def msg(tokens, finished=False):
        out = types_pb2.RequestOutput(request_id="r", finished=finished)
        out.outputs.add(index=0, token_ids=tokens)
        return out

    async def source(items):
        for item in items:
            if isinstance(item, Exception):
                raise item
            yield item

    async def collect(items, interval):
        got = []
        try:
            async for m in every_n_tokens(source(items), interval):
                got.append((list(m.outputs[0].token_ids), m.finished))
        except RuntimeError as exc:
            got.append(str(exc))
        return got

    ones = [msg([t]) for t in range(1, 8)] + [msg([8], finished=True)]
    assert asyncio.run(collect(ones, 3)) == [([1], False), ([2, 3, 4], False), ([5, 6, 7], False), ([8], True)]
    assert asyncio.run(collect(ones[:5] + [msg([6], finished=True)], 3)) == [
        ([1], False), ([2, 3, 4], False), ([5, 6], True)]
    assert asyncio.run(collect([msg([1]), msg([2, 3, 4, 5]), msg([6])], 3)) == [([1], False), ([2, 3, 4, 5], False),
                                                                              ([6], False)]
    # A failure after held tokens: they go on first, then the error.
    assert asyncio.run(collect([msg([1]), msg([2]), msg([3]), RuntimeError("worker lost")], 3)) == [
        ([1], False), ([2, 3], False), "worker lost"]


@pytest.mark.parametrize("value", ["0", "257", "-3"])
def test_a_stream_interval_out_of_range_is_refused_with_what_to_give(value):
    import subprocess
    import sys
    proc = subprocess.run([sys.executable, "-m", "tandem.cli.main", "serve", "router", "--workers", "127.0.0.1:1",
                           "--stream-interval", value], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2, proc.stderr[-500:]
    assert f"stream_interval must be between 1 and 256, got {value}" in proc.stderr
