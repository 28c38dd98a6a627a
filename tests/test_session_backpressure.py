"""A router that reads a worker's session slowly (its core saturated) holds the worker's writes back
instead of buffering the backlog unread, so the worker merges the steps it could not write into
fewer, larger batches (router/workers.py WORKER_CHANNEL_OPTIONS, worker/output_streams.py).

A real gRPC server on loopback writes a session's batches with the worker's OutputStream, an
engine step of lone tokens at a time as fast as it can; the reader opens its channel as the
router opens a worker's and reads one batch per few milliseconds."""
from __future__ import annotations

import asyncio
import random

import grpc
import pytest

from tandem.common.channels import ClusterCredentials
from tandem.router.workers import WORKER_CHANNEL_OPTIONS
from tandem.testing.cluster import free_port
from tandem.v1 import worker_pb2, worker_pb2_grpc
from tandem.worker.output_streams import OutputStream

NUM_REQUESTS = 32


async def _serve_steps(num_steps: int, produced: list[int]):
    """A server whose Session streams num_steps engine steps (a lone token for each of NUM_REQUESTS
    tags per step), pushed as fast as the writer takes them; produced[0] counts the steps pushed."""
    rng = random.Random(0)

    async def session(request_iterator, context):
        stream = OutputStream()

        async def engine():
            for _ in range(num_steps):
                for tag in range(NUM_REQUESTS):
                    stream.push_token(tag, rng.randrange(1 << 17), -rng.random(), lambda error: None)
                produced[0] += 1
                await asyncio.sleep(0)  # one step per turn of the loop: the writer runs between steps
            for tag in range(NUM_REQUESTS):
                stream.end(tag)
            stream.finish()

        task = asyncio.ensure_future(engine())
        try:
            async for batch in stream.batches():
                yield batch
        finally:
            task.cancel()

    server = grpc.aio.server()
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("tandem.v1.Worker", {
        "Session": grpc.stream_stream_rpc_method_handler(
            session, request_deserializer=worker_pb2.SessionRequest.FromString,
            response_serializer=worker_pb2.OutputBatch.SerializeToString)})])
    port = free_port()
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("seed", [0, 1])
def test_a_slow_reader_gets_the_backlog_merged_not_buffered(seed):
    num_steps = 3000  # ~400 bytes a step: ~1.2 MB of one-step batches, ~70x the router's read-ahead

    async def run():
        produced = [0]
        server, address = await _serve_steps(num_steps, produced)
        channel = ClusterCredentials().open(address, WORKER_CHANNEL_OPTIONS)
        call = worker_pb2_grpc.WorkerStub(channel).Session()
        tokens = {tag: 0 for tag in range(NUM_REQUESTS)}
        num_batches, ahead = 0, []
        rng = random.Random(seed)
        try:
            assert (await call.read()).stream_id  # the first batch names the stream
            while (batch := await asyncio.wait_for(call.read(), 30)) is not grpc.aio.EOF:
                num_batches += 1
                for tag in batch.tags:
                    tokens[tag] += 1
                # Steps the worker pushed that this reader has not read: what waits in the worker
                # (merged) or in flight (at most the window).
                ahead.append(produced[0] - max(tokens.values()))
                await asyncio.sleep(rng.uniform(0.002, 0.004))  # a saturated router's pace
        finally:
            await channel.close()
            await server.stop(None)
        return tokens, num_batches, ahead

    tokens, num_batches, ahead = asyncio.run(asyncio.wait_for(run(), 120))
    assert tokens == {tag: num_steps for tag in range(NUM_REQUESTS)}, "every token arrives, in full"
    # Held back, the worker merges them (25-28 batches here); with gRPC's default window the
    # steps waited unread in the reader's buffer, one a batch (820-930 batches here).
    assert num_batches < num_steps / 20, f"{num_batches} batches for {num_steps} steps: the backlog was not merged"
    assert max(ahead) > 20, "the worker ran ahead of the reader (or the test measured nothing)"
