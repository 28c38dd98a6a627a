"""Several async streams read as one."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import TypeVar

T = TypeVar("T")
_END = object()


def closing(stream):
    """`async with closing(stream) as items: async for item in items: ...`. Python does not close
    an async generator that its consumer leaves early (a return on the last message, or the
    consumer closed in turn): the garbage collector does, and on an asyncio loop each one costs a
    task and a wake-up of the loop (call_soon_threadsafe), one per layer of a request's stream,
    and its finally blocks (load accounting, the worker call's cleanup) run only then. Closed
    here, a whole chain of layers closes at once. Anything without aclose (a grpc call) passes."""
    return (
        contextlib.aclosing(stream) if hasattr(stream, "aclose") else contextlib.nullcontext(stream)
    )


async def merge(streams: list[AsyncIterator[T]]) -> AsyncIterator[tuple[int, T]]:
    """(index of the stream, item) as items arrive from any of streams, until all have ended.
    The first stream that fails fails the merge; leaving it early cancels the rest."""
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(index: int, stream: AsyncIterator[T]) -> None:
        try:
            async for item in stream:
                await queue.put((index, item))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            await queue.put((index, exc))
        finally:
            await queue.put((index, _END))

    tasks = [asyncio.create_task(pump(i, s)) for i, s in enumerate(streams)]
    try:
        num_ended = 0
        while num_ended < len(tasks):
            index, item = await queue.get()
            if item is _END:
                num_ended += 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield index, item
    finally:
        for task in tasks:
            task.cancel()
