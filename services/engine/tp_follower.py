"""A tensor-parallel follower rank: `python -m tandem.engine.tp_follower --rank R --port P --config JSON`.

Started by rank 0 (tp_ranks.FollowerRanks). It joins the process group, loads its share of the
model and its KV pool, then runs every step plan that arrives on stdin until STOP or EOF.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

from tandem.engine.config import EngineConfig
from tandem.engine.kv_share import export_cuda, shared_file
from tandem.engine.model_runner import ModelRunner
from tandem.engine.tp_ranks import (
    STEP,
    decode_header,
    decode_step,
    header_size,
    join_group,
    rank_device,
)

log = logging.getLogger("tandem.tp_follower")


def _read_exactly(fd: int, size: int) -> bytes | None:
    """size bytes from fd; None at EOF (rank 0 is gone)."""
    chunks, remaining = [], size
    while remaining:
        chunk = os.read(fd, remaining)
        if not chunk:
            return None
        chunks.append(chunk)
        remaining -= len(chunk)
    return b"".join(chunks)


def _watch_parent(parent_pid: int) -> None:
    """Exits the process once rank 0 is gone, even while the main thread waits in a collective
    that will never complete."""
    while os.getppid() == parent_pid:
        time.sleep(0.5)
    os._exit(0)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--config", required=True, help="the worker's EngineConfig as JSON")
    parser.add_argument(
        "--kv-share", required=True, help="path prefix of the CPU KV pool files rank 0 maps"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.INFO, format=f"%(asctime)s tp-rank{args.rank} %(levelname)s %(message)s"
    )
    threading.Thread(
        target=_watch_parent, args=(os.getppid(),), name="watch-parent", daemon=True
    ).start()

    config = EngineConfig(**json.loads(args.config))
    device = rank_device(config.device, args.rank)
    store = dist.TCPStore(
        "127.0.0.1",
        args.port,
        config.tensor_parallel_size,
        is_master=False,
        timeout=timedelta(seconds=600),
    )
    store.set(f"joined/{args.rank}", "1")
    tp = join_group(store, args.rank, config.tensor_parallel_size, device)
    is_cpu = not device.startswith("cuda")
    runner = ModelRunner(
        EngineConfig(**{**json.loads(args.config), "device": device}),
        tp=tp,
        kv_share_path=shared_file(args.kv_share, args.rank) if is_cpu else None,
    )
    if not is_cpu:
        store.set(f"kv/{args.rank}", export_cuda(runner.kv_cache))
    store.set(f"loaded/{args.rank}", "1")

    stdin = sys.stdin.fileno()
    while True:
        header = _read_exactly(stdin, header_size())
        if header is None:
            break
        kind, fields = decode_header(header)
        if kind != STEP:
            break
        payload = _read_exactly(stdin, 4 * fields[-1])
        if payload is None:
            break
        runner.follow(decode_step(fields, payload, runner.inputs.host_buffer()))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
