"""Multi-turn sessions with and without the host KV tier and cross-worker prefix pulls (issue
36): each turn is the session's previous prompt + its answer + a new question, the sessions take
turns round-robin, and the device pool holds only a few sessions' histories, so a returning
session's prefix has been evicted by the others. Per configuration: time to first token and the
prompt tokens computed per turn (against the new tokens the turn added), through the router, with
the same greedy tokens checked equal across configurations.

Configurations: one aggregated worker without and with the host tier; then two aggregated
workers with the tier where each turn of a session runs on the other worker than its previous
turn (attention_dp_rank alternates, as a router moving sessions by load would), without and with
cross-worker prefix pulls (--kv-prefix-pulls on the workers, --prefix-pulls on the router, its
cost model set to this machine's rates by --pull-gbps / --compute-tokens-per-s).

    python bench/multiturn.py                        # CPU, SmolLM2-135M (the default model)
    python bench/multiturn.py --device cuda --model DIR --sessions 32 --pool-blocks 2048
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from tandem.client import AsyncLLM, SamplingParams, SchedulingParams
from tandem.engine.checkpoints import default_model_dir
from tandem.testing.cluster import LocalCluster


async def _turn(llm: AsyncLLM, prompt: list[int], max_tokens: int, rank: int | None):
    """(answer tokens, seconds to the first token, prompt tokens computed, blocks pulled from a
    peer). rank: the worker (attention_dp_rank) the turn must run on; None: the router's pick."""
    started = time.perf_counter()
    ttft, out = None, None
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    scheduling = SchedulingParams(attention_dp_rank=rank) if rank is not None else None
    async for out in llm.generate_async(
        prompt, params, streaming=True, scheduling_params=scheduling
    ):
        if ttft is None and out.outputs[0].token_ids:
            ttft = time.perf_counter() - started
    pull = out.metrics.prefix_pull
    pulled = pull.num_pulled_blocks if pull is not None else 0
    return list(out.outputs[0].token_ids), ttft, out.metrics.num_computed_prompt_tokens, pulled


async def _sessions(address: str, args, bounce: bool) -> list[dict]:
    rng = random.Random(args.seed)
    histories = [
        [1] + [rng.randrange(100, 40000) for _ in range(args.first_prompt)]
        for _ in range(args.sessions)
    ]
    turns = []
    async with AsyncLLM(address) as llm:
        for turn in range(args.turns):
            for i, history in enumerate(histories):
                rank = (i + turn) % 2 if bounce else None
                answer, ttft, computed, pulled = await _turn(llm, history, args.answer, rank)
                new = args.first_prompt + 1 if turn == 0 else args.question + args.answer
                turns.append(
                    dict(turn=turn, session=i, ttft=ttft, computed=computed, new=new, pulled=pulled)
                )
                turns[-1]["answer"] = answer
                history += answer + [rng.randrange(100, 40000) for _ in range(args.question)]
    return turns


def _run(args, host_gb: float, num_workers: int = 1, pulls: bool = False) -> list[dict]:
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
    names = [f"both-{i + 1}" for i in range(num_workers)]
    router = [
        "--prefix-pulls",
        "--prefix-pull-gbps",
        str(args.pull_gbps),
        "--prefix-compute-tokens-per-s",
        str(args.compute_tokens_per_s),
    ]
    with LocalCluster(
        roles=["both"] * num_workers,
        engine_args=engine,
        worker_args={name: ["--kv-prefix-pulls"] for name in names} if pulls else {},
        router_args=router if pulls else [],
    ) as cluster:
        return asyncio.run(_sessions(cluster.address, args, bounce=num_workers > 1))


def pinned_copy_seconds(nbytes: int, device: str, iters: int = 5) -> float:
    """One pinned host -> device copy of nbytes (warmed up, mean of iters): the host tier's
    floor for copying that much KV up."""
    import torch

    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty_like(host, device=device)
    dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(iters):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / iters


def _copy_floor(args) -> str:
    """On CUDA: pinned host -> device bandwidth, and the copy up of a turn-2 history at it (the
    tier's floor for a returning session's prefix; bf16 KV)."""
    import json
    from pathlib import Path

    if not args.device.startswith("cuda"):
        return ""
    gbps = (512 << 20) / pinned_copy_seconds(512 << 20, args.device) / 1e9
    config = json.loads((Path(args.model or default_model_dir()) / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    per_token = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * head_dim * 2
    tokens = args.first_prompt + 1 + args.answer
    history = tokens * per_token
    return (
        f"copy floor: pinned host -> device {gbps:.1f} GB/s; a turn-2 history ({tokens} tokens, "
        f"{history / 2**20:.0f} MiB of bf16 KV) copies up in {history / gbps / 1e6:.1f} ms"
    )


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
    parser.add_argument(
        "--pull-gbps", type=float, default=1.0, help="the router's cost model: pull GB/s"
    )
    parser.add_argument(
        "--compute-tokens-per-s",
        type=float,
        default=2000.0,
        help="the router's cost model: prompt tokens a worker computes per second",
    )
    parser.add_argument(
        "--one-worker-only",
        action="store_true",
        help="only the one-worker rows (no tier, host tier): not the two bouncing workers",
    )
    args = parser.parse_args()

    floor = _copy_floor(args)
    tier = f"host tier {args.host_gb} GiB"
    results = {"no tier": _run(args, 0), tier: _run(args, args.host_gb)}
    if not args.one_worker_only:
        results[f"2 workers, bouncing, {tier}"] = _run(args, args.host_gb, 2)
        results[f"2 workers, bouncing, {tier} + prefix pulls"] = _run(
            args, args.host_gb, 2, pulls=True
        )
    answers = [[t["answer"] for t in turns] for turns in results.values()]
    same = all(a == answers[0] for a in answers)
    print(
        f"{args.sessions} sessions x {args.turns} turns, {args.first_prompt}-token first prompts, "
        f"+{args.question} question / {args.answer} answer tokens a turn, device pool "
        f"{args.pool_blocks} blocks ({args.pool_blocks * 16} tokens), {args.device}; "
        f"greedy answers identical across configurations: {same}"
    )
    print(
        "| configuration | turn | TTFT median ms | prompt tokens computed / new tokens "
        "| computed tokens per turn (mean) | blocks pulled from a peer |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    for name, turns in results.items():
        for turn in range(args.turns):
            rows = [t for t in turns if t["turn"] == turn]
            ttft = statistics.median(t["ttft"] for t in rows) * 1e3
            ratio = sum(t["computed"] for t in rows) / sum(t["new"] for t in rows)
            computed = statistics.mean(t["computed"] for t in rows)
            pulled = sum(t["pulled"] for t in rows)
            print(f"| {name} | {turn + 1} | {ttft:.1f} | {ratio:.2f} | {computed:.0f} | {pulled} |")
    later = {
        name: statistics.median(t["ttft"] for t in turns if t["turn"] > 0)
        for name, turns in results.items()
    }
    names = list(later)
    print(
        f"turns 2+: TTFT {later[names[0]] * 1e3:.1f} ms without the tier, "
        f"{later[names[1]] * 1e3:.1f} ms with it ({later[names[0]] / later[names[1]]:.2f}x lower)"
    )
    if len(names) > 2:
        print(
            f"sessions bouncing between 2 workers: {later[names[2]] * 1e3:.1f} ms without prefix "
            f"pulls, {later[names[3]] * 1e3:.1f} ms with them "
            f"({later[names[2]] / later[names[3]]:.2f}x lower)"
        )
    if floor:
        print(floor)
    if not same:
        raise SystemExit("the answers differ between configurations")


if __name__ == "__main__":
    main()
