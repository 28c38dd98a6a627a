"""Fire-and-forget tasks that stay referenced until they end: the event loop keeps only weak
references to tasks, so one nobody holds can be collected in the middle of its work."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Coroutine

log = logging.getLogger("tandem.background")

_running: set[asyncio.Task] = set()


def spawn(coro: Coroutine) -> asyncio.Task:
    task = asyncio.ensure_future(coro)
    _running.add(task)
    task.add_done_callback(_done)
    return task


def _done(task: asyncio.Task) -> None:
    _running.discard(task)
    if not task.cancelled() and task.exception() is not None:
        log.warning("background task failed: %r", task.exception())
