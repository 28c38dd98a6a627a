"""What Prometheus metrics cost a worker's engine (issue 10): the engine thread's step time with
the metrics attached and without, and the work the metrics do per step and per scrape.

The design puts nothing on the engine thread but two integer increments per admitted sequence
(the prefix cache's queries and hits): the per-step record the engine thread hands to the loop
anyway (its iteration stats) is observed into histograms on the loop, and gauges are read at
scrape time through one ReadCounters command answered between two steps. The floor is zero.

    python bench/metrics_overhead.py                 # CPU, the tiny model
    python bench/metrics_overhead.py --batch 32 --rounds 7
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
import types
from dataclasses import dataclass

from prometheus_client import generate_latest

from tandem.common.roles import Role
from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import AddRequest
from tandem.engine.sampling_options import SamplingOptions
from tandem.worker.metrics import WorkerMetrics

SEED = 0


@dataclass
class Run:
    """Per engine step: wall time, and the CPU time of the engine thread and of the loop's thread
    (CPU time leaves out the other processes of a shared machine; wall time does not)."""

    wall_ms: float
    engine_cpu_ms: float
    loop_cpu_ms: float


async def decode_batch(
    engine: LLMEngine, metrics: WorkerMetrics | None, prompts: list[list[int]], max_tokens: int
) -> Run:
    """Runs prompts to max_tokens on an engine thread, observing each step into metrics (if any)."""
    loop = asyncio.get_running_loop()
    core = EngineCore(engine, loop, on_stats=metrics.observe_step if metrics is not None else None)
    steps_before = engine.counters.num_steps
    streams = [asyncio.Queue() for _ in prompts]
    core.start()
    engine_clock = time.pthread_getcpuclockid(core._thread.ident)
    engine_cpu, loop_cpu, started = (
        time.clock_gettime(engine_clock),
        time.thread_time(),
        time.perf_counter(),
    )
    for i, (prompt, stream) in enumerate(zip(prompts, streams)):
        core.add_request(
            AddRequest(
                f"r{time.monotonic_ns()}-{i}",
                prompt,
                SamplingOptions(max_tokens=max_tokens, ignore_eos=True),
            ),
            stream,
        )
    for stream in streams:
        while not (await stream.get()).finished:
            pass
    wall, loop_cpu = time.perf_counter() - started, time.thread_time() - loop_cpu
    engine_cpu = time.clock_gettime(engine_clock) - engine_cpu
    core.stop()
    steps = engine.counters.num_steps - steps_before
    return Run(wall / steps * 1e3, engine_cpu / steps * 1e3, loop_cpu / steps * 1e3)


def per_call_us(fn, n: int) -> float:
    started = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - started) / n * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, default=8, help="sequences decoding together")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument(
        "--rounds", type=int, default=9, help="A/B rounds, interleaved (the machine is shared)"
    )
    args = parser.parse_args()
    rng = random.Random(SEED)
    engine = LLMEngine(
        EngineConfig(model_dir=str(tiny_model_dir()), num_blocks=1024, block_size=16)
    )
    metrics = WorkerMetrics(Role.DECODE, engine.config.model_dir)
    metrics.bind("127.0.0.1:0")

    def prompts():  # fresh ones each run: a prompt seen before would come from the prefix cache
        return [
            [1] + [rng.randrange(4, 300) for _ in range(args.prompt_len - 1)]
            for _ in range(args.batch)
        ]

    async def ab():
        await decode_batch(engine, None, prompts(), args.max_tokens)  # warm-up
        results: dict[str, list[Run]] = {"off": [], "on": []}
        for round_index in range(args.rounds):
            for mode in ("off", "on") if round_index % 2 == 0 else ("on", "off"):
                results[mode].append(
                    await decode_batch(
                        engine, metrics if mode == "on" else None, prompts(), args.max_tokens
                    )
                )
        return results

    results = asyncio.run(ab())

    # The loop's work per step, and a scrape (the engine answers ReadCounters between two steps).
    batch = {"numScheduledRequests": args.batch, "numCtxTokens": 0, "numGenRequests": args.batch}
    stats = {"iter": 0, "iterLatencyMS": 5.0, "inflightBatchingStats": batch}

    def observe():
        stats["iter"] += 1
        metrics.observe_step(stats)

    observe_us = per_call_us(observe, 20000)

    async def scrape_ms():
        core = EngineCore(engine, asyncio.get_running_loop())
        core.start()
        runtime = types.SimpleNamespace(
            core=core, leases=None, config=types.SimpleNamespace(engine=engine.config)
        )
        metrics.watch(runtime)
        try:
            started = time.perf_counter()
            for _ in range(50):
                await asyncio.to_thread(generate_latest, metrics.registry)
            return (time.perf_counter() - started) / 50 * 1e3
        finally:
            core.stop()

    scrape = asyncio.run(scrape_ms())

    print(
        f"tiny model, CPU, batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} tokens each, "
        f"{args.rounds} interleaved rounds; floor: 0 (nothing added to the engine thread's step)"
    )
    print("| measurement | metrics off | metrics on | difference |")
    print("| --- | --- | --- | --- |")
    for label, field in (
        ("engine thread CPU per step", "engine_cpu_ms"),
        ("loop thread CPU per step", "loop_cpu_ms"),
        ("wall per step", "wall_ms"),
    ):
        off = statistics.median(getattr(r, field) for r in results["off"])
        on = statistics.median(getattr(r, field) for r in results["on"])
        change = f"{on - off:+.3f} ms ({(on / off - 1) * 100:+.1f}%)"
        print(f"| {label} (median of rounds), ms | {off:.3f} | {on:.3f} | {change} |")
    wall_off = statistics.median(r.wall_ms for r in results["off"])
    print(
        f"| loop work per step (3 histogram observations), us | - | {observe_us:.1f} | "
        f"{observe_us / 1e3 / wall_off * 100:.2f}% of a step |"
    )
    print(
        f"| one scrape (all families, ReadCounters round trip), ms | - | {scrape:.2f} | every 15 s: "
        f"{scrape / 15e3 * 100:.3f}% of the time |"
    )


if __name__ == "__main__":
    main()
