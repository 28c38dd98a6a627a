"""KV transfer benchmark: NIXL READ between two processes vs a raw copy of the same bytes.

A spawned prefill process owns the source pool; this process is the decode
reader. For each prompt length it times read_blocks()+wait() (median of --iters
after --warmup) and, in the same run, a plain torch copy of the same number of
bytes: memcpy between two CPU tensors, or cuda:0 -> cuda:1 with --device cuda
(cuda:0 -> cuda:0 with one GPU, or --pair one-gpu: two processes on one device, as a split
served from one GPU). That copy is the roofline the transfer is measured against.

    python bench/kv_transfer.py                       # small CPU shape
    python bench/kv_transfer.py --shape llama-3.1-8b  # 4 MiB blocks
    python bench/kv_transfer.py --device cuda --shape llama-3.1-8b   # VRAM, 2 GPUs (or 1)
    python bench/kv_transfer.py --device cuda --pair one-gpu --ucx-cuda-ipc-get auto   # UCX's own choice

--ucx-cuda-ipc-get sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY in both processes (unset: tandem's default,
y for GPU pools, kvtransfer/ucx_env.py; auto: UCX's, off without NVLink).
"""

from __future__ import annotations

import argparse
import math
import multiprocessing as mp
import os
import random
import statistics
import time
from dataclasses import dataclass

import torch

from tandem.kvtransfer import KvTransceiver

PROMPT_LENGTHS = (128, 512, 1024, 2048, 4096, 8192)
SEED = 0
PREFILL_NAME = "bench-prefill"
DECODE_NAME = "bench-decode"
PREFILL_LIFETIME_S = 900.0
# Without progress threads a READ completes only when the target progresses
# too, so the prefill polls at a cadence well under the smallest transfer time.
PREFILL_POLL_S = 1e-4


@dataclass(frozen=True)
class KvShape:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    @property
    def block_nbytes(self) -> int:
        return (
            self.num_layers
            * 2
            * self.block_size
            * self.num_kv_heads
            * self.head_dim
            * self.dtype.itemsize
        )

    @property
    def layout_hash(self) -> str:
        return f"bench/{self.dtype}/L{self.num_layers}/H{self.num_kv_heads}/D{self.head_dim}/B{self.block_size}"

    def pool(self, num_blocks: int, device: torch.device) -> torch.Tensor:
        dims = (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        return torch.empty(dims, dtype=self.dtype, device=device)


SHAPES = {
    "small": KvShape(
        num_layers=4, num_kv_heads=4, head_dim=64, block_size=16, dtype=torch.bfloat16
    ),
    "llama-3.1-8b": KvShape(
        num_layers=32, num_kv_heads=8, head_dim=128, block_size=32, dtype=torch.bfloat16
    ),
}


def stamp_blocks(pool: torch.Tensor) -> None:
    """Block b is filled with byte b % 251, so a misplaced block is caught cheaply."""
    flat = pool.view(pool.shape[0], -1).view(torch.uint8)
    flat.copy_(
        (torch.arange(pool.shape[0], device=pool.device) % 251)
        .to(torch.uint8)[:, None]
        .expand_as(flat)
    )


def prefill_main(
    conn, shape_name: str, num_blocks: int, device: str, progress_thread: bool
) -> None:
    """Source pool owner: publishes its state, counts notifications until told to stop."""
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    pool = SHAPES[shape_name].pool(num_blocks, torch_device)
    stamp_blocks(pool)
    layout_hash = SHAPES[shape_name].layout_hash
    with KvTransceiver(
        PREFILL_NAME, pool, layout_hash, progress_thread=progress_thread
    ) as transceiver:
        conn.send_bytes(transceiver.get_state())
        num_notifications = 0
        end = time.monotonic() + PREFILL_LIFETIME_S
        while time.monotonic() < end:
            num_notifications += len(transceiver.poll_notifications())
            # Connection.poll rounds its timeout up to whole milliseconds.
            if conn.poll(0):
                break
            time.sleep(PREFILL_POLL_S)
        time.sleep(0.2)  # let notifications of the last reads arrive before the count
        num_notifications += len(transceiver.poll_notifications())
        conn.send_bytes(str(num_notifications).encode())


def start_prefill(shape_name: str, num_blocks: int, device: str, progress_thread: bool):
    """The prefill process (prefill_main, spawned) once it has published its transceiver's
    state: (the process, our end of its pipe, the state)."""
    context = mp.get_context("spawn")
    conn, child_conn = context.Pipe()
    prefill = context.Process(
        target=prefill_main,
        args=(child_conn, shape_name, num_blocks, device, progress_thread),
        daemon=True,
    )
    prefill.start()
    child_conn.close()
    if not conn.poll(120):
        prefill.kill()
        raise SystemExit("prefill process did not publish its state within 120 s")
    return prefill, conn, conn.recv_bytes()


def timed_s(fn, iters: int, warmup: int, reduce=statistics.median) -> float:
    for _ in range(warmup):
        fn()
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - start)
    return reduce(samples)


def copy_fn(nbytes: int, src_device: torch.device, dst_device: torch.device):
    src = torch.empty(nbytes, dtype=torch.uint8, device=src_device)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=dst_device)
    is_cuda = src_device.type == "cuda" or dst_device.type == "cuda"

    def run() -> None:
        dst.copy_(src, non_blocking=is_cuda)
        if is_cuda:
            torch.cuda.synchronize(dst_device)
            torch.cuda.synchronize(src_device)

    return run


def pick_block_ids(
    rng: random.Random, num_blocks: int, pool_blocks: int, layout: str
) -> tuple[list[int], list[int]]:
    if layout == "contiguous":
        return list(range(num_blocks)), list(range(num_blocks))
    return rng.sample(range(pool_blocks), num_blocks), rng.sample(range(pool_blocks), num_blocks)


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument(
        "--layout",
        choices=("contiguous", "scattered"),
        default="contiguous",
        help="block ids of a request: one run, or random blocks of the pool on both sides",
    )
    parser.add_argument(
        "--no-progress-thread",
        dest="progress_thread",
        action="store_false",
        help="no NIXL UCX progress thread in either agent (each one spins a core)",
    )
    parser.add_argument(
        "--max-desc-mib",
        type=float,
        default=None,
        help="cut block runs into descriptors of at most this many MiB (default: one per run)",
    )
    parser.add_argument(
        "--pair",
        choices=("auto", "two-gpus", "one-gpu"),
        default="auto",
        help="--device cuda: the pools on cuda:0 and cuda:1, or both on cuda:0 (auto: two if there "
        "are two)",
    )
    parser.add_argument(
        "--ucx-cuda-ipc-get",
        choices=("y", "n", "auto"),
        default=None,
        help="UCX_CUDA_IPC_ENABLE_GET_ZCOPY in both processes (default: unset, tandem's default)",
    )
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    args = parser.parse_args()
    if args.ucx_cuda_ipc_get:
        os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = (
            args.ucx_cuda_ipc_get
        )  # the spawned prefill inherits it

    shape = SHAPES[args.shape]
    if args.device == "cuda":
        two = args.pair == "two-gpus" or (args.pair == "auto" and torch.cuda.device_count() >= 2)
        if two and torch.cuda.device_count() < 2:
            raise SystemExit(
                "--pair two-gpus needs 2 GPUs: the prefill pool on cuda:0, the decode pool on cuda:1"
            )
        prefill_device, decode_device = (
            torch.device("cuda:0"),
            torch.device("cuda:1" if two else "cuda:0"),
        )
        torch.cuda.set_device(decode_device)
    else:
        prefill_device = decode_device = torch.device("cpu")
        # One copy thread, like the UCX copy it is compared with; a multi-threaded
        # copy also stalls a whole scheduler slice at its barrier whenever another
        # process holds one of the cores.
        torch.set_num_threads(1)
    max_blocks = math.ceil(max(PROMPT_LENGTHS) / shape.block_size)
    # Scattered picks need room to scatter in; twice the largest request.
    pool_blocks = 2 * max_blocks

    # The roofline is measured before any NIXL agent exists (their progress
    # threads spin cores, a cost that belongs to the transfer) and is the best
    # sample, not the median: it is what the memory system can do, and a shared
    # host's noise should not lower the bar the transfer is held to.
    copy_s = {
        num_tokens: timed_s(
            copy_fn(
                math.ceil(num_tokens / shape.block_size) * shape.block_nbytes,
                prefill_device,
                decode_device,
            ),
            args.iters,
            args.warmup,
            reduce=min,
        )
        for num_tokens in PROMPT_LENGTHS
    }

    prefill, conn, state = start_prefill(
        args.shape, pool_blocks, str(prefill_device), args.progress_thread
    )

    decode_pool = shape.pool(pool_blocks, decode_device)
    transceiver = KvTransceiver(
        DECODE_NAME,
        decode_pool,
        shape.layout_hash,
        progress_thread=args.progress_thread,
        max_descriptor_bytes=int(args.max_desc_mib * 2**20) if args.max_desc_mib else None,
    )
    transceiver.add_peer(state)
    rng = random.Random(SEED)
    num_reads = 0

    def read(remote_ids: list[int], local_ids: list[int]):
        nonlocal num_reads
        num_reads += 1
        transfer = transceiver.read_blocks(PREFILL_NAME, remote_ids, local_ids, b"bench")
        transfer.wait(60.0)
        return transfer

    pair = f"{prefill_device} -> {decode_device}" if args.device == "cuda" else "CPU memcpy"
    print(
        f"# KV transfer, NIXL READ ({args.device} {pair}, {args.layout} blocks, progress thread "
        f"{'on' if args.progress_thread else 'off'}, max descriptor {args.max_desc_mib or 'unlimited'} MiB, "
        f"UCX_CUDA_IPC_ENABLE_GET_ZCOPY {os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY', 'unset')} before the "
        f"agents), shape {args.shape}: {shape}"
    )
    print(
        f"# block = {shape.block_nbytes / 2**10:.0f} KiB; median of {args.iters} after {args.warmup} warm-up; "
        f"roofline = best torch copy of the same bytes ({pair}), this run, before the agents start"
    )
    one_block_s = timed_s(lambda: read([0], [0]), args.iters, args.warmup)
    print(
        f"# fixed overhead per request (1-block READ, {shape.block_nbytes / 2**10:.0f} KiB): "
        f"{one_block_s * 1e6:.0f} us"
    )
    header = (
        f"{'tokens':>7} {'blocks':>6} {'MiB':>8} {'descs':>5} {'xfer ms':>8} {'xfer GB/s':>9} "
        f"{'copy ms':>8} {'copy GB/s':>9} {'ratio':>6}"
    )
    print(header)
    print("-" * len(header))
    for num_tokens in PROMPT_LENGTHS:
        num_blocks = math.ceil(num_tokens / shape.block_size)
        remote_ids, local_ids = pick_block_ids(rng, num_blocks, pool_blocks, args.layout)
        nbytes = num_blocks * shape.block_nbytes
        num_descriptors = read(remote_ids, local_ids).num_descriptors
        xfer_s = timed_s(lambda: read(remote_ids, local_ids), args.iters, args.warmup)
        stamps = decode_pool.view(pool_blocks, -1).view(torch.uint8)[local_ids, 0].cpu().tolist()
        if stamps != [r % 251 for r in remote_ids]:
            raise SystemExit(
                f"data check failed at {num_tokens} tokens: blocks landed in the wrong place"
            )
        xfer_gbps, copy_gbps = nbytes / xfer_s / 1e9, nbytes / copy_s[num_tokens] / 1e9
        print(
            f"{num_tokens:>7} {num_blocks:>6} {nbytes / 2**20:>8.1f} {num_descriptors:>5} {xfer_s * 1e3:>8.3f} "
            f"{xfer_gbps:>9.2f} {copy_s[num_tokens] * 1e3:>8.3f} {copy_gbps:>9.2f} {xfer_gbps / copy_gbps:>6.2f}"
        )

    conn.send_bytes(b"stop")
    num_notified = int(conn.recv_bytes()) if conn.poll(30) else -1
    prefill.join(30)
    transceiver.close()
    print(f"# prefill received {num_notified} of {num_reads} notifications")


if __name__ == "__main__":
    main()
