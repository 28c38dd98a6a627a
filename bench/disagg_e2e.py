"""End-to-end disaggregated serving: router -> prefill (device A) -> NIXL -> decode (device B),
against an aggregated worker on device A. Checks greedy tokens are equal and prints per-request
TTFT, KV pull time and bytes, and end-to-end latency.

    python bench/disagg_e2e.py                                  # CPU
    python bench/disagg_e2e.py --prefill-device cuda:0 --decode-device cuda:1 --progress-thread
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from tandem.client import AsyncLLM, SamplingParams
from tandem.engine.checkpoints import tiny_model_dir
from tandem.testing.cluster import LocalCluster

SEED = 0


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--model", default=None, help="HF checkpoint (default: the tiny random model)"
    )
    parser.add_argument("--prefill-device", default="cpu")
    parser.add_argument("--decode-device", default="cpu")
    parser.add_argument(
        "--progress-thread", action="store_true", help="NIXL UCX progress threads in the workers"
    )
    parser.add_argument("--num-requests", type=int, default=16)
    parser.add_argument("--prompt-len", type=int, default=512)
    parser.add_argument("--max-tokens", type=int, default=32)
    args = parser.parse_args()

    engine = [
        "--num-blocks",
        "2048",
        "--block-size",
        "16",
        "--max-num-batched-tokens",
        "8192",
        "--model",
        args.model or str(tiny_model_dir()),
    ]
    extra = ["--nixl-progress-thread"] if args.progress_thread else []
    cluster = LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=engine,
        worker_args={
            "prefill-1": ["--device", args.prefill_device, *extra],
            "decode-1": ["--device", args.decode_device, *extra],
            "both-1": ["--device", args.prefill_device],
        },
    )
    rng = random.Random(SEED)
    params = SamplingParams(max_tokens=args.max_tokens, ignore_eos=True)

    def fresh_prompts():
        """New prompts for every pass: a prompt seen before would come from the prefix cache."""
        return [
            [1] + [rng.randrange(4, 300) for _ in range(args.prompt_len - 1)]
            for _ in range(args.num_requests)
        ]

    sequential_prompts, concurrent_prompts = fresh_prompts(), fresh_prompts()

    async def run(address: str, concurrent: bool):
        prompts = concurrent_prompts if concurrent else sequential_prompts
        # The aggregated worker serves only the cluster's internal plane: the bench holds its credentials.
        llm = await AsyncLLM(
            address, **(cluster.worker_client_kwargs() if address != cluster.address else {})
        )
        try:
            await llm.generate_async(fresh_prompts()[0], params)  # warm-up: peers, kernels
            started = time.perf_counter()
            if concurrent:
                outs = await asyncio.gather(*(llm.generate_async(p, params) for p in prompts))
            else:
                outs = [await llm.generate_async(p, params) for p in prompts]
            return outs, time.perf_counter() - started
        finally:
            llm.close()

    with cluster:
        # The aggregated worker and the split never share a cache, so both see every prompt fresh.
        split_seq, _ = asyncio.run(run(cluster.address, concurrent=False))
        local_seq, _ = asyncio.run(run(cluster.workers[2].address, concurrent=False))
        split_conc, split_wall = asyncio.run(run(cluster.address, concurrent=True))
        local_conc, local_wall = asyncio.run(run(cluster.workers[2].address, concurrent=True))
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(split_seq, local_seq)
    )
    same += sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids for a, b in zip(split_conc, local_conc)
    )

    def med(values):
        return statistics.median(values) * 1e3

    print(
        f"# disaggregated e2e: prefill {args.prefill_device} -> decode {args.decode_device}, "
        f"progress thread {'on' if args.progress_thread else 'off'}; {args.num_requests} requests x "
        f"{args.prompt_len} prompt tokens, {args.max_tokens} output tokens"
    )
    print(f"# greedy tokens equal to the aggregated worker: {same}/{2 * args.num_requests}")
    print(f"{'mode':<26}{'TTFT ms':>10}{'e2e ms':>10}{'KV pull ms':>12}{'KV MiB':>9}{'wall s':>9}")
    for name, outs, wall in (
        ("split, one at a time", split_seq, None),
        ("aggregated, one at a time", local_seq, None),
        ("split, concurrent", split_conc, split_wall),
        ("aggregated, concurrent", local_conc, local_wall),
    ):
        m = [o.metrics for o in outs]
        pull = med([x.kv_transfer_s for x in m]) if m[0].kv_transfer_bytes else 0.0
        mib = statistics.median([x.kv_transfer_bytes for x in m]) / 2**20
        print(
            f"{name:<26}{med([x.time_to_first_token_s for x in m]):>10.2f}{med([x.e2e_latency_s for x in m]):>10.2f}"
            f"{pull:>12.3f}{mib:>9.2f}{(f'{wall:.2f}' if wall else '-'):>9}"
        )
    if same != 2 * args.num_requests:
        raise SystemExit("disaggregated outputs differ from the aggregated worker")


if __name__ == "__main__":
    main()
