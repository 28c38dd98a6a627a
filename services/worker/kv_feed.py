"""The worker's KV block feed for the router's KV index (Worker.SubscribeKvBlocks): the set of
block hashes in the prefix cache, kept on the loop from the engine's KV events, and one pending
change set per subscriber. A subscriber's pending changes are coalesced (a block stored then
removed before it read them is one removal), and a subscriber that lags by more than
max_pending blocks gets a fresh snapshot instead: the feed never buffers without bound."""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.v1 import worker_pb2


class _Subscription:
    def __init__(self):
        # hash -> cached (True: stored, False: removed); the last change wins.
        self.pending: dict[int, bool] = {}
        self.needs_snapshot = True
        self.new_fingerprints = False
        self.ready = asyncio.Event()
        self.ready.set()


class KvBlockFeed:
    def __init__(
        self,
        tokens_per_block: int,
        fingerprint_of: Callable[[int], str | None] = lambda _: None,
        max_pending: int = 65536,
    ):
        self.tokens_per_block = tokens_per_block
        self.max_pending = max_pending
        self._fingerprint_of = fingerprint_of
        self.cached: set[int] = set()
        # lora_int_id -> fingerprint of the adapters whose blocks were stored here.
        self.lora_fingerprints: dict[int, str] = {}
        self._subscriptions: set[_Subscription] = set()

    def observe(self, events: list[dict]) -> None:
        """On the loop: KV events in TensorRT-LLM's shape ({event_id, data, window_size})."""
        changes: dict[int, bool] = {}
        new_fingerprints = False
        for event in events:
            data = event["data"]
            if data["type"] == "stored":
                for block in data["blocks"]:
                    changes[block["block_hash"]] = True
                    lora_id = block.get("lora_id")
                    if lora_id is not None and lora_id not in self.lora_fingerprints:
                        fingerprint = self._fingerprint_of(lora_id)
                        if fingerprint is not None:
                            self.lora_fingerprints[lora_id] = fingerprint
                            new_fingerprints = True
            elif data["type"] == "removed":
                for h in data["block_hashes"]:
                    changes[h] = False
        if not changes:
            return
        for h, stored in changes.items():
            if stored:
                self.cached.add(h)
            else:
                self.cached.discard(h)
        for sub in self._subscriptions:
            if not sub.needs_snapshot:
                sub.pending.update(changes)
                if len(sub.pending) > self.max_pending:
                    sub.needs_snapshot = True
                    sub.pending.clear()
            sub.new_fingerprints |= new_fingerprints
            sub.ready.set()

    def _update(self, sub: _Subscription) -> worker_pb2.KvBlocksUpdate:
        update = worker_pb2.KvBlocksUpdate(tokens_per_block=self.tokens_per_block)
        if sub.needs_snapshot or sub.new_fingerprints:
            update.lora_fingerprints.update(self.lora_fingerprints)
        if sub.needs_snapshot:
            update.snapshot = True
            update.stored.extend(self.cached)
        else:
            update.stored.extend(h for h, stored in sub.pending.items() if stored)
            update.removed.extend(h for h, stored in sub.pending.items() if not stored)
        sub.pending.clear()
        sub.needs_snapshot = sub.new_fingerprints = False
        sub.ready.clear()
        return update

    async def subscribe(self):
        """The updates for one subscriber, a snapshot first, until the caller stops iterating."""
        sub = _Subscription()
        self._subscriptions.add(sub)
        try:
            while True:
                await sub.ready.wait()
                yield self._update(sub)
        finally:
            self._subscriptions.discard(sub)
