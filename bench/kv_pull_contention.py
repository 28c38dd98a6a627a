"""Where a KV pull's time goes in serving: the same NIXL READ as bench/kv_transfer.py, polled the
way the workers poll it (an asyncio loop on each side), beside a thread that holds the GIL the
way an engine thread does.

A worker's gRPC loop shares the GIL with its engine thread. A thread that wants the GIL back
waits up to the switch interval (5 ms) each time, so every `await asyncio.sleep()` between two
polls can cost milliseconds while the engine runs Python. Without UCX progress threads a READ
also completes only once the *prefill* side polls, and it polls from its own loop. The rows
separate those costs:

    python bench/kv_pull_contention.py                                   # CPU, small shape
    python bench/kv_pull_contention.py --device cuda --shape llama-3.1-8b   # one GPU, 1024 tokens
    python bench/kv_pull_contention.py --device cuda --shape llama-3.1-8b --ucx-cuda-ipc-get auto  # UCX's choice

--ucx-cuda-ipc-get sets UCX_CUDA_IPC_ENABLE_GET_ZCOPY in both processes (unset: tandem's default,
y for GPU pools, kvtransfer/ucx_env.py; auto: UCX's own, which on one GPU goes over loopback TCP).

engine profiles (GIL held / released per step): "eager" 25 / 8 ms is the engine before CUDA
graphs (21-32 ms of Python per 8 ms step); "graphs" 0.5 / 4 ms is a replayed decode step.
"""

from __future__ import annotations

import argparse
import asyncio
import math
import multiprocessing as mp
import os
import statistics
import threading
import time

import torch
from kv_transfer import SHAPES, stamp_blocks

from tandem.kvtransfer import KvTransceiver

PREFILL_NAME, DECODE_NAME = "pull-prefill", "pull-decode"
PROFILES = {"idle": None, "eager": (0.025, 0.008), "graphs": (0.0005, 0.004)}


class EngineLikeThread(threading.Thread):
    """Holds the GIL for `hold` seconds of Python, then releases it for `wait` seconds (a GPU wait)."""

    def __init__(self, profile: str):
        super().__init__(daemon=True)
        self.profile = PROFILES[profile]
        self.stopped = False

    def run(self) -> None:
        hold, wait = self.profile
        while not self.stopped:
            end = time.perf_counter() + hold
            x = 0
            while time.perf_counter() < end:
                for i in range(200):
                    x += i
            time.sleep(wait)


def _with_engine(profile: str):
    thread = None
    if PROFILES[profile] is not None:
        thread = EngineLikeThread(profile)
        thread.start()
    return thread


def prefill_main(conn, shape_name: str, num_blocks: int, device: str) -> None:
    """The pool owner, polling its notifications from an asyncio loop as the HandoffKeeper does
    (every 0.5 ms while leases are out); conn messages switch its engine-like thread's profile."""
    torch_device = torch.device(device)
    if torch_device.type == "cuda":
        torch.cuda.set_device(torch_device)
    pool = SHAPES[shape_name].pool(num_blocks, torch_device)
    stamp_blocks(pool)
    with KvTransceiver(
        PREFILL_NAME, pool, SHAPES[shape_name].layout_hash, progress_thread=False
    ) as transceiver:
        conn.send_bytes(transceiver.get_state())

        async def serve():
            engine, poller = None, None
            while True:
                if poller is None:
                    transceiver.poll_notifications()
                if conn.poll(0):
                    message = conn.recv_bytes().decode()
                    for thread in (engine, poller):
                        if thread is not None:
                            thread.stopped = True
                            thread.join()
                    if message == "stop":
                        return
                    profile, where = message.split(":")
                    engine = _with_engine(profile)
                    poller = _NotificationThread(transceiver) if where == "thread" else None
                    conn.send_bytes(b"ok")
                await asyncio.sleep(0.0005)

        asyncio.run(serve())


class _NotificationThread(threading.Thread):
    """Polls the prefill's notifications from a thread of its own (time.sleep releases the GIL)."""

    def __init__(self, transceiver):
        super().__init__(daemon=True)
        self.transceiver, self.stopped = transceiver, False
        self.start()

    def run(self) -> None:
        while not self.stopped:
            self.transceiver.poll_notifications()
            time.sleep(0.0001)


async def pull_loop(transceiver, block_ids, iters: int) -> list[float]:
    """READs polled as the decode worker polls them: `await asyncio.sleep(0.0002)` between checks."""
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        transfer = transceiver.read_blocks(PREFILL_NAME, block_ids, block_ids, b"pulled")
        while not transfer.done():
            await asyncio.sleep(0.0002)
        samples.append(time.perf_counter() - start)
    return samples


def thread_pull(transceiver, block_ids, iters: int) -> list[float]:
    """The same READs polled from a thread of their own with time.sleep (which releases the GIL)."""
    samples = []
    for _ in range(iters):
        start = time.perf_counter()
        transfer = transceiver.read_blocks(PREFILL_NAME, block_ids, block_ids, b"pulled")
        while not transfer.done():
            time.sleep(0.00005)
        samples.append(time.perf_counter() - start)
    return samples


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(SHAPES), default="small")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument(
        "--ucx-cuda-ipc-get",
        choices=("y", "n", "auto"),
        default=None,
        help="UCX_CUDA_IPC_ENABLE_GET_ZCOPY in both processes (default: unset, tandem's default)",
    )
    args = parser.parse_args()
    if args.ucx_cuda_ipc_get:
        os.environ["UCX_CUDA_IPC_ENABLE_GET_ZCOPY"] = (
            args.ucx_cuda_ipc_get
        )  # the spawned prefill inherits it
    shape = SHAPES[args.shape]
    num_blocks = math.ceil(args.tokens / shape.block_size)
    # Both pools on one GPU when there is one GPU (the split runs so on a one-GPU machine).
    prefill_device = "cuda:0" if args.device == "cuda" else "cpu"
    decode_device = (
        torch.device("cuda", torch.cuda.device_count() - 1)
        if args.device == "cuda"
        else torch.device("cpu")
    )
    if decode_device.type == "cuda":
        torch.cuda.set_device(decode_device)
    context = mp.get_context("spawn")
    conn, child = context.Pipe()
    prefill = context.Process(
        target=prefill_main, args=(child, args.shape, num_blocks, prefill_device), daemon=True
    )
    prefill.start()
    if not conn.poll(120):
        raise SystemExit("the prefill process did not publish its state")
    state = conn.recv_bytes()
    pool = shape.pool(num_blocks, decode_device)
    transceiver = KvTransceiver(DECODE_NAME, pool, shape.layout_hash, progress_thread=False)
    transceiver.add_peer(state)
    block_ids = list(range(num_blocks))
    nbytes = num_blocks * shape.block_nbytes
    print(
        f"# KV pull of {args.tokens} tokens ({nbytes / 2**20:.0f} MiB, {args.shape}), {prefill_device} -> "
        f"{decode_device}, no progress threads, UCX_CUDA_IPC_ENABLE_GET_ZCOPY "
        f"{os.environ.get('UCX_CUDA_IPC_ENABLE_GET_ZCOPY', 'unset')} before the agents, median / p90 of "
        f"{args.iters} after 3 warm-up"
    )
    print(
        f"{'decode engine':<14}{'prefill engine':<16}{'both poll from':<16}{'median ms':>10}{'p90 ms':>9}"
    )
    cases = [
        ("idle", "idle", "asyncio"),
        ("eager", "idle", "asyncio"),
        ("idle", "eager", "asyncio"),
        ("eager", "eager", "asyncio"),
        ("graphs", "graphs", "asyncio"),
        ("eager", "eager", "a thread"),
    ]
    for decode_profile, prefill_profile, poller in cases:
        conn.send_bytes(
            f"{prefill_profile}:{'thread' if poller == 'a thread' else 'asyncio'}".encode()
        )
        conn.recv_bytes()
        engine = _with_engine(decode_profile)
        if poller == "asyncio":
            samples = asyncio.run(pull_loop(transceiver, block_ids, args.iters + 3))[3:]
        else:
            box = {}
            worker = threading.Thread(
                target=lambda: box.update(s=thread_pull(transceiver, block_ids, args.iters + 3))
            )
            worker.start()
            worker.join()
            samples = box["s"][3:]
        if engine is not None:
            engine.stopped = True
            engine.join()
        ms = sorted(s * 1e3 for s in samples)
        print(
            f"{decode_profile:<14}{prefill_profile:<16}{poller:<16}{statistics.median(ms):>10.3f}"
            f"{ms[int(0.9 * (len(ms) - 1))]:>9.3f}"
        )
    conn.send_bytes(b"stop")
    prefill.join(30)
    transceiver.close()


if __name__ == "__main__":
    main()
