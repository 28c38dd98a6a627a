"""A returning session's first token from the host KV tier, in-process (issue 36): where the
time goes, beside the same turn with its prefix still on the device, the turn computed whole,
and the copy floor (one pinned host -> device copy of the same bytes).

Sessions of --history tokens take turns until the first one's prefix has left the device pool
(it is in the tier); then its next turn (history + --new tokens) runs alone and is timed: the
tier's copies up (queued on their stream and waited for), the step, the first token. Then the
history with other new tokens (its prefix now on the device), and the first turn again under
another cache_salt (nothing cached: computed whole).

    python bench/kv_tier_turn.py                                   # the tiny model, CPU
    python bench/kv_tier_turn.py --device cuda --model DIR --history 6000 --pool-blocks 1024
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from multiturn import pinned_copy_seconds

from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _first_token(engine: LLMEngine, rid: str, prompt: list[int], salt=None) -> tuple[float, int]:
    """(seconds to the first token, prompt tokens found cached)."""
    started = time.perf_counter()
    engine.add_request(rid, prompt, SamplingOptions(max_tokens=1, ignore_eos=True), cache_salt=salt)
    cached = 0
    while engine.num_unfinished:
        for out in engine.step():
            cached = max(cached, out.num_cached_prompt_tokens)
    return time.perf_counter() - started, cached


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="checkpoint directory (default: tiny)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--history", type=int, default=1000, help="tokens of a session's history")
    parser.add_argument("--new", type=int, default=160, help="tokens a turn adds")
    parser.add_argument("--pool-blocks", type=int, default=160, help="device pool, 16-token blocks")
    parser.add_argument("--host-gb", type=float, default=4.0)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    model = args.model or str(tiny_model_dir())
    engine = LLMEngine(
        EngineConfig(
            model,
            device=args.device,
            block_size=16,
            num_blocks=args.pool_blocks,
            max_num_batched_tokens=4096,
            host_kv_cache_gb=args.host_gb,
        )
    )
    engine.warm_up()
    runner = engine.runner
    copy_seconds = []
    plain_copy = runner.copy_kv_tier

    def timed_copy(copies):  # the copies and the wait for them, alone
        _sync(args.device)
        started = time.perf_counter()
        plain_copy(copies)
        _sync(args.device)
        if copies.up:
            copy_seconds.append(time.perf_counter() - started)

    runner.copy_kv_tier = timed_copy
    vocab = engine.model_config.vocab_size
    rng = random.Random(0)
    per_pool = args.pool_blocks * 16 // (args.history + args.new) + 2  # sessions that evict one
    rows = {"from the tier": [], "on the device": [], "computed whole": []}
    up_ms = []
    for r in range(args.repeats):
        sessions = [
            [1] + [rng.randrange(4, vocab) for _ in range(args.history - 1)]
            for _ in range(per_pool)
        ]
        for i, s in enumerate(sessions):
            _first_token(engine, f"r{r}-s{i}", s)
        _sync(args.device)
        time.sleep(0.5)  # the copies down written through at their ends have landed
        turn = sessions[0] + [rng.randrange(4, vocab) for _ in range(args.new)]
        copy_seconds.clear()
        seconds, cached = _first_token(engine, f"r{r}-tier", turn)
        assert cached >= args.history - 16, f"the tier served {cached} tokens"
        rows["from the tier"].append(seconds)
        up_ms.append(sum(copy_seconds) * 1e3)
        # The same history with other new tokens: the history's blocks are on the device now.
        again = sessions[0] + [rng.randrange(4, vocab) for _ in range(args.new)]
        rows["on the device"].append(_first_token(engine, f"r{r}-dev", again)[0])
        rows["computed whole"].append(_first_token(engine, f"r{r}-cmp", turn, salt=f"x{r}")[0])
    block_bytes = runner.block_nbytes
    tokens = args.history + args.new
    floor = ""
    if args.device.startswith("cuda"):
        seconds = pinned_copy_seconds(block_bytes * (args.history // 16), args.device, iters=1)
        floor = f"; one pinned copy of the same bytes {1e3 * seconds:.2f} ms"
    print(
        f"{model}, {args.device}: a {args.history}-token history + {args.new} new tokens, "
        f"device pool {args.pool_blocks} blocks, medians of {args.repeats}"
    )
    print("| the turn's prefix | time to the first token ms |")
    print("| --- | --- |")
    for name, values in rows.items():
        print(f"| {name} | {statistics.median(values) * 1e3:.2f} |")
    print(
        f"the tier's copies up of {args.history // 16} blocks ({args.history // 16 * block_bytes / 2**20:.0f} MiB) "
        f"and the wait for them: {statistics.median(up_ms):.2f} ms{floor}; {tokens} tokens in all"
    )


if __name__ == "__main__":
    main()
