"""Which device a worker serves from, as the trainer's update_weights handles name it."""

from __future__ import annotations

import torch

# The device key of a CPU worker (a GPU's is "GPU-" + its UUID, TensorRT-LLM's get_device_uuid).
CPU_DEVICE_UUID = "CPU"


def device_uuid(device: torch.device) -> str:
    """This worker's key in the handles (collective_rpc('get_worker_state') reports it)."""
    if device.type == "cuda":
        return "GPU-" + str(torch.cuda.get_device_properties(device.index or 0).uuid)
    return CPU_DEVICE_UUID
