"""The event loop a tandem server runs on: asyncio's own, or uvloop when TANDEM_EVENT_LOOP=uvloop
asks for it and it is installed. uvloop costs 10-20% less CPU per grpc.aio completion on the CPU
bench, but on the H200 serving bench a burst of 32 or 64 new streams through a uvloop router
stalled 1.4-1.7 s before its first tokens in 2 of 6 bursts (none of 4 on asyncio's loop;
bench/RESULTS.md), so it is not the default."""

from __future__ import annotations

import asyncio
import logging
import os
from collections.abc import Awaitable
from typing import TypeVar

log = logging.getLogger("tandem.loop")

T = TypeVar("T")

# TANDEM_EVENT_LOOP: "asyncio" (the default) or "uvloop" (where importable; asyncio's otherwise).
EVENT_LOOP_ENV = "TANDEM_EVENT_LOOP"


def loop_name() -> str:
    """The loop run() will use."""
    wanted = os.environ.get(EVENT_LOOP_ENV, "asyncio").strip().lower() or "asyncio"
    if wanted not in ("uvloop", "asyncio"):
        raise ValueError(f"{EVENT_LOOP_ENV} must be 'uvloop' or 'asyncio', got {wanted!r}")
    if wanted == "uvloop":
        try:
            import uvloop  # noqa: F401
        except ImportError:
            return "asyncio"
    return wanted


def run(main: Awaitable[T]) -> T:
    """asyncio.run(main) on the loop loop_name() picks."""
    name = loop_name()
    log.debug("event loop: %s", name)
    if name == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(main)
    return asyncio.run(main)
