"""The UCX settings a transceiver applies before NIXL creates its UCX context.

UCX's cuda_ipc transport turns its get-zcopy path off when it finds no NVLink between the GPUs
(one GPU; PCIe-only GPUs such as L40S), and a NIXL READ is a get: the KV of two processes on one
such host then goes as active messages over loopback TCP (208-302 ms for 128 MiB on one H100/H200,
against 1.2-1.4 ms over CUDA IPC; bench/RESULTS.md). tandem turns the path on for device pools.

An operator's value stands, whatever it is (`UCX_CUDA_IPC_ENABLE_GET_ZCOPY=auto` gives UCX's own
choice back). Host-memory pools get nothing: no cuda_ipc transport is loaded for them, and UCX
would warn of an unused variable.
"""

from __future__ import annotations

import logging
import os

log = logging.getLogger("tandem.kvtransfer.ucx")

CUDA_IPC_GET_ZCOPY = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"
# What tandem sets for device pools, unless the operator set the variable.
DEVICE_POOL_DEFAULTS = {CUDA_IPC_GET_ZCOPY: "y"}
# What this process set (a second transceiver, after a released and resumed pool, finds it set).
_applied: dict[str, str] = {}


def apply_defaults(memory_type: str) -> dict[str, str]:
    """Sets tandem's UCX defaults for a pool of memory_type ("DRAM" or "VRAM") in this process's
    environment, where the operator left them unset; returns what it set. UCX reads its
    environment when NIXL creates the agent's UCX context, so this runs before that."""
    if memory_type != "VRAM":
        return {}
    applied = {}
    for name, value in DEVICE_POOL_DEFAULTS.items():
        if name in _applied and _applied[name] == os.environ.get(name):
            continue  # ours, from an earlier transceiver of this process
        if name in os.environ:
            log.info(
                "%s=%s (set by the operator; tandem's default is %s)", name, os.environ[name], value
            )
            continue
        os.environ[name] = applied[name] = _applied[name] = value
    if applied:
        log.info(
            "KV transfer within a host over CUDA IPC: %s (set the variable to override, e.g. =auto for UCX's "
            "own choice)",
            " ".join(f"{name}={value}" for name, value in applied.items()),
        )
    return applied
