"""The event loop a tandem server runs on: uvloop when it is installed (a cheaper loop per gRPC
completion: grpc.aio wakes the loop once per finished operation, two per relayed message),
asyncio's own otherwise or when TANDEM_EVENT_LOOP=asyncio asks for it."""
from __future__ import annotations

import asyncio
import logging
import os
from typing import Awaitable, TypeVar

log = logging.getLogger("tandem.loop")

T = TypeVar("T")

# TANDEM_EVENT_LOOP: "uvloop" (the default, where importable) or "asyncio".
EVENT_LOOP_ENV = "TANDEM_EVENT_LOOP"


def loop_name() -> str:
    """The loop run() will use."""
    wanted = os.environ.get(EVENT_LOOP_ENV, "uvloop").strip().lower() or "uvloop"
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
