"""What the router pays per worker call to learn how it ended and to watch it (issue 11), on bare
grpc.aio: a unary-stream call that sends no message (a Generate whose outputs go on an output
stream), its end taken by a task reading the call (the router's report_end until 2026-12-02) or
by a done callback (now), with the hung-worker watchdog as a task (now) or a call_later timer.

    python bench/grpc_call_end.py               # 8 alternating blocks of 1,500 calls per way

CPU is the client process's (every thread: grpc's poller too), per call; the server runs in
another process. "none" takes no end at all: the floor for the first two.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import statistics
import time

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

# (how the call's end is taken, how the call is watched)
WAYS = [("task", "task"), ("callback", "task"), ("callback", "timer"), ("none", "timer")]


class _NoMessages(health_pb2_grpc.HealthServicer):
    async def Watch(self, request, context):
        return
        yield


def _serve(ports: multiprocessing.Queue) -> None:
    async def main():
        server = grpc.aio.server()
        health_pb2_grpc.add_HealthServicer_to_server(_NoMessages(), server)
        ports.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        await server.wait_for_termination()

    asyncio.run(main())


async def _read_end(call, ends: list) -> None:
    """report_end as it was: a task reading the call to its end."""
    try:
        async for msg in call:
            ends.append(msg)
    except asyncio.CancelledError:
        ends.append("cancelled")
    except grpc.aio.AioRpcError as exc:
        ends.append(exc)


async def _watch() -> None:
    while True:
        await asyncio.sleep(10.0)


async def _one_call(stub, end: str, watch: str, loop) -> None:
    call = stub.Watch(health_pb2.HealthCheckRequest())
    done = loop.create_future()
    call.add_done_callback(
        lambda _: done.done() or done.set_result(None)
    )  # how the bench waits, every way
    ends: list = []
    watchdog = (
        loop.create_task(_watch()) if watch == "task" else loop.call_later(10.0, lambda: None)
    )
    reader = loop.create_task(_read_end(call, ends)) if end == "task" else None
    if end == "callback":
        call.add_done_callback(ends.append)
    await done
    watchdog.cancel()
    if reader is not None:
        await reader


async def main(blocks: int, calls: int) -> None:
    ports: multiprocessing.Queue = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports,), daemon=True)
    server.start()
    loop = asyncio.get_running_loop()
    us = {way: [] for way in WAYS}
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{ports.get()}") as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            for way in WAYS:  # warm-up
                for _ in range(300):
                    await _one_call(stub, *way, loop)
            for block in range(blocks):
                for way in WAYS if block % 2 == 0 else WAYS[::-1]:
                    started = time.process_time()
                    for _ in range(calls):
                        await _one_call(stub, *way, loop)
                    us[way].append((time.process_time() - started) / calls * 1e6)
    finally:
        server.kill()
    print(
        f"# bench/grpc_call_end.py  {blocks} blocks x {calls} calls per way, client CPU per call (us)"
    )
    print("| end taken by | watchdog | median | blocks |")
    print("| --- | --- | ---: | --- |")
    for way in WAYS:
        print(
            f"| {way[0]} | {way[1]} | {statistics.median(us[way]):.0f} | {' '.join(f'{x:.0f}' for x in us[way])} |"
        )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--blocks", type=int, default=8)
    parser.add_argument("--calls", type=int, default=1500)
    args = parser.parse_args()
    asyncio.run(main(args.blocks, args.calls))
