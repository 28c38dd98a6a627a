"""TP2 against TP1 decode speed (issue 12): bs1 and bs32 tok/s on the Llama-3.1-8B shape, one run.

    python bench/tensor_parallel.py                # needs 2 CUDA GPUs: bf16, random weights, 8B shape
    python bench/tensor_parallel.py --shape tiny   # CPU smoke run (gloo; numbers mean nothing)

In-process engine steps (rank 0 in this process, rank 1 a child process): for each TP size and
batch size, BATCH sequences of 128-token prompts are prefilled, then decode steps are timed
(wall ms per step, tok/s = batch / step). Next to them: the floor of a step (the bytes one rank
reads / the device copy bandwidth: at TP2 half the weights per GPU) and the measured time of one
all-reduce of a decode step's hidden states times the all-reduces a step makes (2 per layer + the
embedding), plus the logits all-gather. The issue's goal: TP2 bs1 step <= 1.3 x (TP1 floor / 2 +
all-reduce time). Not run on 2 GPUs yet: no numbers are claimed for it.
"""

from __future__ import annotations

import argparse
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import SHAPES, _sync, copy_bandwidth, decode_bytes, write_checkpoint  # noqa: E402

SEED = 0
PROMPT_LEN = 128
BATCHES = (1, 32)


def log(*args) -> None:
    print(*args, file=sys.stderr, flush=True)


def decode_rates(model_dir: Path, tp: int, device: str, steps: int, vocab: int) -> dict[int, float]:
    """ms per decode step for each batch size, with tensor_parallel_size tp."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    on_cuda = device.startswith("cuda")
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=device,
            dtype="bfloat16" if on_cuda else "float32",
            kv_cache_memory_gb=16 if on_cuda else 0.25,
            max_num_seqs=max(BATCHES),
            max_num_batched_tokens=max(BATCHES) * PROMPT_LEN,
            max_model_len=2048,
            tensor_parallel_size=tp,
            max_loras=0,
        )
    )
    rng = random.Random(SEED)
    torch_device = torch.device(device)
    rates = {}
    try:
        for batch in BATCHES:
            opts = SamplingOptions(max_tokens=100_000, ignore_eos=True)
            for i in range(batch):
                engine.add_request(
                    f"tp{tp}-b{batch}-{i}",
                    [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)],
                    opts,
                )
            while any(
                s.num_output_tokens == 0
                for s in engine.scheduler.running + engine.scheduler.waiting
            ):
                engine.step()
            for _ in range(3):  # graph capture and warm-up
                engine.step()
            _sync(torch_device)
            start = time.perf_counter()
            for _ in range(steps):
                engine.step()
            _sync(torch_device)
            rates[batch] = (time.perf_counter() - start) / steps * 1e3
            for i in range(batch):
                engine.abort_request(f"tp{tp}-b{batch}-{i}")
            engine.step()
    finally:
        engine.close()
    return rates


_ALL_REDUCE = """
import os, sys, time, torch, torch.distributed as dist
rank, port, numel, gather_numel = int(sys.argv[1]), sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
cuda = torch.cuda.is_available()
if cuda:
    torch.cuda.set_device(rank)
dist.init_process_group("nccl" if cuda else "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
device = torch.device("cuda", rank) if cuda else torch.device("cpu")
x = torch.randn(numel, device=device, dtype=torch.bfloat16 if cuda else torch.float32)
g = torch.randn(gather_numel, device=device, dtype=x.dtype)
out = torch.empty(2 * gather_numel, device=device, dtype=x.dtype)
def timed(fn, n=200):
    for _ in range(20): fn()
    if cuda: torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(n): fn()
    if cuda: torch.cuda.synchronize()
    return (time.perf_counter() - start) / n * 1e3
reduce_ms = timed(lambda: dist.all_reduce(x))
gather_ms = timed(lambda: dist.all_gather_into_tensor(out, g) if cuda else dist.all_gather(list(out.chunk(2)), g))
if rank == 0:
    print(f"{reduce_ms} {gather_ms}")
dist.destroy_process_group()
"""


def collective_ms(hidden: int, vocab: int, batch: int) -> tuple[float, float]:
    """(one all-reduce of [batch, hidden], one all-gather of [batch, vocab / 2]) in ms, 2 ranks."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = str(sock.getsockname()[1])
    args = [str(batch * hidden), str(batch * -(-vocab // 2))]
    env = {**os.environ, "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0")}
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _ALL_REDUCE, str(rank), port, *args],
            env=env,
            stdout=subprocess.PIPE,
            text=True,
        )
        for rank in (0, 1)
    ]
    out = procs[0].communicate(timeout=300)[0]
    procs[1].wait(timeout=60)
    reduce_ms, gather_ms = (float(v) for v in out.split())
    return reduce_ms, gather_ms


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
    parser.add_argument("--steps", type=int, default=None, help="timed decode steps per row")
    args = parser.parse_args()
    on_cuda = torch.cuda.is_available()
    if on_cuda and torch.cuda.device_count() < 2:
        sys.exit(
            "bench/tensor_parallel.py needs 2 GPUs for TP2 (this host has 1); use --shape tiny on the CPU"
        )
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    shape = SHAPES[shape_name]
    steps = args.steps or (50 if on_cuda else 5)
    device = "cuda:0" if on_cuda else "cpu"
    torch.manual_seed(SEED)
    model_dir = (
        Path(os.environ.get("TANDEM_HOME", Path.home() / ".cache" / "tandem"))
        / "bench"
        / f"tp-{shape_name}"
    )
    write_checkpoint(model_dir, shape, torch.device(device))
    copy_gbs = copy_bandwidth(torch.device(device))
    floor_ms = {tp: decode_bytes(shape) / tp / (copy_gbs / 2 * 1e9) * 1e3 for tp in (1, 2)}
    rates = {tp: decode_rates(model_dir, tp, device, steps, shape["vocab_size"]) for tp in (1, 2)}
    num_reduces = 2 * shape["num_hidden_layers"] + 1
    print(
        f"# TP2 vs TP1 decode, {shape_name} shape, {'bf16 on ' + torch.cuda.get_device_name(0) if on_cuda else 'CPU'}; "
        f"device copy {copy_gbs:.0f} GB/s (read+write)"
    )
    print(
        "| batch | TP1 ms/step | TP1 tok/s | TP2 ms/step | TP2 tok/s | TP1 floor ms | TP2 floor ms | "
        f"all-reduce ms (x{num_reduces}) | all-gather ms | goal ms (1.3 x (TP1 floor/2 + comm)) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for batch in BATCHES:
        reduce_ms, gather_ms = collective_ms(shape["hidden_size"], shape["vocab_size"], batch)
        comm_ms = reduce_ms * num_reduces + gather_ms
        goal = 1.3 * (floor_ms[1] / 2 + comm_ms)
        print(
            f"| {batch} | {rates[1][batch]:.2f} | {batch / rates[1][batch] * 1e3:,.0f} | {rates[2][batch]:.2f} | "
            f"{batch / rates[2][batch] * 1e3:,.0f} | {floor_ms[1]:.2f} | {floor_ms[2]:.2f} | "
            f"{reduce_ms:.3f} ({reduce_ms * num_reduces:.2f}) | {gather_ms:.3f} | {goal:.2f} |"
        )


if __name__ == "__main__":
    main()
