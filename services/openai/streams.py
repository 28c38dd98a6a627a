"""Streams of generation updates as plain snapshots, merged across requests.

A streaming RequestOutput yields the same object after each update, so each update is copied
into a Snapshot before anything else runs. Several requests (one per prompt) stream at once
through a queue; the first update of each is awaited before the HTTP response starts, so a
request the router refuses becomes an HTTP error rather than a broken event stream.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Delta:
    index: int
    text: str
    token_ids: list[int]
    logprobs: list[dict[int, Any]]
    finish_reason: str | None
    # The stop string or stop token id that ended the sequence (vLLM's stop_reason).
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class Snapshot:
    request: int  # which of the merged requests (the prompt's position)
    deltas: list[Delta]
    prompt_token_ids: list[int] = field(default_factory=list)


async def snapshots(request: int, result) -> AsyncIterator[Snapshot]:
    async for out in result:
        yield Snapshot(
            request,
            [
                Delta(
                    o.index,
                    o.text_diff,
                    list(o.token_ids_diff),
                    list(o.logprobs_diff),
                    o.finish_reason,
                    o.stop_reason if o.finish_reason else None,
                )
                for o in out.outputs
            ],
            list(out.prompt_token_ids),
        )


class MergedStream:
    """Updates of several streaming requests in arrival order. Use open() first, then iterate;
    close() (or leaving the iteration) cancels whatever still runs, which aborts it server-side."""

    _END = object()

    def __init__(self, results: list):
        self._streams = [snapshots(i, r) for i, r in enumerate(results)]
        self._queue: asyncio.Queue = asyncio.Queue()
        self._firsts: list[Snapshot] = []
        self._tasks: list[asyncio.Task] = []

    async def open(self) -> None:
        """Waits for every request's first update; raises the first request's error, if any."""
        firsts = [asyncio.ensure_future(anext(s)) for s in self._streams]
        try:
            self._firsts = list(await asyncio.gather(*firsts))
        except BaseException:
            for first in firsts:
                first.cancel()
            await asyncio.gather(*firsts, return_exceptions=True)
            await self.close()
            raise
        self._tasks = [asyncio.create_task(self._pump(s)) for s in self._streams]

    async def _pump(self, stream: AsyncIterator[Snapshot]) -> None:
        try:
            async for snapshot in stream:
                await self._queue.put(snapshot)
        except Exception as exc:  # noqa: BLE001 - handed to the reader
            await self._queue.put(exc)
        finally:
            await self._queue.put(self._END)

    async def __aiter__(self) -> AsyncIterator[Snapshot]:
        try:
            for snapshot in self._firsts:
                yield snapshot
            running = len(self._tasks)
            while running:
                item = await self._queue.get()
                if item is self._END:
                    running -= 1
                elif isinstance(item, Exception):
                    raise item
                else:
                    yield item
        finally:
            await self.close()

    async def close(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for stream in self._streams:
            await stream.aclose()
