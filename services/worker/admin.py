"""A worker's admin calls: release / resume memory by tag, update_weights, collective_rpc.

Each call either applies whole or not at all: validation and loading happen before
anything changes, and the swap itself runs on the engine thread between steps.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import TYPE_CHECKING

from google.protobuf import json_format, struct_pb2

from tandem.common.errors import unavailable
from tandem.engine.checkpoints import checkpoint_fingerprint
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import (
    CheckIdle,
    CopyWeights,
    ReleaseMemory,
    ResumeMemory,
    WeightsChecksum,
)
from tandem.worker.ipc_weights import HandleError

if TYPE_CHECKING:
    from tandem.worker.runtime import WorkerRuntime

# collective_rpc runs only these, with JSON arguments (never pickle).
COLLECTIVE_RPC_METHODS = ("get_worker_state", "weights_checksum", "kv_cache_capacity")


# TensorRT-LLM's memory tags (tensorrt_llm/_torch/virtual_memory.py, ExecutorMemoryType) and what
# each is in tandem: its weights ("model"), its KV pool ("kv_cache"), or memory tandem does not
# hold apart (no drafter, sampler state or extra executor buffers): released and resumed as a
# no-op, said so in the answer.
TAG_MEMORY = {
    "model": "model",
    "model_weights": "model",
    "kv_cache": "kv_cache",
    "sampler": None,
    "drafter": None,
    "guided_decoder": None,
    "spec_resource_manager": None,
    "model_extra": None,
    "executor_extra": None,
    "draft_model": None,
    "draft_model_weights": None,
    "_no_capture_init_kv_cache": None,
    "_no_capture_init_extra_resources": None,
}


def check_tags(tags) -> tuple[list[str], list[str]]:
    """(tandem's tags to act on, the valid tags that are no-ops here) for TensorRT-LLM's tags."""
    tags = list(tags)
    unknown = sorted(set(tags) - set(TAG_MEMORY))
    if not tags or unknown:
        raise ValueError(
            f"tags must be a non-empty list of TensorRT-LLM's memory tags {list(TAG_MEMORY)}; "
            f"unknown: {unknown or tags}"
        )
    memory = [m for m in LLMEngine.MEMORY_TAGS if m in {TAG_MEMORY[t] for t in tags}]
    return memory, [t for t in tags if TAG_MEMORY[t] is None]


def _noops(noops: list[str]) -> str:
    return f"; {noops}: nothing held apart in tandem, no-op" if noops else ""


async def release(rt: WorkerRuntime, tags) -> str:
    tags, noops = check_tags(tags)
    if not tags:
        return f"{rt.worker_id}: released nothing{_noops(noops)}"
    await rt.core.call(CheckIdle("release"))  # refuses while requests run, changes nothing
    stopped = "kv_cache" in tags and rt.transceiver is not None
    if stopped:
        rt.stop_transceiver()  # deregister the pool before its memory goes
    try:
        await rt.core.call(ReleaseMemory(tags))
    except BaseException:
        if stopped:  # a request slipped in: put things back as they were
            await rt.open_transceiver()
        raise
    await rt.core.trim_memory()
    return f"{rt.worker_id}: released {tags}{_noops(noops)}"


async def resume(rt: WorkerRuntime, tags) -> str:
    tags, noops = check_tags(tags)
    if not tags:
        return f"{rt.worker_id}: resumed nothing{_noops(noops)}"
    await rt.core.call(ResumeMemory(tags))
    if "kv_cache" in tags and rt.config.has_transceiver and rt.transceiver is None:
        await rt.open_transceiver()
    await rt.core.trim_memory()  # what loading the weights used on the way
    return f"{rt.worker_id}: resumed {tags}{_noops(noops)}"


async def update_weights(rt: WorkerRuntime, request) -> str:
    source = request.WhichOneof("source")
    if source in ("ipc_handles", "nixl_weights", "finalize"):
        return await _update_weights_by_handles(rt, request)
    if source != "checkpoint_path" or not request.checkpoint_path:
        raise ValueError(
            "update_weights needs IPC handles (device UUID -> handles), NIXL weights "
            "(tandem.rl.NixlWeightSource), None to finalize, or checkpoint_path (a directory "
            "with config.json and *.safetensors)"
        )
    path = request.checkpoint_path
    if not (Path(path) / "config.json").is_file():
        raise ValueError(
            f"checkpoint_path {path!r} is not a checkpoint directory (no config.json) on this worker"
        )
    if "model" in rt.core.released_tags:
        raise unavailable(
            "the model weights are released; call resume(['model']) before update_weights"
        )
    await rt.core.call(CheckIdle("update_weights", unless_held=True))  # fail before a slow load
    fingerprint = await asyncio.to_thread(checkpoint_fingerprint, path)
    weights = await rt.core.load_weights(path, fingerprint)
    await rt.core.trim_memory()  # the old weights
    return f"{rt.worker_id}: weights from {path} (version {weights.version})"


async def _update_weights_by_handles(rt: WorkerRuntime, request) -> str:
    """A bucket of weights by IPC handles or NIXL written in place, or (finalize) the update
    closed."""
    if "model" in rt.core.released_tags:
        raise unavailable(
            "the model weights are released; call resume(['model']) before update_weights"
        )
    if request.WhichOneof("source") == "finalize":
        weights = await rt.core.call(CopyWeights([], finalize=True))
        await rt.core.trim_memory(ipc=True)
        return f"{rt.worker_id}: weights finalized (version {weights.version})"
    await rt.core.call(
        CheckIdle("update_weights", unless_held=True)
    )  # fail before the handles are opened
    by_nixl = request.WhichOneof("source") == "nixl_weights"
    try:
        if by_nixl:
            await rt.core.write_weights("nixl", request.nixl_weights.SerializeToString())
        else:
            await rt.core.write_weights("ipc", dict(request.ipc_handles.handles))
    except HandleError as exc:
        raise ValueError(str(exc)) from None
    finally:
        await rt.core.trim_memory(ipc=True)
    how = "NIXL" if by_nixl else "IPC handles"
    return f"{rt.worker_id}: weights written from {how} (finalize with update_weights(None))"


async def collective_rpc(
    rt: WorkerRuntime, method: str, args: list, kwargs: dict
) -> struct_pb2.Value:
    if method not in COLLECTIVE_RPC_METHODS:
        raise ValueError(
            f"collective_rpc method {method!r} is not allowed; allowed: {list(COLLECTIVE_RPC_METHODS)}"
        )
    if args or kwargs:
        raise ValueError(f"collective_rpc method {method!r} takes no arguments")
    if method == "get_worker_state":
        state = await rt.worker_state()
        result = json_format.MessageToDict(state, preserving_proto_field_name=True)
        result["role"] = rt.role.label
        # The key of this worker's handles in update_weights (TensorRT-LLM's device UUID).
        result["device_uuid"] = rt.core.facts.device_uuid
    elif method == "weights_checksum":
        result = await rt.core.call(WeightsChecksum())
    else:
        capacity = await rt.kv_capacity()
        result = json_format.MessageToDict(capacity, preserving_proto_field_name=True)
    value = struct_pb2.Value()
    json_format.ParseDict({"worker_id": rt.worker_id, "result": result}, value)
    return value
