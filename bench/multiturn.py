"""Multi-turn sessions with and without the host KV tier (issue 36): each turn is the session's
previous prompt + its answer + a new question, the sessions take turns round-robin, and the
device pool holds only a few sessions' histories, so a returning session's prefix has been
evicted by the others. Per configuration: time to first token and the prompt tokens computed per
turn (against the new tokens the turn added), through the router (one aggregated worker), with
the same greedy tokens checked equal across configurations.

    python bench/multiturn.py                        # CPU, SmolLM2-135M (the default model)
    python bench/multiturn.py --device cuda --model DIR --sessions 32 --pool-blocks 2048

Not built (so not measured): pulls of a prefix from another worker's tiers.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from tandem.client import AsyncLLM, SamplingParams
from tandem.engine.checkpoints import default_model_dir
from tandem.testing.cluster import LocalCluster


async def _turn(llm: AsyncLLM, prompt: list[int], max_tokens: int):
    """(answer tokens, seconds to the first token, prompt tokens computed)."""
    started = time.perf_counter()
    ttft, out = None, None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    async for out in llm.generate_async(prompt, params, streaming=True):
        if ttft is None and out.outputs[0].token_ids:
            ttft = time.perf_counter() - started
    return list(out.outputs[0].token_ids), ttft, out.metrics.num_computed_prompt_tokens


async def _sessions(address: str, args) -> list[dict]:
    rng = random.Random(args.seed)
    histories = [
        [1] + [rng.randrange(100, 40000) for _ in range(args.first_prompt)]
        for _ in range(args.sessions)
    ]
    turns = []
    async with AsyncLLM(address) as llm:
        for turn in range(args.turns):
            for i, history in enumerate(histories):
                answer, ttft, computed = await _turn(llm, history, args.answer)
                new = args.first_prompt + 1 if turn == 0 else args.question + args.answer
                turns.append(dict(turn=turn, session=i, ttft=ttft, computed=computed, new=new))
                turns[-1]["answer"] = answer
                history += answer + [rng.randrange(100, 40000) for _ in range(args.question)]
    return turns


def _run(args, host_gb: float) -> list[dict]:
    engine = [
        "--model",
        args.model or str(default_model_dir()),
        "--device",
        args.device,
        "--block-size",
        "16",
        "--num-blocks",
        str(args.pool_blocks),
        "--max-num-batched-tokens",
        "4096",
    ]
    if host_gb:
        engine += ["--host-kv-cache-gb", str(host_gb)]
    with LocalCluster(roles=["both"], engine_args=engine) as cluster:
        return asyncio.run(_sessions(cluster.address, args))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF checkpoint (default: SmolLM2-135M)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--sessions", type=int, default=6)
    parser.add_argument("--turns", type=int, default=4)
    parser.add_argument("--first-prompt", type=int, default=400)
    parser.add_argument("--question", type=int, default=48)
    parser.add_argument("--answer", type=int, default=16)
    parser.add_argument(
        "--pool-blocks", type=int, default=96, help="the device pool (16 tokens a block)"
    )
    parser.add_argument("--host-gb", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    results = {"no tier": _run(args, 0), f"host tier {args.host_gb} GiB": _run(args, args.host_gb)}
    answers = [[t["answer"] for t in turns] for turns in results.values()]
    same = all(a == answers[0] for a in answers)
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.first_prompt}-token first prompts, "
        f"+{args.question} question / {args.answer} answer tokens a turn, device pool "
        f"{args.pool_blocks} blocks ({args.pool_blocks * 16} tokens), {args.device}; "
        f"greedy answers identical across configurations: {same}"
    )
    print("| configuration | turn | TTFT median ms | prompt tokens computed / new tokens |")
    print("| --- | --- | --- | --- |")
    for name, turns in results.items():
        for turn in range(args.turns):
            rows = [t for t in turns if t["turn"] == turn]
            ttft = statistics.median(t["ttft"] for t in rows) * 1e3
            ratio = sum(t["computed"] for t in rows) / sum(t["new"] for t in rows)
            print(f"| {name} | {turn + 1} | {ttft:.1f} | {ratio:.2f} |")
    later = {
        name: statistics.median(t["ttft"] for t in turns if t["turn"] > 0)
        for name, turns in results.items()
    }
    names = list(later)
    print(
        f"turns 2+: TTFT {later[names[0]] * 1e3:.1f} ms without the tier, "
        f"{later[names[1]] * 1e3:.1f} ms with it ({later[names[0]] / later[names[1]]:.2f}x lower)"
    )
    if not same:
        raise SystemExit("the answers differ between configurations")


if __name__ == "__main__":
    main()
