"""Garbage-collector pauses, kept short: a full collection stops every thread of the process
(the engine thread with the event loop), for as long as it takes to scan every tracked object.

A worker holds ~350k objects once torch, grpc and the model are loaded (0.15 s per full
collection on the 2-core CPU machine, more with a large model's modules and captured graphs).
Those objects live as long as the process: after start-up they are frozen (gc.freeze), so
collections scan only what requests create (vLLM v1 and SGLang do the same). Pauses that are
still long are logged, so a stalled burst of requests can be told apart from other stalls.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger("tandem.gc")

# A collection longer than this is logged as a warning.
LONG_PAUSE_S = 0.05


def freeze_startup_heap(what: str) -> None:
    """Collects once, then moves every object alive now out of the collector's sight."""
    started = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info(
        "%s: %d objects frozen out of garbage collection (a full collection took %.0f ms)",
        what,
        gc.get_freeze_count(),
        (time.perf_counter() - started) * 1e3,
    )


def unfreeze_heap() -> None:
    """Back in the collector's sight before the process exits: frozen objects are never collected,
    and extension modules that count their live objects at exit (nanobind's, in Triton) report
    every one still alive as a leak."""
    gc.callbacks[:] = [
        c for c in gc.callbacks if not isinstance(c, PauseWatch)
    ]  # pauses at exit hurt nobody
    gc.unfreeze()
    gc.collect()


class PauseWatch:
    """gc.callbacks hook that logs collections longer than LONG_PAUSE_S."""

    def __init__(self):
        self._started = 0.0
        self.num_long = 0

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.perf_counter()
            return
        pause = time.perf_counter() - self._started
        if pause >= LONG_PAUSE_S:
            self.num_long += 1
            log.warning(
                "garbage collection of generation %d paused the process %.0f ms (%d collected)",
                info.get("generation", -1),
                pause * 1e3,
                info.get("collected", 0),
            )


def watch_pauses() -> PauseWatch:
    watch = PauseWatch()
    gc.callbacks.append(watch)
    return watch
