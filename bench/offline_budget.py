"""The offline row's workload (256 x 512/256, bench/serve.py) on the engine alone, per token
budget of a step (--max-num-batched-tokens, the chunked-prefill budget): how much decoding
rides on the compute-bound prefill steps against how long the last request waits for its
first token.

    python bench/offline_budget.py                          # CUDA: the 8B shape; budgets 2048..16384
    python bench/offline_budget.py --budgets 1024,2048      # any list (the largest sizes the buffers)
    python bench/offline_budget.py --shape tiny             # CPU smoke run (numbers mean nothing)

Each row also times one fresh 2048-token prompt's first token in-process (the TTFT row's work).

One engine is built with the largest budget; each run lowers the scheduler's budget, so all
runs share the loaded weights and captured graphs. Prints a row per budget as it finishes.
"""

from __future__ import annotations

import argparse
import os
import random
import time
from pathlib import Path

import torch
from serve import SEED, SHAPES, _offline_in_process, _sync, log, ttft_in_process, write_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--budgets", default="2048,4096,8192,16384")
    parser.add_argument("--num", type=int, default=256)
    args = parser.parse_args()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if on_cuda else "cpu")
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    base = Path("/dev/shm") if on_cuda else Path(os.environ.get("TANDEM_HOME", "/tmp"))
    model_dir = write_checkpoint(base / f"tandem-{shape_name}-bf16", SHAPES[shape_name], device)
    budgets = sorted(int(b) for b in args.budgets.split(","))
    log(
        f"# bench/offline_budget.py --budgets {args.budgets}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}; "
        f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu'}"
    )
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype="bfloat16",
            kv_cache_memory_gb=30 if on_cuda else 0.5,
            max_num_seqs=256,
            max_num_batched_tokens=budgets[-1],
            max_model_len=4096,
        )
    )
    runner = engine.runner

    rng = random.Random(SEED)
    warm = _offline_in_process(
        engine, runner, rng, SHAPES[shape_name]["vocab_size"], num=16, max_tokens=8
    )
    log(f"(warm-up: {warm['tok_s']:.0f} tok/s)")
    vocab = SHAPES[shape_name]["vocab_size"]
    rows = []
    for budget in budgets:
        engine.scheduler.max_num_batched_tokens = budget
        _sync(device)
        out = _offline_in_process(engine, runner, rng, vocab, num=args.num)
        rows.append((budget, out, ttft_in_process(engine, rng, vocab)))
    log(f"{'budget':>8}{'tok/s':>10}{'wall s':>9}{'late step ms':>14}{'TTFT 2048 ms':>14}")
    for budget, out, ttft in rows:
        log(
            f"{budget:8d}{out['tok_s']:10.0f}{out['wall_s']:9.2f}{out['decode_step_ms']:14.2f}{ttft:14.1f}"
        )


if __name__ == "__main__":
    main()
