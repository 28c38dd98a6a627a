"""The prefill/decode split on ONE GPU beside the aggregated worker on the same GPU, one run.

    python bench/split_one_gpu.py                 # CUDA: Llama-3.1-8B-shaped bf16, random weights
    python bench/split_one_gpu.py --shape tiny    # CPU smoke run (numbers mean nothing)

Both workers of the split run on the same device, its KV cache split between them (each gets
half the aggregated worker's --kv-cache-gb). The KV then moves between two processes on one GPU:
at UCX's defaults over loopback TCP, with tandem's default (kvtransfer/ucx_env.py) over CUDA IPC.
`--ucx-cuda-ipc-get auto` runs the split at UCX's own choice instead.

Rows (the same prompts for both deployments, fixed seed): one 1024/128 request alone,
16 x 1024/128 and 64 x 128/256 at once, and a burst of 512 ShareGPT-shaped requests (lognormal
prompt and output lengths, medians 256 and 192 tokens). Per row: output tok/s, wall, TTFT and TPOT
p50/p99, the pull's p50/p99 (reservation to landing, per request) and how many handoffs moved KV
(a handoff that moved none was computed again on the decode). Last: the decode's measured link
rate (GetWorkerState.kv_pull_links) and the goals beside the numbers.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import SEED, SHAPES, log, serving_engine_args, write_checkpoint  # noqa: E402

ROWS = ("one", "c16", "c64", "burst")
GOALS = {
    "one": "pull <= 4 ms",
    "c16": "TPOT p50 <= 1.3x aggregated",
    "c64": ">= 0.9x aggregated tok/s",
    "burst": "wall <= 1.2x aggregated",
}


def workload(name: str, vocab: int, quick: bool, seed: str = "") -> list[tuple[list[int], int]]:
    """(prompt ids, max_tokens) per request; the same for both deployments (another seed: other prompts)."""
    rng = random.Random(f"{SEED}-{name}-{seed}")

    def prompt(length: int) -> list[int]:
        return [rng.randrange(3, vocab) for _ in range(length)]

    scale = 4 if quick else 1
    if name == "one":
        return [(prompt(1024), 128 // scale)]
    if name == "c16":
        return [(prompt(1024), 128 // scale) for _ in range(16)]
    if name == "c64":
        return [(prompt(128), 256 // scale) for _ in range(64)]
    # ShareGPT's shape: long-tailed prompts and outputs (no dataset offline; lognormal with its medians).
    out = []
    for _ in range(512 // scale):
        prompt_len = min(2048, max(8, int(rng.lognormvariate(math.log(256), 0.9))))
        max_tokens = min(512, max(4, int(rng.lognormvariate(math.log(192), 0.8))))
        out.append((prompt(prompt_len), max(2, max_tokens // scale)))
    return out


async def run_row(address: str, requests: list[tuple[list[int], int]]) -> dict:
    from tandem.client import AsyncLLM, SamplingParams

    llm = await AsyncLLM(address)
    try:
        start = time.perf_counter()
        outs = await asyncio.gather(
            *(
                llm.generate_async(
                    p, SamplingParams(max_tokens=n, ignore_eos=True, detokenize=False)
                )
                for p, n in requests
            )
        )
        wall = time.perf_counter() - start
    finally:
        llm.close()
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    ttft = [o.metrics.time_to_first_token_s * 1e3 for o in outs]
    tpot = [
        (o.metrics.e2e_latency_s - o.metrics.time_to_first_token_s)
        * 1e3
        / (len(o.outputs[0].token_ids) - 1)
        for o in outs
        if len(o.outputs[0].token_ids) > 1
    ]
    pulls = [o.metrics.kv_transfer_s * 1e3 for o in outs if o.metrics.kv_transfer_bytes > 0]
    return dict(
        n=len(outs),
        tok_s=tokens / wall,
        wall_s=wall,
        ttft_p50=pct(ttft, 50),
        ttft_p99=pct(ttft, 99),
        tpot_p50=pct(tpot, 50),
        tpot_p99=pct(tpot, 99),
        pull_p50=pct(pulls, 50),
        pull_p99=pct(pulls, 99),
        moved_kv=len(pulls),
    )


def pct(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q / 100 * (len(ordered) - 1)))]


def serve(
    roles: list[str],
    engine_args: list[str],
    worker_args: dict,
    rows: list[str],
    vocab: int,
    quick: bool,
    log_dir: Path,
    env: dict | None = None,
) -> dict:
    from tandem.testing.cluster import LocalCluster, channel_to
    from tandem.v1 import worker_pb2, worker_pb2_grpc

    cluster = LocalCluster(
        roles=roles, engine_args=engine_args, worker_args=worker_args, log_dir=log_dir, env=env
    )
    results: dict = {}
    with contextlib.ExitStack() as stack:
        started = time.perf_counter()
        cluster.start(timeout=900)
        stack.callback(cluster.stop)
        log(f"{'+'.join(roles)} up in {time.perf_counter() - started:.0f} s")
        # Warm-up: kernels of both prompt lengths, the decode's peer state, CUDA graphs; prompts of
        # their own, so that no measured prompt is in a prefix cache.
        asyncio.run(
            run_row(
                cluster.address,
                [(p, 8) for p, _ in workload("c16", vocab, True, "warm-up")[:4]]
                + [(p, 8) for p, _ in workload("c64", vocab, True, "warm-up")[:8]],
            )
        )
        for row in rows:
            results[row] = asyncio.run(run_row(cluster.address, workload(row, vocab, quick)))
            log(
                f"  {'+'.join(roles)} {row}: {json.dumps({k: round(v, 2) for k, v in results[row].items()})}"
            )
        if "decode" in roles:
            with channel_to(cluster.workers[1].address) as channel:
                state = worker_pb2_grpc.WorkerStub(channel).GetWorkerState(
                    worker_pb2.WorkerStateRequest(), timeout=10
                )
            results["links"] = [
                dict(
                    peer=link.peer,
                    same_host=link.same_host,
                    device_pools=link.device_pools,
                    num_pulls=link.num_pulls,
                    mean_gbps=link.mean_gbps,
                    last_gbps=link.last_gbps,
                    num_below_floor=link.num_below_floor,
                    best_gbps=link.best_gbps,
                )
                for link in state.kv_pull_links
            ]
            # How every handoff ended on the decode (warm-up included): pulled or recomputed, and why.
            results["outcomes"] = dict(state.kv_handoff_outcomes)
    if "decode" in roles:  # a healthy lane must not warn of a slow one
        decode_log = cluster.workers[1].log_path.read_text(errors="replace")
        results["floor_warnings"] = sum("KV pulls from" in line for line in decode_log.splitlines())
    return results


def print_table(agg: dict, split: dict, label: str) -> None:
    log("")
    log(
        f"{'row':<22}{'deployment':<12}{'tok/s':>9}{'wall s':>8}{'TTFT p50/p99 ms':>18}{'TPOT p50/p99 ms':>18}"
        f"{'pull p50/p99 ms':>18}{'moved KV':>10}   goal"
    )
    names = {
        "one": "1 x 1024/128",
        "c16": "16 x 1024/128",
        "c64": "64 x 128/256",
        "burst": "burst ShareGPT",
    }
    for row in ROWS:
        for deployment, res in (("aggregated", agg), (label, split)):
            r = res.get(row)
            if r is None:
                continue
            moved = f"{r['moved_kv']}/{r['n']}" if deployment != "aggregated" else "-"
            goal = GOALS[row] if deployment != "aggregated" else ""
            log(
                f"{names[row] if deployment == 'aggregated' else '':<22}{deployment:<12}{r['tok_s']:>9,.0f}"
                f"{r['wall_s']:>8.2f}{r['ttft_p50']:>9.1f}/{r['ttft_p99']:<8.1f}{r['tpot_p50']:>9.2f}/"
                f"{r['tpot_p99']:<8.2f}{r['pull_p50']:>9.2f}/{r['pull_p99']:<8.2f}{moved:>10}   {goal}"
            )
        if row in agg and row in split:
            a, s = agg[row], split[row]
            log(
                f"{'':<22}{'ratio':<12}{s['tok_s'] / a['tok_s']:>9.2f}{s['wall_s'] / a['wall_s']:>8.2f}"
                f"{'':>18}{s['tpot_p50'] / a['tpot_p50']:>9.2f}"
            )
    for link in split.get("links", []):
        log(
            f"decode's link to {link['peer']}: {link['num_pulls']} pulls, mean {link['mean_gbps']:.2f} GB/s, best "
            f"{link['best_gbps']:.2f} GB/s, last {link['last_gbps']:.2f} GB/s, same host {link['same_host']}, device "
            f"pools {link['device_pools']}, pulls under the floor {link['num_below_floor']}; slow-lane warnings in the "
            f"decode's log: {split.get('floor_warnings')}"
        )
    if split.get("outcomes"):
        log(f"decode's handoff outcomes (all rows and the warm-up): {split['outcomes']}")


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="default: llama-3.1-8b on CUDA, tiny on CPU",
    )
    parser.add_argument(
        "--model-dir", default=None, help="where the checkpoint is (written if missing)"
    )
    parser.add_argument("--rows", default=",".join(ROWS))
    parser.add_argument("--deployments", default="aggregated,split")
    parser.add_argument(
        "--kv-cache-gb",
        type=float,
        default=None,
        help="the aggregated worker's KV pool; each split worker gets half (default 24 GPU, 0.5 CPU)",
    )
    parser.add_argument(
        "--ucx-cuda-ipc-get",
        default=None,
        choices=("y", "n", "auto"),
        help="UCX_CUDA_IPC_ENABLE_GET_ZCOPY for the split's workers (default: unset, tandem's "
        "default applies)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="fewer and shorter requests (smoke runs)"
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    device = "cuda:0" if on_cuda else "cpu"
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    shape = SHAPES[shape_name]
    shm = (
        Path("/dev/shm")
        if Path("/dev/shm").is_dir() and on_cuda
        else Path(os.environ.get("TANDEM_HOME", "/tmp"))
    )
    model_dir = Path(args.model_dir or shm / f"tandem-{shape_name}-bf16")
    rows = [r for r in args.rows.split(",") if r]
    unknown = set(rows) - set(ROWS)
    if unknown:
        raise SystemExit(f"unknown rows {sorted(unknown)}; rows are {', '.join(ROWS)}")
    kv_gb = args.kv_cache_gb or (24.0 if on_cuda else 0.5)
    log(
        f"# bench/split_one_gpu.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
    )
    log(
        f"# device {torch.cuda.get_device_name(0) if on_cuda else 'cpu'}, shape {shape_name}, KV {kv_gb} GB "
        f"aggregated / {kv_gb / 2} + {kv_gb / 2} GB split, UCX_CUDA_IPC_ENABLE_GET_ZCOPY for the split: "
        f"{args.ucx_cuda_ipc_get or 'unset (tandem default)'}"
    )
    write_checkpoint(model_dir, shape, torch.device(device))

    def engine_args(gb: float) -> list[str]:
        return serving_engine_args(model_dir, gb)

    log_root = Path("/tmp/tandem-split-one-gpu-logs")
    deployments = args.deployments.split(",")
    agg = split = {}
    if "aggregated" in deployments:
        agg = serve(
            ["both"],
            engine_args(kv_gb),
            {"both-1": ["--device", device]},
            rows,
            shape["vocab_size"],
            args.quick,
            log_root / "aggregated",
        )
    if "split" in deployments:
        env = (
            {"UCX_CUDA_IPC_ENABLE_GET_ZCOPY": args.ucx_cuda_ipc_get}
            if args.ucx_cuda_ipc_get
            else None
        )
        split = serve(
            ["prefill", "decode"],
            engine_args(kv_gb / 2),
            {"prefill-1": ["--device", device], "decode-1": ["--device", device]},
            rows,
            shape["vocab_size"],
            args.quick,
            log_root / "split",
            env=env,
        )
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "split_one_gpu.json").write_text(
        json.dumps({"aggregated": agg, "split": split}, indent=1)
    )
    print_table(
        agg, split, "split" if not args.ucx_cuda_ipc_get else f"split {args.ucx_cuda_ipc_get}"
    )


if __name__ == "__main__":
    main()
