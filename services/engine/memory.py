"""Memory an engine frees, handed back: glibc's arenas trimmed after a release or a weight swap,
and the IPC handles a weight update opened let go of. Runs in the process that holds the
engine (the worker's, or its engine core process)."""

from __future__ import annotations

import ctypes
import ctypes.util
import gc

import torch


def _load_libc():
    name = ctypes.util.find_library("c")
    try:
        libc = ctypes.CDLL(name) if name else None
    except OSError:
        return None
    return libc if libc is not None and hasattr(libc, "malloc_trim") else None


_LIBC = _load_libc()


def return_freed_memory() -> None:
    """Hands memory freed by a release back to the OS. glibc keeps what a thread other than the
    main one frees (the engine thread frees the weights and the pool) in that thread's arena:
    without a trim a worker reports 0 bytes released while its RSS stays, and grows with every
    release/resume cycle."""
    if _LIBC is not None:
        _LIBC.malloc_trim(0)


def collect_ipc() -> None:
    """Lets go of the trainer's memory the handles of a weight update opened."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.ipc_collect()
