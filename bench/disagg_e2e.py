"""End-to-end disaggregated serving: router -> prefill (device A) -> NIXL -> decode (device B),
against an aggregated worker on device A. Checks greedy tokens are equal and prints per-request
TTFT, KV pull time and bytes, and end-to-end latency; then the handover itself (issue 39): for
requests of two tokens (the prefill's and the decode's first), one at a time, the split's time to
the second token taken apart from its perf metrics (prefill = arrival to the first token; handoff
= the first token to the pull's start: the reply, the router, the decode's reserve; pull = the
READs and the lease's confirm; the decode's first step = the confirm's answer to the second token,
the step having started while the confirm was on the way) beside the aggregated worker's, called
directly and behind a router of its own (the hops through a router are not the handover's), and
beside the split through a second router with --no-announce-decode (the decode gets its request
after the context phase, not at its start: what announcing it saves) and a third with
--no-direct-handoff (the prefill does not send the handoff to the announced decode itself: what
that saves). Last, split and aggregated requests taken in turns (a round at a time: the split
with and without the direct handoff, then the aggregated worker): the passes above run one after
the other, and the device's and host's drift between them is larger than the handover; in turns
it falls on all alike.

    python bench/disagg_e2e.py                                  # CPU
    python bench/disagg_e2e.py --prefill-device cuda:0 --decode-device cuda:1 --progress-thread
"""

from __future__ import annotations

import argparse
import asyncio
import random
import shlex
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
    parser.add_argument(
        "--decode-args",
        default="",
        help="extra flags for the decode worker, e.g. --decode-args=--no-kv-early-reserve",
    )
    parser.add_argument(
        "--prefill-args",
        default="",
        help="extra flags for the prefill worker, e.g. --prefill-args=--engine-process",
    )
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
            "prefill-1": ["--device", args.prefill_device, *extra, *shlex.split(args.prefill_args)],
            "decode-1": ["--device", args.decode_device, *extra, *shlex.split(args.decode_args)],
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

    async def handover(address: str, routed: bool = False):
        llm = await AsyncLLM(
            address,
            **(cluster.worker_client_kwargs() if address != cluster.address and not routed else {}),
        )
        two = SamplingParams(max_tokens=2, ignore_eos=True, return_perf_metrics=True)
        try:
            await llm.generate_async(fresh_prompts()[0], two)
            return [await llm.generate_async(p, two) for p in fresh_prompts()]
        finally:
            llm.close()

    async def interleaved(split_addresses: list[str], local_address: str):
        """Rounds of 2-token requests taken in turns, one through each split router then one to
        the aggregated worker, each on a fresh prompt: drift between passes (the device's
        clocks, the host's load) falls on all alike."""
        splits = [await AsyncLLM(address) for address in split_addresses]
        local = await AsyncLLM(local_address, **cluster.worker_client_kwargs())
        two = SamplingParams(max_tokens=2, ignore_eos=True, return_perf_metrics=True)
        try:
            for llm in (*splits, local):
                await llm.generate_async(fresh_prompts()[0], two)
            rounds = []
            for prompts in zip(*(fresh_prompts() for _ in range(len(splits) + 1))):
                rounds.append(
                    [await llm.generate_async(p, two) for llm, p in zip((*splits, local), prompts)]
                )
            return rounds
        finally:
            for llm in (*splits, local):
                llm.close()

    with cluster:
        split_two = asyncio.run(handover(cluster.address))
        # The same split through a router that sends the decode its request only after the
        # context phase (--no-announce-decode): what announcing it at the start saves.
        unannounced = cluster.add_router("router-unannounced", ["--no-announce-decode"])
        unannounced_two = asyncio.run(handover(unannounced.address, routed=True))
        # And through a router whose prefill does not send the handoff to the announced decode
        # itself (--no-direct-handoff): the router's handoff alone, what the direct one saves.
        via_router = cluster.add_router("router-no-direct", ["--no-direct-handoff"])
        via_router_two = asyncio.run(handover(via_router.address, routed=True))
        local_two = asyncio.run(handover(cluster.workers[2].address))
        rounds = asyncio.run(
            interleaved([cluster.address, via_router.address], cluster.workers[2].address)
        )
        # The aggregated worker and the split never share a cache, so both see every prompt fresh.
        split_seq, _ = asyncio.run(run(cluster.address, concurrent=False))
        local_seq, _ = asyncio.run(run(cluster.workers[2].address, concurrent=False))
        split_conc, split_wall = asyncio.run(run(cluster.address, concurrent=True))
        local_conc, local_wall = asyncio.run(run(cluster.workers[2].address, concurrent=True))
    # The aggregated worker behind a router of its own: the split's hops through the router are
    # the router's, not the handover's.
    routed = LocalCluster(
        roles=["both"],
        engine_args=engine,
        worker_args={"both-1": ["--device", args.prefill_device]},
    )
    with routed:
        routed_two = asyncio.run(handover(routed.address, routed=True))
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
        f"{args.prompt_len} prompt tokens, {args.max_tokens} output tokens; prefill flags: "
        f"{args.prefill_args or '(none)'}; decode flags: {args.decode_args or '(none)'}"
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

    def segments(outs) -> dict[str, float]:
        parts: dict[str, list[float]] = {}
        for out in outs:
            t = out.outputs[0].request_perf_metrics.timing_metrics
            s = {
                k: getattr(t, k).total_seconds()
                for k in (
                    "arrival_time",
                    "first_token_time",
                    "last_token_time",
                    "kv_cache_transfer_start",
                    "kv_cache_transfer_end",
                )
            }
            row = {"prefill (TTFT)": s["first_token_time"] - s["arrival_time"]}
            if s["kv_cache_transfer_start"]:
                row["handoff"] = s["kv_cache_transfer_start"] - s["first_token_time"]
                row["pull"] = s["kv_cache_transfer_end"] - s["kv_cache_transfer_start"]
                row["decode first step"] = s["last_token_time"] - s["kv_cache_transfer_end"]
            else:
                row["second token"] = s["last_token_time"] - s["first_token_time"]
            row["time to the second token"] = s["last_token_time"] - s["arrival_time"]
            for k, v in row.items():
                parts.setdefault(k, []).append(v)
        return {k: med(v) for k, v in parts.items()}

    split_parts, local_parts = segments(split_two), segments(local_two)
    unannounced_parts = segments(unannounced_two)
    via_router_parts = segments(via_router_two)
    routed_parts = segments(routed_two)
    nbytes = statistics.median(o.metrics.kv_transfer_bytes for o in split_two)
    print(f"\n# the handover, {args.num_requests} requests of 2 tokens one at a time (medians, ms)")
    for name, parts in (
        ("split", split_parts),
        ("split, --no-direct-handoff", via_router_parts),
        ("split, --no-announce-decode", unannounced_parts),
        ("aggregated", local_parts),
        ("aggregated behind a router", routed_parts),
    ):
        print(f"{name:<30}" + "  ".join(f"{k} {v:.2f}" for k, v in parts.items()))
    pull_gbps = nbytes / (split_parts["pull"] / 1e3) / 1e9 if split_parts.get("pull") else 0.0
    added = split_parts["time to the second token"] / local_parts["time to the second token"] - 1
    routed_added = (
        split_parts["time to the second token"] / routed_parts["time to the second token"] - 1
    )
    print(
        f"pull {nbytes / 2**20:.2f} MiB in {split_parts.get('pull', 0):.2f} ms ({pull_gbps:.2f} GB/s; "
        f"the bare transfer of the same bytes: bench/kv_transfer.py); the split's time to the second "
        f"token is {added:+.0%} against the aggregated worker's, {routed_added:+.0%} against the "
        f"aggregated worker behind a router (goal on one GPU: the handover adds <= 10% to a "
        f"1024-token TTFT)"
    )

    def second_token_s(out) -> float:
        t = out.outputs[0].request_perf_metrics.timing_metrics
        return (t.last_token_time - t.arrival_time).total_seconds()

    print(
        f"taken in turns, {len(rounds)} rounds: time to the second token of the aggregated "
        f"worker {med([second_token_s(r[-1]) for r in rounds]):.2f} ms"
    )
    for i, name in enumerate(("split", "split, --no-direct-handoff")):
        ratios = sorted(second_token_s(r[i]) / second_token_s(r[-1]) - 1 for r in rounds)
        quartile = len(ratios) // 4
        print(
            f"  {name:<28}{med([second_token_s(r[i]) for r in rounds]):.2f} ms; each round's ratio "
            f"to the aggregated worker's: median {statistics.median(ratios):+.1%} (quartiles "
            f"{ratios[quartile]:+.1%} .. {ratios[-1 - quartile]:+.1%})"
        )
    early = sum(o.metrics.kv_handoff.reserved_early for o in split_two)
    direct = sum(o.metrics.kv_handoff.from_prefill for o in split_two)
    print(
        f"split requests whose blocks the decode reserved at the announcement: {early}/{len(split_two)}; "
        f"whose handoff came from the prefill itself, ahead of the router's: {direct}/{len(split_two)}"
    )
    if same != 2 * args.num_requests:
        raise SystemExit("disaggregated outputs differ from the aggregated worker")


if __name__ == "__main__":
    main()
