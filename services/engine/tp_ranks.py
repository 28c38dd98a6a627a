"""The processes of a tensor-parallel engine, seen from rank 0.

Rank 0 is the worker process: it owns the scheduler, the gRPC face and the sampler. Ranks
1..N-1 are child processes (tp_follower.py) that hold their share of the weights and KV, and
run each step rank 0 runs, in the same order, so their collectives meet.

The step plan travels through each follower's stdin pipe: a fixed header of int32 counts and
the step's packed int32 inputs (step_inputs.PackedStep), one write per follower per step; no
pickle. The pipe is also the followers' lifeline: when rank 0 exits, however it exits, the
kernel closes the pipe and a follower reading the next plan sees EOF and exits; a follower
blocked elsewhere (in a collective) notices its parent is gone from a watcher thread.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import struct
import subprocess
import sys
import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from tandem.engine.config import EngineConfig
from tandem.engine.kv_share import import_cuda, map_shared, shared_file
from tandem.engine.parallel import TensorParallel
from tandem.engine.step_inputs import PackedStep, packed_layout

log = logging.getLogger("tandem.tp")

STEP, STOP = 1, 2
# kind, num_tokens, num_rows, num_samples, num_pending, num_table_entries, graph_size (0: eager),
# max_query_len, max_seq_len, has_lora, num_sampled, num_int32 of the packed inputs
_HEADER = struct.Struct("<12i")
_STARTUP_TIMEOUT_S = 600.0
# Collectives run only inside steps, which every rank runs together; this bounds a rank stuck in one.
_COLLECTIVE_TIMEOUT = timedelta(minutes=10)


def encode_step(step: PackedStep) -> bytes:
    header = _HEADER.pack(
        STEP,
        *step.counts,
        step.graph_size or 0,
        step.max_query_len,
        step.max_seq_len,
        int(step.has_lora),
        len(step.sample_indices),
        step.host.numel(),
    )
    return header + step.host.numpy().tobytes()


def decode_header(data: bytes) -> tuple[int, tuple[int, ...]]:
    """(kind, the remaining header fields)."""
    kind, *fields = _HEADER.unpack(data)
    return kind, tuple(fields)


def decode_step(fields: tuple[int, ...], payload: bytes, host: torch.Tensor) -> PackedStep:
    """The PackedStep of a header's fields and its payload, copied into host (a reused int32 buffer)."""
    *counts, graph_size, max_query_len, max_seq_len, has_lora, num_sampled, num_ints = fields
    host = host[:num_ints]
    host.copy_(torch.frombuffer(bytearray(payload), dtype=torch.int32))
    layout = packed_layout(*counts)
    starts_at, num_starts = layout["query_start_loc"]
    lens_at, num_lens = layout["seq_lens"]
    return PackedStep(
        host,
        tuple(counts),
        max_query_len,
        max_seq_len,
        host[starts_at : starts_at + num_starts].tolist(),
        host[lens_at : lens_at + num_lens].tolist(),
        list(range(num_sampled)),
        graph_size or None,
        bool(has_lora),
    )


def header_size() -> int:
    return _HEADER.size


def rank_device(device: str, rank: int) -> str:
    """cuda:N -> rank r runs on cuda:N+r; cpu stays cpu."""
    if not device.startswith("cuda"):
        return device
    base = int(device.partition(":")[2] or 0)
    return f"cuda:{base + rank}"


def backend_for(device: str) -> str:
    return "nccl" if device.startswith("cuda") else "gloo"


def distributed_env() -> dict[str, str]:
    """What every rank's environment needs: NVLink multicast (NVLS) off unless the operator says otherwise."""
    env = dict(os.environ)
    env.setdefault("NCCL_NVLS_ENABLE", "0")
    return env


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def join_group(store: dist.TCPStore, rank: int, size: int, device: str) -> TensorParallel:
    """Joins the tensor-parallel process group (the process's default group)."""
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    dist.init_process_group(
        backend_for(device), store=store, rank=rank, world_size=size, timeout=_COLLECTIVE_TIMEOUT
    )
    return TensorParallel(rank, size, dist.group.WORLD)


class FollowerRanks:
    """Ranks 1..N-1 of rank 0's engine: started with it, fed each step's plan, stopped with it."""

    def __init__(self, config: EngineConfig):
        if dist.is_initialized():
            raise RuntimeError(
                "a tensor-parallel engine already runs in this process (one per process)"
            )
        size = config.tensor_parallel_size
        if config.device.startswith("cuda") and torch.cuda.device_count() < size + int(
            config.device.partition(":")[2] or 0
        ):
            raise ValueError(
                f"tensor_parallel_size={size} on {config.device} needs GPUs {config.device} to "
                f"+{size - 1}; this host has {torch.cuda.device_count()}"
            )
        self.size = size
        self._closing = False
        port = _free_port()
        self.store = dist.TCPStore(
            "127.0.0.1",
            port,
            size,
            is_master=True,
            wait_for_workers=False,
            timeout=timedelta(seconds=_STARTUP_TIMEOUT_S),
        )
        config_json = json.dumps(dataclasses.asdict(config))
        # Where CPU followers put their KV pools for rank 0 to map (kv_share.py).
        self.share_prefix = f"/dev/shm/tandem-kv-{os.getpid()}-{port}"
        self.processes = [
            subprocess.Popen(
                [
                    sys.executable,
                    "-m",
                    "tandem.engine.tp_follower",
                    "--rank",
                    str(rank),
                    "--port",
                    str(port),
                    "--config",
                    config_json,
                    "--kv-share",
                    self.share_prefix,
                ],
                stdin=subprocess.PIPE,
                env=distributed_env(),
            )
            for rank in range(1, size)
        ]
        try:
            self._wait_for("joined")
            self.tp = join_group(self.store, 0, size, rank_device(config.device, 0))
        except BaseException:
            self.close()
            raise
        self._monitor = threading.Thread(
            target=self._watch_followers, name="tp-monitor", daemon=True
        )
        self._monitor.start()

    def _wait_for(self, stage: str) -> None:
        """Waits until every follower has set `stage/<rank>` in the store, failing fast when one exits."""
        deadline = time.monotonic() + _STARTUP_TIMEOUT_S
        for rank, process in enumerate(self.processes, start=1):
            while True:
                if self.store.check([f"{stage}/{rank}"]):
                    break
                if process.poll() is not None:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} exited with code {process.returncode} "
                        f"before it {stage} (see its log above)"
                    )
                if time.monotonic() > deadline:
                    raise RuntimeError(
                        f"tensor-parallel rank {rank} has not {stage} after {_STARTUP_TIMEOUT_S} s"
                    )
                time.sleep(0.05)

    def wait_loaded(self) -> None:
        """Returns once every follower holds its weights and KV pool (after rank 0 built its own)."""
        self._wait_for("loaded")

    def map_pools(
        self, shape: tuple[int, ...], dtype: torch.dtype, device: torch.device
    ) -> list[torch.Tensor]:
        """Rank 0's views of the followers' KV pools (after wait_loaded), rank 1 first."""
        if device.type == "cuda":
            return [
                import_cuda(self.store.get(f"kv/{rank}").decode(), shape, dtype)
                for rank in range(1, self.size)
            ]
        return [
            map_shared(shape, dtype, shared_file(self.share_prefix, rank))
            for rank in range(1, self.size)
        ]

    def _watch_followers(self) -> None:
        """A rank that dies leaves the others waiting in a collective forever: end the worker too
        (its supervisor restarts it whole)."""
        while not self._closing:
            for rank, process in enumerate(self.processes, start=1):
                if process.poll() is not None and not self._closing:
                    log.critical(
                        "tensor-parallel rank %d exited (code %s); the worker cannot go on without it",
                        rank,
                        process.returncode,
                    )
                    os._exit(70)
            time.sleep(0.2)

    def send(self, data: bytes) -> None:
        for process in self.processes:
            fd = process.stdin.fileno()
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]

    def send_step(self, step: PackedStep) -> None:
        self.send(encode_step(step))

    def close(self, timeout_s: float = 10.0) -> None:
        """Tells the followers to stop, waits for them (killing the ones that do not go), leaves the group."""
        if self._closing:
            return
        self._closing = True
        for process in self.processes:
            try:
                process.stdin.write(_HEADER.pack(STOP, *[0] * 11))
                process.stdin.close()
            except OSError:
                pass  # already gone
        deadline = time.monotonic() + timeout_s
        for process in self.processes:
            try:
                process.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("tensor-parallel rank (pid %d) did not stop; killing it", process.pid)
                process.kill()
                process.wait()
        if dist.is_initialized():
            dist.destroy_process_group()
