"""A router that reads a worker's session slowly (its core saturated) holds the worker's writes back
instead of buffering the backlog unread, so the worker merges the steps it could not write into
fewer, larger batches (router/workers.py WORKER_CHANNEL_OPTIONS, worker/output_streams.py).

A real gRPC server on loopback writes a session's batches with the worker's OutputStream, an
engine step of token entries at a time as fast as it can; the reader opens its channel as the
router opens a worker's and reads one batch per few milliseconds, and, for comparison in the same
run, with gRPC's default channel."""

from __future__ import annotations

import asyncio
import random

import grpc

from tandem.common.channels import ClusterCredentials
from tandem.router import workers
from tandem.router.workers import WORKER_CHANNEL_OPTIONS, WorkerPool
from tandem.testing.cluster import free_port
from tandem.v1 import types_pb2, worker_pb2, worker_pb2_grpc
from tandem.worker.output_streams import OutputStream

NUM_REQUESTS, NUM_STEPS = 32, 3000  # ~400 bytes a step: ~1.2 MB of one-step batches


async def _serve_steps(produced: list[int]):
    """A server whose every Session streams NUM_STEPS engine steps (a token entry for each of
    NUM_REQUESTS tags per step), pushed as fast as the writer takes them; produced[0] counts the
    steps pushed by the latest session."""
    rng = random.Random(0)

    async def session(request_iterator, context):
        stream = OutputStream()
        produced[0] = 0

        async def engine():
            for _ in range(NUM_STEPS):
                for tag in range(NUM_REQUESTS):
                    stream.push_tokens(
                        tag, [rng.randrange(1 << 17)], -rng.random(), lambda error: None
                    )
                produced[0] += 1
                await asyncio.sleep(
                    0
                )  # one step per turn of the loop: the writer runs between steps
            for tag in range(NUM_REQUESTS):
                stream.push(tag, types_pb2.RequestOutput(finished=True))
            stream.finish()

        task = asyncio.ensure_future(engine())
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            task.cancel()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers(
        [
            grpc.method_handlers_generic_handler(
                "tandem.v1.Worker",
                {
                    "Session": grpc.stream_stream_rpc_method_handler(
                        session,
                        request_deserializer=worker_pb2.SessionRequest.FromString,
                        response_serializer=worker_pb2.EngineOutputs.SerializeToString,
                    )
                },
            )
        ]
    )
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


async def _read_slowly(
    address: str, options, produced: list[int]
) -> tuple[dict[int, int], int, int]:
    """(tokens per tag, batches, most steps the worker was ahead of this reader)."""
    channel = ClusterCredentials().open(address, options)
    call = worker_pb2_grpc.WorkerStub(channel).Session()
    tokens = {tag: 0 for tag in range(NUM_REQUESTS)}
    num_batches = ahead = 0
    rng = random.Random(0)
    try:
        assert (await call.read()).stream_id  # the first batch names the stream
        while (batch := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
            num_batches += 1
            for entry in batch.outputs:
                tokens[entry.tag] += len(entry.new_token_ids)
            ahead = max(ahead, produced[0] - max(tokens.values()))
            await asyncio.sleep(rng.uniform(0.002, 0.004))  # a saturated router's pace
    finally:
        await channel.close()
    return tokens, num_batches, ahead


def test_a_slow_reader_gets_the_backlog_merged_not_buffered():
    async def run():
        produced = [0]
        server, address = await _serve_steps(produced)
        try:
            router = await _read_slowly(address, WORKER_CHANNEL_OPTIONS, produced)
            default = await _read_slowly(address, (), produced)
        finally:
            await server.stop(None)
        return router, default

    (tokens, num_batches, ahead), (default_tokens, default_batches, _) = asyncio.run(
        asyncio.wait_for(run(), 120)
    )
    every = {tag: NUM_STEPS for tag in range(NUM_REQUESTS)}
    assert tokens == every and default_tokens == every, "every token arrives, in full"
    assert ahead > 20, "the worker ran ahead of the reader (or the test measured nothing)"
    # Held back, the worker merges the steps (27-37 batches here); with gRPC's default window they
    # waited unread in the reader's buffer, one or two a batch (1,100-2,000 batches here).
    assert num_batches * 5 < default_batches, (
        f"{num_batches} batches against {default_batches} with gRPC's window"
    )


def test_the_router_opens_its_worker_channels_with_the_read_ahead_bound():
    opened = []

    class Credentials(ClusterCredentials):
        def open(self, target, options=()):
            opened.append((target, list(options)))
            return super().open(target, options)

    async def run():
        pool = WorkerPool(["127.0.0.1:1"], 1.0, Credentials())
        await pool.close()

    asyncio.run(run())
    assert opened == [("127.0.0.1:1", workers.WORKER_CHANNEL_OPTIONS)]
