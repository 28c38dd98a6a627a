"""What --deterministic costs (issue 33), per workload, on the engine itself: tokens/s of the
default mode and of the deterministic one, and their ratio.

    python bench/deterministic.py                         # the tiny test model, CPU
    python bench/deterministic.py --model smollm2         # SmolLM2-135M (the default model)
    python bench/deterministic.py --device cuda --model DIR

Workloads (random prompt ids, fixed seed, greedy, ignore_eos):
  bs1      one request, 32-token prompt, 64 new tokens           (decode tok/s)
  c16      16 concurrent, prompts 16-128 tokens, 32 new tokens   (generated tok/s)
  c64      64 concurrent, same shape                             (generated tok/s)
  prefill  4 prompts of 512 tokens, 1 new token, budget 2048     (prompt tok/s)
Each row runs once per mode to warm up, then --repeats times with the two modes in turn (the
machine's other load falls on both); the table has each mode's best run. The last column counts
the requests whose greedy tokens the two modes agree on (they may differ only where two logits
are within rounding of each other). Last, per mode, the first --alone requests of c64 run again
one at a time: how many give bitwise the tokens they got inside the 64-request batch (the
deterministic mode's promise; the default mode may differ).
"""

from __future__ import annotations

import argparse
import random
import time

from tandem.engine.checkpoints import resolve_model, tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.kernels import batch_invariant

WORKLOADS = {
    # name: (requests, prompt length range, new tokens, what the rate counts)
    "bs1": (1, (32, 32), 64, "generated"),
    "c16": (16, (16, 128), 32, "generated"),
    "c64": (64, (16, 128), 32, "generated"),
    "prefill": (4, (512, 512), 1, "prompt"),
}


def _requests(name: str, vocab_size: int) -> list[list[int]]:
    num, (low, high), _, _ = WORKLOADS[name]
    rng = random.Random(33)
    return [
        [rng.randrange(4, vocab_size) for _ in range(rng.randint(low, high))] for _ in range(num)
    ]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> tuple[float, dict]:
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    tokens = {f"r{i}": [] for i in range(len(prompts))}
    started = time.perf_counter()
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, options)
    while engine.num_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.new_token_ids
    return time.perf_counter() - started, tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="tiny", help="tiny, smollm2, or a checkpoint directory")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--workloads", default=",".join(WORKLOADS))
    parser.add_argument(
        "--alone", type=int, default=8, help="c64 requests also run alone (batch invariance)"
    )
    parser.add_argument(
        "--gpu-row-tile",
        type=int,
        default=None,
        help="rows per GEMM call of the deterministic mode on a GPU (an experiment: the engine "
        f"uses batch_invariant.GPU_ROW_TILE = {batch_invariant.GPU_ROW_TILE})",
    )
    args = parser.parse_args()
    if args.gpu_row_tile is not None:
        if args.gpu_row_tile < 1:
            parser.error("--gpu-row-tile must be >= 1")
        batch_invariant.GPU_ROW_TILE = args.gpu_row_tile
    names = args.workloads.split(",")
    unknown = [n for n in names if n not in WORKLOADS]
    if unknown:
        parser.error(f"unknown workloads {unknown}; choose from {list(WORKLOADS)}")
    if args.repeats < 1:
        parser.error("--repeats must be >= 1")
    if not 0 <= args.alone <= WORKLOADS["c64"][0]:
        parser.error(f"--alone must be in [0, {WORKLOADS['c64'][0]}]")
    model_dir = str(
        tiny_model_dir()
        if args.model == "tiny"
        else resolve_model(None if args.model == "smollm2" else args.model)
    )
    engines = {
        deterministic: LLMEngine(
            EngineConfig(
                model_dir,
                device=args.device,
                num_blocks=2048,
                max_num_seqs=64,
                max_num_batched_tokens=2048,
                deterministic=deterministic,
                enable_prefix_caching=False,
            )
        )
        for deterministic in (False, True)
    }
    vocab_size = engines[False].model_config.vocab_size
    print(
        f"model {model_dir}, device {args.device}, best of {args.repeats} after a warm-up, "
        f"deterministic GEMM row tile {batch_invariant.gemm_row_tile(engines[True].runner.device)}"
    )
    print("| workload | default tok/s | deterministic tok/s | ratio | tokens equal |")
    print("| --- | --- | --- | --- | --- |")
    for name in names:
        prompts = _requests(name, vocab_size)
        _, _, max_tokens, counts = WORKLOADS[name]
        num_tokens = (
            sum(len(p) for p in prompts) if counts == "prompt" else len(prompts) * max_tokens
        )
        times, outputs = {False: [], True: []}, {}
        for engine in engines.values():
            _run(engine, prompts, max_tokens)  # warm-up
        for _ in range(args.repeats):
            for deterministic, engine in engines.items():
                seconds, outputs[deterministic] = _run(engine, prompts, max_tokens)
                times[deterministic].append(seconds)
        rates = {mode: num_tokens / min(seconds) for mode, seconds in times.items()}
        same = sum(outputs[True][r] == outputs[False][r] for r in outputs[True])
        print(
            f"| {name} | {rates[False]:,.1f} | {rates[True]:,.1f} | "
            f"{rates[True] / rates[False]:.2f}x | {same}/{len(prompts)} |"
        )
    _batch_invariance(engines, vocab_size, args.alone)


def _batch_invariance(engines: dict, vocab_size: int, alone: int) -> None:
    """Per mode: how many of the c64 workload's first `alone` requests give bitwise the same
    tokens run alone (batch 1) as inside the 64-request batch."""
    prompts = _requests("c64", vocab_size)
    max_tokens = WORKLOADS["c64"][2]
    for deterministic, engine in engines.items():
        _, batched = _run(engine, prompts, max_tokens)
        equal = sum(
            _run(engine, [prompts[i]], max_tokens)[1]["r0"] == batched[f"r{i}"]
            for i in range(alone)
        )
        mode = "deterministic" if deterministic else "default"
        print(f"{mode}: {equal}/{alone} requests give the same tokens alone as in the c64 batch")


if __name__ == "__main__":
    main()
