"""How many streamed tokens one router core carries (issue 11): the router pinned to one CPU, one
aggregated worker and the clients on the others, the same streams through the router and straight
to the worker, in one run.

bench/router.py prices the router at one token a message, while the worker is slower than the
router: ~60-70 us of router CPU a message, most of it grpc.aio's own send (a grpc.aio server that
only sends costs about as much). A loaded router does not fall behind token by token: outputs that
reach a request's inbox while its last message is being sent go out together in its next message
(router/inbox.py), so a saturated core sends fewer, larger messages and still carries every
token. This script measures that: the streamed tokens per second the pinned core delivers, its
CPU (1.0 = the whole core), tokens per message, and what it does to a stream's pace (its time
per output token, TPOT), against clients of the worker itself at the same load.

    python bench/router_capacity.py                        # CUDA if there is one, else CPU
    python bench/router_capacity.py --streams 64,256 --tokens 1500 --clients 8

On a 2-core machine the worker's engine (CPU) and the clients share the one other core, and the
offered load stays below what the router's core carries; `--clients-on-router-cpu` puts the
clients on the router's CPU instead, so that the router falls behind (it gets part of its core).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import platform
import statistics
import time
from pathlib import Path

import psutil

GOAL_TOKENS_PER_CORE = 20_000


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of pid onto cpus (affinity is per thread; threads started later inherit it)."""
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            os.sched_setaffinity(int(task.name), cpus)
        except (ProcessLookupError, PermissionError):
            pass


def _cpu_s(process: psutil.Process) -> float:
    times = process.cpu_times()
    return times.user + times.system


def _client(
    credentials, target: str, cpus: set[int], streams: range, tokens: int, ready, go, results
) -> None:
    """One client process: its streams at once, each a Generate of `tokens` token ids."""
    os.sched_setaffinity(0, cpus)
    asyncio.run(_client_streams(credentials, target, streams, tokens, ready, go, results))


async def _client_streams(credentials, target, streams, tokens, ready, go, results) -> None:
    from tandem.v1 import llm_pb2, llm_pb2_grpc

    channel = credentials.open(target)
    stub = credentials.stub(llm_pb2_grpc.AsyncLLMStub, channel)

    def request(i: int, max_tokens: int) -> llm_pb2.GenerateRequest:
        r = llm_pb2.GenerateRequest(streaming=True)
        r.prompt.token_ids.ids[:] = [1, 5 + i % 50, 6 + i % 7, 7]
        r.sampling_params.max_tokens = max_tokens
        r.sampling_params.ignore_eos = True
        r.sampling_params.detokenize = False
        return r

    async def one(i: int, max_tokens: int) -> tuple[int, int, float, float, float]:
        """(tokens, messages, start, first message, last message) on the monotonic clock."""
        num_tokens = num_messages = 0
        start = first = time.monotonic()
        async for msg in stub.Generate(request(i, max_tokens)):
            for out in msg.outputs:
                num_tokens += len(out.token_ids)
            if not num_messages:
                first = time.monotonic()
            num_messages += 1
        return num_tokens, num_messages, start, first, time.monotonic()

    await asyncio.gather(*(one(i, 4) for i in streams[:4]))  # warm-up: the channel and the path
    ready.release()
    await asyncio.get_running_loop().run_in_executor(None, go.wait)
    results.put(await asyncio.gather(*(one(i, tokens) for i in streams)))
    await channel.close()


def run_load(
    credentials,
    target: str,
    cpus: set[int],
    streams: int,
    tokens: int,
    clients: int,
    process: psutil.Process,
) -> dict:
    """streams concurrent streams from `clients` processes; the figures of the whole load."""
    ctx = multiprocessing.get_context("spawn")
    ready, go, results = ctx.Semaphore(0), ctx.Event(), ctx.Queue()
    clients = min(clients, streams)
    procs = [
        ctx.Process(
            target=_client,
            args=(
                credentials,
                target,
                cpus,
                range(c, streams, clients),
                tokens,
                ready,
                go,
                results,
            ),
        )
        for c in range(clients)
    ]
    for p in procs:
        p.start()
    for _ in procs:
        if not ready.acquire(timeout=120):
            raise RuntimeError("a client process did not get ready within 120 s")
    cpu_before, started = _cpu_s(process), time.monotonic()
    go.set()
    per_stream = [s for _ in procs for s in results.get(timeout=600)]
    wall, cpu = time.monotonic() - started, _cpu_s(process) - cpu_before
    for p in procs:
        p.join(timeout=30)
    num_tokens = sum(s[0] for s in per_stream)
    num_messages = sum(s[1] for s in per_stream)
    tpot = [(s[4] - s[3]) / (s[0] - 1) * 1e3 for s in per_stream if s[0] > 1]
    return {
        "tokens": num_tokens,
        "messages": num_messages,
        "wall": wall,
        "cpu": cpu,
        "ttft": statistics.median(s[3] - s[2] for s in per_stream) * 1e3,
        "tpot": statistics.median(tpot),
        "tpot_p99": sorted(tpot)[int(0.99 * (len(tpot) - 1))],
    }


def main(args) -> None:
    import torch

    from tandem.engine.checkpoints import tiny_model_dir
    from tandem.engine.model_config import ModelConfig
    from tandem.testing.cluster import LocalCluster

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    all_cpus = sorted(os.sched_getaffinity(0))
    if len(all_cpus) < 2:
        raise SystemExit("needs 2 CPUs at least: one for the router, one for the rest")
    router_cpu, others = {all_cpus[-1]}, set(all_cpus[:-1])
    os.sched_setaffinity(0, others)  # this process and what it starts; the router is moved below
    max_streams = max(args.streams)
    positions = ModelConfig.from_pretrained(str(tiny_model_dir())).max_position_embeddings
    if not 1 <= args.tokens <= positions - 8:
        raise SystemExit(
            f"--tokens must be in [1, {positions - 8}] (the tiny model has {positions} positions)"
        )
    engine_args = [
        "--model",
        str(tiny_model_dir()),
        "--block-size",
        "16",
        "--max-num-seqs",
        str(max_streams),
        "--num-blocks",
        str(max_streams * (args.tokens // 16 + 2) + 64),
        "--max-model-len",
        str(min(args.tokens + 64, positions)),
    ]
    rows = []
    with LocalCluster(
        roles=["both"],
        engine_args=engine_args,
        metrics=False,
        worker_args={"both-1": ["--device", device]},
    ) as cluster:
        router = psutil.Process(cluster.router.process.pid)
        worker = psutil.Process(cluster.workers[0].process.pid)
        _pin(router.pid, router_cpu)
        _pin(worker.pid, others)
        targets = {
            "router": (cluster.address, router),
            "direct": (cluster.workers[0].address, worker),
        }
        for streams in args.streams:
            for name in args.via:  # direct first: the worker's own rate at this load
                target, process = targets[name]
                _pin(router.pid, router_cpu)  # threads the router started since
                client_cpus = router_cpu if args.clients_on_router_cpu else others
                rows.append(
                    (
                        streams,
                        name,
                        run_load(
                            cluster.credentials,
                            target,
                            client_cpus,
                            streams,
                            args.tokens,
                            args.clients,
                            process,
                        ),
                    )
                )

    print(
        f"# bench/router_capacity.py  {time.strftime('%Y-%m-%d')}  {platform.node()}  {os.cpu_count()} CPUs  "
        f"{platform.processor() or platform.machine()}  worker on {device}"
    )
    clients_on = (
        f"CPU {min(router_cpu)} with the router" if args.clients_on_router_cpu else "the other CPUs"
    )
    print(
        f"router pinned to CPU {min(router_cpu)}, the worker on the other {len(others)}, {args.clients} client "
        f"processes on {clients_on}; {args.tokens} tokens a stream (tiny model, ignore_eos)"
    )
    print(
        f"{'streams':>7} {'via':>7} {'tokens':>8} {'msgs':>8} {'tok/msg':>8} {'wall s':>7} {'tok/s':>8} "
        f"{'cpu s':>6} {'cores':>6} {'tok/cpu-s':>10} {'ttft ms':>8} {'tpot ms':>8} {'tpot p99':>8}"
    )
    for streams, name, r in rows:
        cpu_note = f"{r['cpu']:6.2f} {r['cpu'] / r['wall']:6.2f} {r['tokens'] / r['cpu']:10,.0f}"
        print(
            f"{streams:7d} {name:>7} {r['tokens']:8d} {r['messages']:8d} {r['tokens'] / r['messages']:8.2f} "
            f"{r['wall']:7.2f} {r['tokens'] / r['wall']:8,.0f} {cpu_note} {r['ttft']:8.1f} {r['tpot']:8.2f} "
            f"{r['tpot_p99']:8.2f}"
        )
    print(
        "(cpu s, cores, tok/cpu-s: of the process served, the router or the worker; cores = cpu s / wall s)"
    )
    routed = [r for _, name, r in rows if name == "router"]
    if not routed:
        return
    best = max(routed, key=lambda r: r["tokens"] / r["wall"])
    print(
        f"router core: {best['tokens'] / best['wall']:,.0f} streamed tokens/s delivered at "
        f"{best['cpu'] / best['wall']:.2f} of its core, {best['tokens'] / best['messages']:.2f} tokens a message "
        f"(goal: >= {GOAL_TOKENS_PER_CORE:,} streamed tokens/s per router core)"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--streams", type=lambda s: [int(x) for x in s.split(",")], default=[32, 128]
    )
    parser.add_argument("--tokens", type=int, default=1000)
    parser.add_argument("--clients", type=int, default=4, help="client processes")
    parser.add_argument(
        "--via",
        type=lambda s: s.split(","),
        default=["direct", "router"],
        help="direct,router: the same load straight to the worker, then through the router",
    )
    parser.add_argument(
        "--clients-on-router-cpu",
        action="store_true",
        help="the clients share the router's CPU (2 CPUs: the one way to load the router's core)",
    )
    parser.add_argument(
        "--device", default=None, help="the worker's device (default: cuda if any, else cpu)"
    )
    main(parser.parse_args())
