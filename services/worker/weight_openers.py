"""The in-place weight updates an engine takes (update_weights by IPC handles or over NIXL):
kind -> open(payload, model, device), the update checked before anything is written. The
payloads are plain data (a NIXL descriptor's bytes, IPC handles by device), so the engine core
opens them wherever it runs."""

from __future__ import annotations

from tandem.v1 import llm_pb2
from tandem.worker.ipc_weights import weight_update
from tandem.worker.nixl_weights import nixl_weight_update


def _nixl(payload: bytes, model, device):
    weights = llm_pb2.NixlWeights()
    weights.ParseFromString(payload)
    return nixl_weight_update(weights, model, device)


WEIGHT_OPENERS = {"ipc": weight_update, "nixl": _nixl}
