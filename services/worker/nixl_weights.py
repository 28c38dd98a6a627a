"""update_weights from tensors a trainer registered with NIXL (llm.proto NixlWeights): the worker
checks every tensor against the served model first (names, shapes, floating dtypes: nothing is
read or written for an update that does not fit), then READs them all in one NIXL transfer into
buffers of its own and hands those to the engine thread to write in place, as a bucket of IPC
handles is. The trainer may be on another host: the READ goes where its agent's metadata says.

Runs off the engine thread (asyncio.to_thread): one short-lived agent per update, released at
the end whatever happens.
"""

from __future__ import annotations

import itertools
import os
import time

import numpy as np
import torch

from tandem.kvtransfer.transfer import NIXL_ERRORS
from tandem.kvtransfer.ucx_env import apply_defaults as apply_ucx_defaults
from tandem.worker.ipc_weights import HandleError, UpdateTargets, WeightUpdate

READ_TIMEOUT_S = 120.0
MEMORY_TYPES = ("DRAM", "VRAM")
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_agent_ids = itertools.count()


def _planned(weights, model) -> list[tuple[tuple[str, int, int], object, torch.dtype]]:
    """(target, tensor description, dtype) of each tensor the engine holds, or HandleError."""
    if weights.memory_type not in MEMORY_TYPES:
        raise HandleError(
            f"nixl_weights.memory_type must be one of {list(MEMORY_TYPES)}, "
            f"got {weights.memory_type!r}"
        )
    if not weights.agent_name or not weights.agent_metadata:
        raise HandleError("nixl_weights needs the trainer's agent_name and agent_metadata")
    targets = UpdateTargets(model)
    planned = []
    for tensor in weights.tensors:
        dtype = _DTYPES.get(tensor.dtype)
        if dtype is None:
            raise HandleError(
                f"{tensor.name}: dtype {tensor.dtype!r} is not one of {list(_DTYPES)}"
            )
        num_bytes = int(np.prod(tensor.shape, dtype=np.int64)) * dtype.itemsize
        if tensor.num_bytes != num_bytes or not tensor.address:
            raise HandleError(
                f"{tensor.name}: {tensor.num_bytes} bytes at address {tensor.address:#x}; its "
                f"shape {list(tensor.shape)} of {tensor.dtype} is {num_bytes} bytes"
            )
        target = targets.locate(tensor.name)
        if target is None:
            continue
        targets.check(tensor.name, target, tuple(tensor.shape), dtype)
        planned.append((target, tensor, dtype))
    targets.require_known()
    return planned


def nixl_weight_update(weights, model, device: torch.device) -> WeightUpdate:
    """The trainer's tensors READ over NIXL into this worker's memory, checked first."""
    from nixl._api import nixl_agent, nixl_agent_config

    planned = _planned(weights, model)
    buffers = [torch.empty(tuple(t.shape), dtype=dtype, device=device) for _, t, dtype in planned]
    if not buffers:
        return WeightUpdate([], 0)
    apply_ucx_defaults(weights.memory_type)  # as the KV transceiver: CUDA IPC gets on one host
    agent = nixl_agent(
        f"weights-reader-{os.getpid()}-{next(_agent_ids)}",
        nixl_agent_config(enable_prog_thread=True, backends=["UCX"]),
    )
    registration = handle = None
    added = False
    peer = weights.agent_name
    try:
        registration = agent.register_memory(buffers)
        try:
            loaded = agent.add_remote_agent(weights.agent_metadata)
        except NIXL_ERRORS as exc:
            raise HandleError(f"NIXL refused the trainer agent's metadata: {exc}") from None
        loaded = loaded.decode() if isinstance(loaded, bytes) else loaded
        if loaded != peer:
            agent.remove_remote_agent(loaded)
            raise HandleError(f"nixl_weights names agent {peer!r}; its metadata is {loaded!r}")
        added = True
        remote = np.array(
            [[t.address, t.num_bytes, t.device_id] for _, t, _ in planned], dtype=np.uint64
        )
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(buffers),
            agent.get_xfer_descs(remote, weights.memory_type),
            peer,
            b"",
        )
        state = agent.transfer(handle)
        deadline = time.monotonic() + READ_TIMEOUT_S
        while state == "PROC" and time.monotonic() < deadline:
            time.sleep(1e-4)
            state = agent.check_xfer_state(handle)
        if state != "DONE":
            raise HandleError(
                f"reading {len(buffers)} tensors from the trainer's agent {peer!r} over NIXL "
                f"ended in state {state} (is it alive, its tensors still registered?)"
            )
    except NIXL_ERRORS as exc:
        raise HandleError(f"reading the weights from {peer!r} over NIXL failed: {exc}") from None
    finally:
        if handle is not None:
            agent.release_xfer_handle(handle)
        if registration is not None:
            agent.deregister_memory(registration)
        if added:
            agent.remove_remote_agent(peer)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    updates = [(*target, buffer) for (target, _, _), buffer in zip(planned, buffers)]
    return WeightUpdate(updates, sum(b.numel() * b.element_size() for b in buffers))
