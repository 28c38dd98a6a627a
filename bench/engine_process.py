"""The engine's step period served through the router against the same batch in-process
(issue 28), in one run: the engine thread inside the worker's gRPC process (the default) and
the engine core in a process of its own (--engine-process).

    python bench/engine_process.py                     # the tiny model, CPU, 64 and 256 streams
    python bench/engine_process.py --device cuda --model DIR --streams 256

Served: a router and one aggregated worker; the client streams --streams requests at once
(ignore_eos, long enough to outlast the window) and, once all decode, the worker's step count
over --window seconds gives the served step period (GetWorkerState's num_steps: every step the
engine ran, whatever its cost); beside it in brackets, the worker's iterLatencyMS (from a step's
launch to its outputs: with overlap scheduling two steps overlap, so it runs up to twice the
period). In-process, after each served run: an LLMEngine alone runs the same batch over the same
contexts (the same prompts, stepped untimed to the tokens per stream the served window started
at, then timed over as many steps as the window ran): a step's attention reads every context
token's KV, so a baseline over shorter contexts would be a faster step, not the same one. The
ratio served / in-process is what the serving path adds to a step: the engine thread waiting on
the gRPC side's interpreter. Run it on an otherwise idle machine: the runs take turns.
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import json
import random
import statistics
import time
from pathlib import Path

import torch

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.testing.cluster import LocalCluster, channel_to
from tandem.v1 import worker_pb2, worker_pb2_grpc

PROMPT_LEN = 32


def _prompts(num: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, vocab) for _ in range(PROMPT_LEN - 1)] for _ in range(num)]


def _engine_args(args, streams: int) -> list[str]:
    return [
        "--model",
        args.model,
        "--device",
        args.device,
        "--max-num-seqs",
        str(streams),
        "--num-blocks",
        str(args.num_blocks),
        "--max-num-batched-tokens",
        "8192",
    ]


def in_process_step_ms(args, streams: int, start_tokens: int, steps: int) -> float:
    """The mean step of `streams` sequences decoding from `start_tokens` generated tokens each,
    over `steps` steps (the served window's range)."""
    engine = LLMEngine(
        EngineConfig(
            args.model,
            device=args.device,
            max_num_seqs=streams,
            num_blocks=args.num_blocks,
            max_num_batched_tokens=8192,
        )
    )
    engine.warm_up()
    options = SamplingOptions(max_tokens=100_000, ignore_eos=True)
    for i, prompt in enumerate(_prompts(streams, engine.model_config.vocab_size, 1)):
        engine.add_request(f"r{i}", prompt, options)
    generated = 0
    while generated < start_tokens * streams:  # the prompts, then decoding to the window's start
        generated += sum(len(out.new_token_ids) for out in engine.step())
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    seconds = time.perf_counter() - started
    engine.close()
    del engine  # the served cluster that comes next needs the device's memory back
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return seconds / max(1, steps) * 1e3


def _state(address: str) -> worker_pb2.WorkerState:
    with channel_to(address) as channel:
        return worker_pb2_grpc.WorkerStub(channel).GetWorkerState(
            worker_pb2.WorkerStateRequest(), timeout=10
        )


def served_step_ms(
    args, streams: int, engine_process: bool
) -> tuple[float, float, float, int, int]:
    """(step period ms, generated tokens/s, the steps' own mean time ms: iterLatencyMS, tokens
    per stream at the window's start, steps in the window) while `streams` requests stream
    through the router."""
    worker_args = {"both-1": ["--engine-process"]} if engine_process else {}
    with LocalCluster(
        roles=["both"], engine_args=_engine_args(args, streams), worker_args=worker_args
    ) as cluster:
        worker = cluster.workers[0].address
        vocab = json.loads((Path(args.model) / "config.json").read_text())["vocab_size"]

        async def run() -> tuple[float, float, float, int, int]:
            llm = await AsyncLLM(cluster.address)
            params = SamplingParams(max_tokens=100_000, ignore_eos=True, detokenize=False)

            async def consume(prompt):
                async for _ in llm.generate_async(prompt, params, streaming=True):
                    pass

            tasks = [asyncio.create_task(consume(p)) for p in _prompts(streams, vocab, 1)]
            try:
                while (await asyncio.to_thread(_state, worker)).num_generated_tokens < 5 * streams:
                    await asyncio.sleep(0.05)
                await asyncio.to_thread(stats.get_stats, 0.1)  # what came before the window
                first = await asyncio.to_thread(_state, worker)
                started = time.perf_counter()
                await asyncio.sleep(args.window)
                last = await asyncio.to_thread(_state, worker)
                seconds = time.perf_counter() - started
                records = await asyncio.to_thread(stats.get_stats, 0.1)
            finally:
                for task in tasks:
                    task.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                llm.close()
            steps = last.num_steps - first.num_steps
            tokens = last.num_generated_tokens - first.num_generated_tokens
            compute = statistics.mean(r["iterLatencyMS"] for r in records) if records else 0.0
            start = first.num_generated_tokens // streams
            return seconds / max(1, steps) * 1e3, tokens / seconds, compute, start, steps

        with LLM(worker, **cluster.worker_client_kwargs()) as stats:
            return asyncio.run(run())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", default="64,256")
    parser.add_argument("--window", type=float, default=6.0, help="served seconds measured")
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument("--repeats", type=int, default=2)
    args = parser.parse_args()
    args.model = args.model or str(tiny_model_dir())
    print(
        f"model {args.model}, device {args.device}, {PROMPT_LEN}-token prompts, median of "
        f"{args.repeats}; served: router + one aggregated worker, streaming clients"
    )
    print(
        "| streams | tokens per stream over the windows | engine thread: in-process step ms "
        "| served step ms (its own ms) | ratio | tok/s | engine process: in-process step ms "
        "| served step ms (its own ms) | ratio | tok/s |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for streams in (int(s) for s in args.streams.split(",")):
        rows, ranges = {}, []
        for mode in (False, True):
            runs = []
            for _ in range(args.repeats):
                period, rate, own, start, steps = served_step_ms(args, streams, mode)
                alone = in_process_step_ms(args, streams, start, steps)
                runs.append((period, rate, own, alone))
                ranges.append(f"{start}-{start + steps}")
            # Medians of each column, and of each run's own ratio (its served against its twin).
            rows[mode] = [statistics.median(r[i] for r in runs) for i in range(4)]
            rows[mode].append(statistics.median(r[0] / r[3] for r in runs))
        cells = [
            f"{alone:.2f} | {period:.2f} ({own:.2f}) | {ratio:.2f}x | {rate:,.0f}"
            for period, rate, own, alone, ratio in (rows[False], rows[True])
        ]
        print(f"| {streams} | {', '.join(ranges)} | {cells[0]} | {cells[1]} |")


if __name__ == "__main__":
    main()
