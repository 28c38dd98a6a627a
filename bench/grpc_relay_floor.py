"""The floor under bench/router.py: what a bare grpc.aio relay costs on this machine. An upstream
server streams one-token RequestOutputs, a relay process forwards them (`async for msg in
stub.Generate(request): yield msg`, nothing else), a client reads them; the relay's CPU per
message (psutil) and the p50 latency it adds to a one-message stream. No tandem code runs in
the relay: a router at one token per message cannot cost less than this. The upstream's own CPU
per message is the floor of a server that only sends (a router whose worker outputs arrive
batched, on output streams, still sends one message per token to its clients).

With --session the relay holds one bidi stream to the upstream instead of a call per request
(requests go as messages on it; the upstream sends what all requests produced since its last
send as one EngineOutputs of one-token EngineOutput entries, which the relay turns into the
client's RequestOutputs as the router does): the floor of a router whose worker leg is
multiplexed both ways. Its "upstream" line is then a batching sender's cost, not one message per
token.

    python bench/grpc_relay_floor.py [--loop uvloop|asyncio] [--pace-ms 4] [--session]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import time

import grpc
import psutil

from tandem.common.engine_messages import OutputBuilder
from tandem.testing.cluster import free_port
from tandem.v1 import internal_pb2, llm_pb2, llm_pb2_grpc, types_pb2, worker_pb2


class Upstream(llm_pb2_grpc.AsyncLLMServicer):
    def __init__(self, num_messages: int, pace_s: float):
        self.num_messages, self.pace_s = num_messages, pace_s

    async def Generate(self, request, context):
        n = request.sampling_params.max_tokens or self.num_messages
        for i in range(n):
            out = types_pb2.RequestOutput(request_id=request.request_id, finished=i == n - 1)
            out.outputs.add(index=0, token_ids=[i])
            yield out
            if self.pace_s and i < n - 1:
                await asyncio.sleep(self.pace_s)


SESSION = "/floor.Session/Run"


def _session_handler(upstream: Upstream) -> grpc.GenericRpcHandler:
    """The upstream's multiplexed end: GenerateRequests in on one bidi stream (request_id = tag),
    EngineOutputs out, one per wake-up with what every request produced since the last."""

    async def run(requests, context):
        pending: list[internal_pb2.EngineOutput] = []
        wake = asyncio.Event()

        async def produce(request):
            n = request.sampling_params.max_tokens or upstream.num_messages
            tag = int(request.request_id)
            for i in range(n):
                pending.append(
                    internal_pb2.EngineOutput(
                        tag=tag, index=0, new_token_ids=[i], finished=i == n - 1
                    )
                )
                wake.set()
                if upstream.pace_s and i < n - 1:
                    await asyncio.sleep(upstream.pace_s)

        async def read():
            async for request in requests:
                tasks.add(asyncio.create_task(produce(request)))

        tasks: set = set()
        reader = asyncio.create_task(read())
        try:
            while True:
                await wake.wait()
                wake.clear()
                batch = worker_pb2.EngineOutputs(outputs=pending)
                pending.clear()
                yield batch
        finally:
            reader.cancel()

    return grpc.method_handlers_generic_handler(
        "floor.Session",
        {
            "Run": grpc.stream_stream_rpc_method_handler(
                run,
                request_deserializer=llm_pb2.GenerateRequest.FromString,
                response_serializer=worker_pb2.EngineOutputs.SerializeToString,
            )
        },
    )


class SessionRelay(llm_pb2_grpc.AsyncLLMServicer):
    """The relay over one multiplexed stream: no call per request on the upstream leg."""

    def __init__(self, upstream: str):
        self.upstream = upstream
        self.call = None
        self.inboxes: dict[str, asyncio.Queue] = {}

    async def _read(self):
        async for batch in self.call:
            for entry in batch.outputs:
                inbox = self.inboxes.get(str(entry.tag))
                if inbox is not None:
                    builder = OutputBuilder(str(entry.tag))
                    builder.add(entry)
                    inbox.put_nowait(builder.build())

    async def Generate(self, request, context):
        if self.call is None:
            channel = grpc.aio.insecure_channel(self.upstream)
            self.call = channel.stream_stream(
                SESSION,
                request_serializer=llm_pb2.GenerateRequest.SerializeToString,
                response_deserializer=worker_pb2.EngineOutputs.FromString,
            )()
            self.writes = asyncio.Queue()
            self.tasks = [asyncio.create_task(self._read()), asyncio.create_task(self._write())]
        inbox = self.inboxes[request.request_id] = asyncio.Queue()
        self.writes.put_nowait(request)
        try:
            while True:
                msg = await inbox.get()
                yield msg
                if msg.finished:
                    return
        finally:
            del self.inboxes[request.request_id]

    async def _write(self):
        while True:
            await self.call.write(await self.writes.get())


class Relay(llm_pb2_grpc.AsyncLLMServicer):
    def __init__(self, upstream: str):
        self.upstream = upstream
        self.stub = None

    async def Generate(self, request, context):
        if self.stub is None:
            self.stub = llm_pb2_grpc.AsyncLLMStub(grpc.aio.insecure_channel(self.upstream))
        async for msg in self.stub.Generate(request):
            yield msg


def _serve(servicer, port: int, loop: str) -> None:
    async def main():
        server = grpc.aio.server()
        llm_pb2_grpc.add_AsyncLLMServicer_to_server(servicer, server)
        if isinstance(servicer, Upstream):
            server.add_generic_rpc_handlers((_session_handler(servicer),))
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    if loop == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(main())
    else:
        asyncio.run(main())


async def _measure(args, relay_pid: int, upstream_pid: int, upstream: int, relay: int) -> None:
    stubs = {
        name: llm_pb2_grpc.AsyncLLMStub(grpc.aio.insecure_channel(f"127.0.0.1:{port}"))
        for name, port in (("direct", upstream), ("relay", relay))
    }

    async def one(stub, i: int, max_tokens: int) -> int:
        request = llm_pb2.GenerateRequest(request_id=str(i))
        request.sampling_params.max_tokens = max_tokens
        return sum([1 async for _ in stub.Generate(request)])

    times: dict[str, list[float]] = {name: [] for name in stubs}
    for i in range(args.samples + 20):
        for name, stub in stubs.items():
            started = time.perf_counter()
            await one(stub, i, 1)
            if i >= 20:
                times[name].append((time.perf_counter() - started) * 1e3)
    p50 = {name: sorted(v)[len(v) // 2] for name, v in times.items()}
    process, sender = psutil.Process(relay_pid), psutil.Process(upstream_pid)
    cpu, sender_cpu = sum(process.cpu_times()[:2]), sum(sender.cpu_times()[:2])
    counts = await asyncio.gather(
        *(one(stubs["relay"], i, args.tokens) for i in range(args.streams))
    )
    cpu = sum(process.cpu_times()[:2]) - cpu
    sender_cpu = sum(sender.cpu_times()[:2]) - sender_cpu
    print(
        f"# bench/grpc_relay_floor.py  {time.strftime('%Y-%m-%d')}  loop={args.loop}  {'session' if args.session else 'call per request'}  grpcio {grpc.__version__}"
    )
    print(
        f"latency p50, 1-message stream: direct {p50['direct']:.2f} ms, relay {p50['relay']:.2f} ms, "
        f"added {p50['relay'] - p50['direct']:.2f} ms"
    )
    print(
        f"{args.streams} streams x {args.tokens} messages (one token each, {args.pace_ms} ms apart): relay CPU "
        f"{cpu / sum(counts) * 1e6:.0f} us per message = {sum(counts) / cpu:,.0f} messages per relay CPU-second"
    )
    print(
        f"the upstream (sends only): {sender_cpu / sum(counts) * 1e6:.0f} us per message = "
        f"{sum(counts) / sender_cpu:,.0f} messages per CPU-second"
    )


def main(args) -> None:
    ctx = multiprocessing.get_context("spawn")
    upstream, relay = free_port("127.0.0.1"), free_port("127.0.0.1")
    relay_class = SessionRelay if args.session else Relay
    processes = [
        ctx.Process(
            target=_serve, args=(Upstream(args.tokens, args.pace_ms / 1e3), upstream, args.loop)
        ),
        ctx.Process(target=_serve, args=(relay_class(f"127.0.0.1:{upstream}"), relay, args.loop)),
    ]
    for p in processes:
        p.start()
    try:
        time.sleep(2)
        asyncio.run(_measure(args, processes[1].pid, processes[0].pid, upstream, relay))
    finally:
        for p in processes:
            p.terminate()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--loop", choices=("uvloop", "asyncio"), default="uvloop")
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--pace-ms", type=float, default=4.0, help="upstream's gap between messages of a stream"
    )
    parser.add_argument(
        "--session",
        action="store_true",
        help="relay over one multiplexed stream to the upstream (no call per request there)",
    )
    main(parser.parse_args())
