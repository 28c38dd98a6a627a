"""The trainer's side of update_weights by IPC handles (TensorRT-LLM's format), for an RL loop
that syncs its weights into a tandem cluster without the disk:

    from tandem.rl import ipc_handles

    handles = ipc_handles(model.named_parameters())      # {device UUID: base64 of the pickle}
    await llm.pause_generation()
    await llm.update_weights(handles)                     # one or more buckets ...
    await llm.update_weights(None)                        # ... then finalize
    await llm.resume_generation()

Needs torch (the client, tandem.client, does not: this is the trainer's side). CUDA tensors travel as CUDA IPC handles,
keyed by their GPU's UUID ("GPU-..."; the workers must share the GPU); CPU tensors as
shared-memory segments under torch's file_system sharing strategy (set here), keyed "CPU", for
workers on the same host. Keep the tensors alive and unchanged until update_weights returns.
"""

from __future__ import annotations

import base64
from collections.abc import Iterable


def ipc_handles(named_tensors: Iterable, device_uuid: str | None = None) -> dict[str, str]:
    """{device UUID: base64(pickle([(name, reduce_tensor(t)), ...]))} for (HF name, tensor)
    pairs, grouped by the tensors' devices (device_uuid: one key for all of them instead)."""
    from multiprocessing.reduction import ForkingPickler

    import torch
    import torch.multiprocessing as mp
    from torch.multiprocessing.reductions import reduce_tensor

    by_device: dict[str, list] = {}
    for name, tensor in named_tensors:
        tensor = tensor.detach()
        if tensor.is_cuda:
            key = "GPU-" + str(torch.cuda.get_device_properties(tensor.device.index or 0).uuid)
        else:
            if mp.get_sharing_strategy() != "file_system":
                mp.set_sharing_strategy("file_system")
            key = "CPU"
        by_device.setdefault(device_uuid or key, []).append((name, reduce_tensor(tensor)))
    return {
        key: base64.b64encode(bytes(ForkingPickler.dumps(items))).decode("ascii")
        for key, items in by_device.items()
    }
