"""What the router adds (issue 11): its latency on a small request and the streamed tokens it
relays per CPU-second of its own process, against clients talking to a worker directly, in the
same run, on the tiny model on CPU.

Latency: a 4-token prompt, max_tokens=1, one call at a time, router and direct interleaved;
the router's added latency is the difference of the percentiles. Throughput: many concurrent
streams of many tokens (ignore_eos); the engine on the worker is the bottleneck of the wall-clock
rate on a CPU, so the router's figure is normalised by its own CPU time (psutil, user+system of
the router process): tokens relayed per router CPU-second = streamed tokens/s per router core.

    python bench/router.py                      # 300 latency samples, 32 streams x 256 tokens
    python bench/router.py --streams 64 --tokens 512
    python bench/router.py --stream-interval 4  # also a router that sends >= 4 tokens a message

This is the router's CPU per token at a load the router keeps up with (it is woken once per
engine step). What one router core carries when it is the bottleneck (it then merges each
request's backlog into fewer messages) is bench/router_capacity.py's measure.

With --stream-interval N > 1 a second router (`--stream-interval N`) streams the same workload:
the same tokens in about N times fewer messages to the clients.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import platform
import time

import psutil

from tandem.engine.checkpoints import tiny_model_dir
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, llm_pb2_grpc

GOAL_ADDED_P50_MS = 1.0
GOAL_TOKENS_PER_CORE = 20_000


def _request(max_tokens: int, prompt: list[int]) -> llm_pb2.GenerateRequest:
    request = llm_pb2.GenerateRequest(streaming=True)
    request.prompt.token_ids.ids[:] = prompt
    request.sampling_params.max_tokens = max_tokens
    request.sampling_params.ignore_eos = True
    request.sampling_params.detokenize = False
    return request


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


async def _latency(
    stubs: dict[str, llm_pb2_grpc.AsyncLLMStub], samples: int
) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in stubs}
    request = _request(1, [1, 5, 6, 7])
    for i in range(samples + 20):
        for name, stub in stubs.items():
            started = time.perf_counter()
            async for _ in stub.Generate(request):
                pass
            if i >= 20:  # warm-up
                times[name].append((time.perf_counter() - started) * 1e3)
    return times


async def _stream(
    stub: llm_pb2_grpc.AsyncLLMStub, streams: int, tokens: int
) -> tuple[int, int, float]:
    """(tokens received, messages received, seconds)."""
    counts = [0, 0]

    async def one(i: int):
        async for msg in stub.Generate(_request(tokens, [1, 5 + i % 50, 6, 7])):
            counts[0] += sum(len(o.token_ids) for o in msg.outputs)
            counts[1] += 1

    started = time.perf_counter()
    await asyncio.gather(*(one(i) for i in range(streams)))
    return counts[0], counts[1], time.perf_counter() - started


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


async def main(args) -> None:
    model = tiny_model_dir()
    engine_args = [
        "--model",
        str(model),
        "--num-blocks",
        "2048",
        "--block-size",
        "16",
        "--max-num-seqs",
        "128",
    ]
    interval_name = f"router/{args.stream_interval}"
    with LocalCluster(roles=["both"], engine_args=engine_args, metrics=False) as cluster:
        credentials = cluster.credentials
        channels = [credentials.open(cluster.address), credentials.open(cluster.workers[0].address)]
        stubs = {
            "router": credentials.stub(llm_pb2_grpc.AsyncLLMStub, channels[0]),
            "direct": credentials.stub(llm_pb2_grpc.AsyncLLMStub, channels[1]),
        }
        processes = {"router": psutil.Process(cluster.router.process.pid)}
        if args.stream_interval > 1:
            service = cluster.add_router(
                "router-interval", ["--stream-interval", str(args.stream_interval)]
            )
            channels.append(credentials.open(service.address))
            stubs[interval_name] = credentials.stub(llm_pb2_grpc.AsyncLLMStub, channels[-1])
            processes[interval_name] = psutil.Process(service.process.pid)
        latency_cpu = _cpu_s(processes["router"])
        times = await _latency({name: stubs[name] for name in ("router", "direct")}, args.samples)
        # Over the whole phase, warm-up included: its background work (health polls) during the
        # direct calls counts too (~1.5% of a core here, ~0.1 ms per call pair).
        router_cpu_per_call = (_cpu_s(processes["router"]) - latency_cpu) / (args.samples + 20)
        await _stream(stubs["router"], 4, 16)  # warm-up
        results = {}
        for name in stubs:
            process = processes.get(name, processes["router"])
            cpu_before = _cpu_s(process)
            num_tokens, num_messages, seconds = await _stream(
                stubs[name], args.streams, args.tokens
            )
            results[name] = (num_tokens, num_messages, seconds, _cpu_s(process) - cpu_before)
        for channel in channels:
            await channel.close()

    print(
        f"# bench/router.py  {time.strftime('%Y-%m-%d')}  {platform.node()}  {os.cpu_count()} CPUs  "
        f"{platform.processor() or platform.machine()}"
    )
    print(f"latency, {args.samples} calls each (4-token prompt, max_tokens=1), ms:")
    print(f"{'':10}{'p50':>8}{'p99':>8}")
    for name in ("direct", "router"):
        print(f"{name:10}{_percentile(times[name], 0.5):8.2f}{_percentile(times[name], 0.99):8.2f}")
    added_p50 = _percentile(times["router"], 0.5) - _percentile(times["direct"], 0.5)
    added_p99 = _percentile(times["router"], 0.99) - _percentile(times["direct"], 0.99)
    print(
        f"{'added':10}{added_p50:8.2f}{added_p99:8.2f}   goal: p50 added < {GOAL_ADDED_P50_MS:.0f} ms"
    )
    print(f"router CPU per call: {router_cpu_per_call * 1e3:.2f} ms")
    print(f"\nstreaming, {args.streams} streams x {args.tokens} tokens:")
    print(
        f"{'':10}{'tokens':>8}{'msgs':>8}{'wall s':>8}{'tok/s':>9}{'router cpu s':>14}{'tok/router-core-s':>19}"
    )
    for name, (num_tokens, num_messages, seconds, cpu) in results.items():
        routed = name != "direct"
        per_core = f"{num_tokens / cpu:19,.0f}" if routed and cpu > 0 else f"{'-':>19}"
        print(
            f"{name:10}{num_tokens:8d}{num_messages:8d}{seconds:8.2f}{num_tokens / seconds:9,.0f}"
            f"{cpu if routed else 0:14.2f}{per_core}"
        )
    if args.stream_interval > 1:
        print(
            f"({interval_name}: a router with --stream-interval {args.stream_interval}, >= "
            f"{args.stream_interval} tokens a message but the first and the last)"
        )
    print(
        f"goal: >= {GOAL_TOKENS_PER_CORE:,} streamed tokens/s per router core (the wall rate is the "
        f"worker's engine on this CPU; per core = tokens / router CPU seconds, at this load: the "
        f"tokens/s a saturated core carries is bench/router_capacity.py's)"
    )
    ratio = (results["router"][0] / results["router"][2]) / (
        results["direct"][0] / results["direct"][2]
    )
    print(f"wall-clock rate through the router / direct: {ratio:.2f}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--samples", type=int, default=300)
    parser.add_argument("--streams", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=256)
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="also stream through a router with this --stream-interval (1: not)",
    )
    asyncio.run(main(parser.parse_args()))
