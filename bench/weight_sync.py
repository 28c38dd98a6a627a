"""Seconds per full weight sync from a trainer into a serving cluster (issue 32), one run:
update_weights by IPC handles (TensorRT-LLM's format) and over NIXL (the workers READ the
trainer's registered tensors) against the checkpoint path (the trainer writes safetensors, the
workers read them), the same weights every way.

    python bench/weight_sync.py                    # SmolLM2-135M (the default model), CPU
    python bench/weight_sync.py --model DIR --workers both,both --repeats 5
    python bench/weight_sync.py --device cuda --shape llama-3.1-8b --paths ipc   # one GPU

The trainer is this process (transformers' model of the served checkpoint); the cluster is real
processes on this host. Each sync is timed from the trainer's first byte to the cluster serving
the new weights (pause, the update, resume): IPC = make the handles, update_weights in one
bucket, update_weights(None); NIXL = update_weights(the tensors registered once, before the
timing: an optimizer stepping in place keeps them), update_weights(None); checkpoint = save_pretrained into a fresh directory, update_weights
(path). A warm-up sync of each kind runs first; the table prints the median and best of the
rest, the bytes, and their rate beside the host's memcpy rate (the floor of an in-place copy).
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from tandem.client import AsyncLLM
from tandem.engine.checkpoints import resolve_model
from tandem.rl import NixlWeightSource, ipc_handles
from tandem.testing.cluster import LocalCluster

TOKEN = "bench-weight-sync"


def _memcpy_gbps(num_bytes: int, device: torch.device) -> float:
    src = torch.empty(num_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(3):
        dst.copy_(src)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 3 * num_bytes / (time.perf_counter() - started) / 1e9


async def _sync_ipc(llm: AsyncLLM, named) -> None:
    await llm.pause_generation()
    await llm.update_weights(ipc_handles(named))
    await llm.update_weights(None)
    await llm.resume_generation()


async def _sync_nixl(llm: AsyncLLM, source: NixlWeightSource) -> None:
    await llm.pause_generation()
    await llm.update_weights(source.weights)
    await llm.update_weights(None)
    await llm.resume_generation()


async def _sync_checkpoint(llm: AsyncLLM, model) -> None:
    with tempfile.TemporaryDirectory(prefix="tandem-sync-") as path:
        model.save_pretrained(path, safe_serialization=True)
        await llm.pause_generation()
        await llm.update_weights(path)
        await llm.resume_generation()


async def _run(address: str, model, repeats: int, paths: list[str]) -> dict[str, list[float]]:
    named = [(n, p.data) for n, p in model.named_parameters()]
    times: dict[str, list[float]] = {path: [] for path in paths}
    sources: list[NixlWeightSource] = []

    def nixl_source() -> NixlWeightSource:
        # Registered at the first (warm-up) NIXL sync: IPC handles move CPU tensors into shared
        # memory once (share_memory_), and a registration of the old addresses would be stale.
        if not sources:
            sources.append(NixlWeightSource(named))
        return sources[0]

    syncs = {
        "ipc": lambda: _sync_ipc(llm, named),
        "nixl": lambda: _sync_nixl(llm, nixl_source()),
        "checkpoint": lambda: _sync_checkpoint(llm, model),
    }
    async with AsyncLLM(address, auth_token=TOKEN) as llm:
        for _ in range(repeats + 1):  # the first of each is the warm-up
            for kind in paths:
                sync = syncs[kind]
                with torch.no_grad():  # a step's change, so that every sync writes new values
                    for param in model.parameters():
                        param.mul_(1.0001)
                started = time.perf_counter()
                await sync()
                times[kind].append(time.perf_counter() - started)
        states = await llm.collective_rpc("get_worker_state")
        print(
            "workers after the syncs:",
            [(s["result"]["device_uuid"], s["result"]["weights_source"][-24:]) for s in states],
        )
    for source in sources:
        source.close()
    return {kind: values[1:] for kind, values in times.items()}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    parser.add_argument("--workers", default="both", help="worker roles, comma-separated")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument(
        "--shape", default=None, help="random weights of bench/serve.py's shape (llama-3.1-8b)"
    )
    parser.add_argument("--paths", default="ipc,nixl,checkpoint", help="which syncs to time")
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    device = torch.device(args.device)
    dtype = "bfloat16" if device.type == "cuda" else "float32"
    if args.shape:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from serve import SHAPES, write_checkpoint

        model_dir = write_checkpoint(
            Path(tempfile.gettempdir()) / f"tandem-weight-sync-{args.shape}",
            SHAPES[args.shape],
            device,
        )
    else:
        model_dir = resolve_model(args.model)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    num_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    roles = args.workers.split(",")
    engine_args = ["--model", str(model_dir), "--dtype", dtype, "--num-blocks", "64"]
    if device.type == "cuda":
        engine_args += ["--device", "cuda"]
    with LocalCluster(
        roles=roles, engine_args=engine_args, env={"TANDEM_ADMIN_TOKEN": TOKEN}
    ) as cluster:
        times = asyncio.run(_run(cluster.address, model, args.repeats, args.paths.split(",")))
    floor = _memcpy_gbps(num_bytes, device)
    print(
        f"# bench/weight_sync.py  {time.strftime('%Y-%m-%d')}  model {model_dir.name}  "
        f"{num_bytes / 1e6:.0f} MB {dtype} on {device.type}  workers {roles}  "
        f"repeats {args.repeats}"
    )
    print(f"{'path':12s} {'median s':>9s} {'best s':>8s} {'GB/s (best)':>12s}")
    for kind, values in times.items():
        best = min(values)
        print(
            f"{kind:12s} {statistics.median(values):9.3f} {best:8.3f} "
            f"{num_bytes / best / 1e9:12.2f}"
        )
    print(
        f"{device.type} memcpy floor: {floor:.2f} GB/s ({num_bytes / floor / 1e9:.3f} s for the "
        f"weights)"
    )


if __name__ == "__main__":
    main()
