"""Graceful drain: on a stop request health turns NOT_SERVING at once, in-flight work finishes
within --drain-seconds, and only then does the process exit.

The GrpcServer cases run a real server in-process on loopback (a slow stream stands in for a
generation); the last case SIGTERMs a decode worker process in the middle of a disaggregated stream.
"""

from __future__ import annotations

import asyncio
import signal
import threading
import time

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tandem.common.server import GrpcServer
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2

SERVICE = "tandem.test.Drain"
NUM_MESSAGES, MESSAGE_INTERVAL_S = 20, 0.05


async def _slow_stream(request, context):
    for i in range(NUM_MESSAGES):
        await asyncio.sleep(MESSAGE_INTERVAL_S)
        yield bytes([i])


async def _endless_stream(request, context):
    while True:
        await asyncio.sleep(MESSAGE_INTERVAL_S)
        yield b"."


def _server(drain_seconds: float) -> GrpcServer:
    server = GrpcServer("127.0.0.1", 0, [SERVICE], drain_seconds=drain_seconds)
    handlers = {
        name: grpc.unary_stream_rpc_method_handler(fn)
        for name, fn in (("Generate", _slow_stream), ("StreamStats", _endless_stream))
    }
    server.server.add_generic_rpc_handlers(
        [grpc.method_handlers_generic_handler(SERVICE, handlers)]
    )
    return server


async def _aio_health(channel: grpc.aio.Channel) -> str:
    response = await health_pb2_grpc.HealthStub(channel).Check(
        health_pb2.HealthCheckRequest(), timeout=1
    )
    return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)


async def _read_after_stop(drain_seconds: float, method: str, stop_after: int):
    """Streams `method`, asks the server to stop after `stop_after` messages; returns
    (messages, error code or None, health right after the stop request, seconds the server took to stop)."""
    server = _server(drain_seconds)
    await server.start()
    await server.set_serving(True)
    stopper = asyncio.create_task(server.wait_for_stop())
    async with grpc.aio.insecure_channel(server.address) as channel:
        received, code, health_after_stop, stop_started = [], None, None, None
        try:
            async for message in channel.unary_stream(f"/{SERVICE}/{method}")(b""):
                received.append(message)
                if len(received) == stop_after:
                    stop_started = time.monotonic()
                    server.request_stop()
                    await asyncio.sleep(0)
                    health_after_stop = await _aio_health(channel)
        except grpc.aio.AioRpcError as exc:
            code = exc.code()
        await asyncio.wait_for(stopper, 10)
    return received, code, health_after_stop, time.monotonic() - stop_started


def test_a_stream_in_flight_finishes_within_the_drain_window():
    received, code, health, stop_s = asyncio.run(_read_after_stop(10, "Generate", stop_after=3))
    assert health == "NOT_SERVING"
    assert code is None and len(received) == NUM_MESSAGES
    assert stop_s < 5, (
        "the server stops as soon as the stream is done, not at the end of the window"
    )


def test_the_drain_window_bounds_the_wait():
    received, code, health, stop_s = asyncio.run(_read_after_stop(0.3, "Generate", stop_after=3))
    assert health == "NOT_SERVING"
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert len(received) < NUM_MESSAGES
    assert 0.3 <= stop_s < 3


def test_subscriptions_do_not_hold_the_drain():
    received, code, _, stop_s = asyncio.run(_read_after_stop(10, "StreamStats", stop_after=2))
    assert code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNAVAILABLE)
    assert stop_s < 2


def test_drain_checks_hold_the_stop_and_a_second_request_cuts_it_short():
    async def scenario():
        server = GrpcServer("127.0.0.1", 0, [SERVICE], drain_seconds=10)
        busy = True
        server.add_drain_check(lambda: not busy)
        await server.start()
        stopper = asyncio.create_task(server.wait_for_stop())
        server.request_stop()
        await asyncio.sleep(0.3)
        held = not stopper.done()
        busy = False
        await asyncio.wait_for(stopper, 2)

        server = GrpcServer("127.0.0.1", 0, [SERVICE], drain_seconds=10)
        server.add_drain_check(lambda: False)
        await server.start()
        stopper = asyncio.create_task(server.wait_for_stop())
        server.request_stop()
        await asyncio.sleep(0.2)
        server.request_stop()
        await asyncio.wait_for(stopper, 2)
        return held

    assert asyncio.run(scenario())


def test_health_watch_sees_not_serving_first_and_does_not_hold_the_drain():
    async def scenario():
        server = _server(drain_seconds=60)
        await server.start()
        await server.set_serving(True)
        stopper = asyncio.create_task(server.wait_for_stop())
        seen = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            try:
                async for response in health_pb2_grpc.HealthStub(channel).Watch(
                    health_pb2.HealthCheckRequest()
                ):
                    seen.append(health_pb2.HealthCheckResponse.ServingStatus.Name(response.status))
                    if len(seen) == 1:
                        server.request_stop()
            except grpc.aio.AioRpcError:
                pass  # the server stopped
        await asyncio.wait_for(stopper, 10)  # a Watch that held the drain would take its 60 s
        return seen

    assert asyncio.run(scenario()) == ["SERVING", "NOT_SERVING"]


def test_negative_drain_is_refused():
    with pytest.raises(ValueError, match="drain_seconds"):
        GrpcServer("127.0.0.1", 0, [SERVICE], drain_seconds=-1)


def _generate(address: str, max_tokens: int, on_message=None) -> list[int]:
    request = llm_pb2.GenerateRequest(
        prompt=types_pb2.Prompt(token_ids=types_pb2.TokenIds(ids=[1, 5, 9, 13])),
        streaming=True,
        sampling_params=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True),
    )
    tokens: list[int] = []
    with grpc.insecure_channel(address) as channel:
        for output in llm_pb2_grpc.AsyncLLMStub(channel).Generate(request, timeout=120):
            tokens += output.outputs[0].token_ids
            if on_message is not None:
                on_message(len(tokens))
    return tokens


def _watch_health(
    address: str, statuses: list[tuple[str, int]], progress: list[int], first: threading.Event
) -> None:
    """Health changes as the Watch stream reports them, each with the client's token count at that moment."""
    with grpc.insecure_channel(address) as channel:
        try:
            for response in health_pb2_grpc.HealthStub(channel).Watch(
                health_pb2.HealthCheckRequest(), timeout=120
            ):
                statuses.append(
                    (
                        health_pb2.HealthCheckResponse.ServingStatus.Name(response.status),
                        progress[-1],
                    )
                )
                first.set()
        except grpc.RpcError:
            pass  # the server stopped


def test_sigterm_of_a_decode_worker_lets_its_stream_finish(model_dirs):
    """1 prefill + 1 decode: nowhere to migrate to, so the stream completes only if the decode drains.
    The stream is long (seconds of generation), so the SIGTERM lands while the decode still generates."""
    max_tokens = 1500
    cluster = LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "256"],
        worker_args={"decode-1": ["--drain-seconds", "60"]},
    )
    with cluster:
        decode = cluster.workers[1]
        reference = _generate(cluster.address, max_tokens)
        progress, statuses, watching = [0], [], threading.Event()
        watcher = threading.Thread(
            target=_watch_health, args=(decode.address, statuses, progress, watching)
        )
        watcher.start()
        assert watching.wait(10) and statuses[0][0] == "SERVING"

        terminated = threading.Event()

        def sigterm_once(num_tokens: int) -> None:
            progress.append(num_tokens)
            if num_tokens >= 8 and not terminated.is_set():
                terminated.set()
                decode.process.send_signal(signal.SIGTERM)

        tokens = _generate(cluster.address, max_tokens, on_message=sigterm_once)
        stream_done = time.monotonic()
        watcher.join(30)
        assert terminated.is_set()
        assert tokens == reference, "the drained stream is the uninterrupted one, token for token"
        assert [status for status, _ in statuses] == ["SERVING", "NOT_SERVING"], (
            statuses,
            decode.log_tail(),
        )
        assert statuses[1][1] < max_tokens, (
            "health turned NOT_SERVING while the stream was still going"
        )
        assert decode.process.wait(timeout=20) == 0, decode.log_tail()
        assert time.monotonic() - stream_done < 15, (
            "the worker exits once drained, not at the end of its window"
        )
        # (the whole log: the streams cancelled at the stop add tracebacks after these lines)
        logged = decode.log_tail(10_000)
        assert "stopping" in logged and "drained" in logged


def test_liveness_is_answering_and_readiness_is_serving_drain_included():
    """tandem.liveness is SERVING from the start, before readiness and through the drain (a
    liveness probe must not restart a router whose workers are down, nor a draining process);
    readiness, once NOT_SERVING for the drain, stays so whatever the process sets."""
    from tandem.common.health import LIVENESS_SERVICE

    async def check(channel, service: str) -> str:
        response = await health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=service), timeout=1
        )
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    async def scenario():
        server = _server(drain_seconds=1)
        await server.start()
        seen = []
        async with grpc.aio.insecure_channel(server.address) as channel:
            seen.append((await check(channel, ""), await check(channel, LIVENESS_SERVICE)))
            await server.set_serving(True)
            seen.append((await check(channel, ""), await check(channel, LIVENESS_SERVICE)))
            stream = channel.unary_stream(f"/{SERVICE}/Generate")(b"")
            await stream.read()  # in flight: the drain waits for it
            stopper = asyncio.create_task(server.wait_for_stop())
            server.request_stop()
            await asyncio.sleep(0.1)
            await server.set_serving(True)  # e.g. the router's health loop: ignored now
            seen.append((await check(channel, ""), await check(channel, LIVENESS_SERVICE)))
            stream.cancel()
            await asyncio.wait_for(stopper, 10)
        return seen

    assert asyncio.run(scenario()) == [
        ("NOT_SERVING", "SERVING"),
        ("SERVING", "SERVING"),
        ("NOT_SERVING", "SERVING"),
    ]
