"""TTFT of one fresh prompt in-process with its attention on cuDNN (the default for such steps on
CUDA) against the paged Triton kernel (TANDEM_PREFILL_ATTENTION=paged), and what a prompt length
not seen before costs cuDNN (it builds an execution plan per shape).

    python3 bench/prefill_attention.py [--model-dir DIR]   # CUDA; writes bench/serve.py's 8B checkpoint if missing

The dispatcher reads TANDEM_PREFILL_ATTENTION at each call, so one engine serves both settings,
alternated. Prompts start with a distinct token each time: nothing comes from the prefix cache.
"""
from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch

from serve import SHAPES, _sync, write_checkpoint

MODES = ("paged", "cudnn")


def ttft_ms(engine, prompt: list[int], first_token: int) -> float:
    from tandem.engine.sampling_options import SamplingOptions
    engine.add_request(f"t{first_token}-{len(prompt)}-{time.perf_counter_ns()}", [first_token] + prompt[1:],
                       SamplingOptions(max_tokens=1))
    _sync(engine.runner.device)
    start = time.perf_counter()
    while engine.num_unfinished:
        engine.step()
    return (time.perf_counter() - start) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default="/dev/shm/tandem-llama-3.1-8b-bf16")
    parser.add_argument("--length", type=int, default=2048)
    parser.add_argument("--new-lengths", default="777,1000,1536,3000,3500")
    args = parser.parse_args()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    device = torch.device("cuda")
    shape = SHAPES["llama-3.1-8b"]
    write_checkpoint(Path(args.model_dir), shape, device)
    engine = LLMEngine(EngineConfig(args.model_dir, device="cuda", dtype="bfloat16", kv_cache_memory_gb=20,
                                    max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=4096))
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompt = [rng.randrange(3, vocab) for _ in range(4096)]
    token = iter(range(3, vocab))
    print(f"# bench/prefill_attention.py; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}, cuDNN {torch.backends.cudnn.version()}")
    for mode in MODES:  # warm both at the main length
        os.environ["TANDEM_PREFILL_ATTENTION"] = mode
        ttft_ms(engine, prompt[:args.length], next(token))
    print(f"TTFT of one fresh {args.length}-token prompt, best of 3, settings alternated twice:")
    for round_ in range(2):
        for mode in MODES:
            os.environ["TANDEM_PREFILL_ATTENTION"] = mode
            best = min(ttft_ms(engine, prompt[:args.length], next(token)) for _ in range(3))
            print(f"  {mode:<6} round {round_ + 1}: {best:.2f} ms")
    print("a prompt length seen for the first time, then again (cuDNN builds a plan per shape):")
    print(f"  {'length':>6} {'paged first':>12} {'paged again':>12} {'cudnn first':>12} {'cudnn again':>12}")
    for length in (int(x) for x in args.new_lengths.split(",")):
        row = []
        for mode in MODES:
            os.environ["TANDEM_PREFILL_ATTENTION"] = mode
            row += [ttft_ms(engine, prompt[:length], next(token)) for _ in range(2)]
        print(f"  {length:>6} " + " ".join(f"{ms:>12.2f}" for ms in row))


if __name__ == "__main__":
    main()
