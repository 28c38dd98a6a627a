"""The router's KV index: which worker holds which KV block, by the engine's chain hashes
(common/kv_hash.py), fed by each worker's SubscribeKvBlocks stream (a snapshot, then stored and
removed blocks). As Dynamo's KvIndexer, it also records where the router has just sent a
prompt (its blocks will be stored there within moments) for a while, so a burst of requests
sharing a prefix lands together before the first one's KV events arrive.

A request's overlap with a worker is the number of leading blocks of its prompt the worker
holds: a chain hash names the whole prefix up to its block, so the walk stops at the first
block a worker lacks."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from tandem.common.kv_hash import prefix_hashes
from tandem.v1 import worker_pb2

# Seconds a predicted placement (the router sent the prompt there) counts as cached before the
# worker's own events confirm it.
PREDICTION_TTL_S = 10.0
# Predicted blocks kept per worker at most (the oldest go first).
MAX_PREDICTED_BLOCKS = 1 << 16


@dataclass
class _WorkerBlocks:
    cached: set[int] = field(default_factory=set)
    # hash -> monotonic time the prediction expires; insertion order is expiry order.
    predicted: dict[int, float] = field(default_factory=dict)
    lora_fingerprints: dict[int, str] = field(default_factory=dict)


class KvIndex:
    def __init__(self, prediction_ttl_s: float = PREDICTION_TTL_S):
        self.prediction_ttl_s = prediction_ttl_s
        self.block_size: int | None = None
        self._workers: dict[str, _WorkerBlocks] = {}
        # hash -> addresses whose cache holds it (confirmed by their events).
        self._holders: dict[int, set[str]] = {}

    def apply(self, address: str, update: worker_pb2.KvBlocksUpdate) -> None:
        """One message of a worker's SubscribeKvBlocks stream."""
        if update.tokens_per_block:
            self.block_size = update.tokens_per_block
        if update.snapshot:
            self.forget(address)
        blocks = self._workers.setdefault(address, _WorkerBlocks())
        blocks.lora_fingerprints.update(update.lora_fingerprints)
        for h in update.stored:
            blocks.cached.add(h)
            blocks.predicted.pop(h, None)
            self._holders.setdefault(h, set()).add(address)
        for h in update.removed:
            blocks.cached.discard(h)
            blocks.predicted.pop(h, None)
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._holders[h]

    def forget(self, address: str) -> None:
        """Drops all the index knows of a worker (it left, or its feed restarts with a snapshot)."""
        blocks = self._workers.pop(address, None)
        if blocks is None:
            return
        for h in blocks.cached:
            holders = self._holders.get(h)
            if holders is not None:
                holders.discard(address)
                if not holders:
                    del self._holders[h]

    def num_blocks(self, address: str) -> int:
        blocks = self._workers.get(address)
        return len(blocks.cached) if blocks else 0

    def fingerprint(self, adapter_id: int) -> str | None:
        """The fingerprint of adapter adapter_id as some worker reported it (an id names one
        adapter across the cluster: workers refuse the same id with another path)."""
        for blocks in self._workers.values():
            found = blocks.lora_fingerprints.get(adapter_id)
            if found is not None:
                return found
        return None

    def hashes(self, token_ids, salt: str | None, adapter_id: int | None) -> list[int]:
        """The chain hashes of the prompt's full blocks as the engine computes them; empty while
        no worker has reported its block size, or for an adapter no worker has stored blocks of."""
        if not self.block_size or not token_ids:
            return []
        lora = None
        if adapter_id is not None:
            lora = self.fingerprint(adapter_id)
            if lora is None:
                return []
        return prefix_hashes(token_ids, self.block_size, salt, lora)

    def overlaps(self, hashes: list[int], addresses: list[str]) -> dict[str, int]:
        """address -> how many leading blocks of hashes that worker holds (cached or predicted)."""
        result = dict.fromkeys(addresses, 0)
        if not hashes:
            return result
        now = time.monotonic()
        active = [a for a in addresses if a in self._workers]
        for h in hashes:
            holders = self._holders.get(h, ())
            still = []
            for a in active:
                if a in holders or self._workers[a].predicted.get(h, 0.0) > now:
                    result[a] += 1
                    still.append(a)
            if not still:
                break
            active = still
        return result

    def predict(self, address: str, hashes: list[int]) -> None:
        """The router sent a prompt with these blocks to address: count them there for a while."""
        if not hashes:
            return
        blocks = self._workers.setdefault(address, _WorkerBlocks())
        expires = time.monotonic() + self.prediction_ttl_s
        for h in hashes:
            if h not in blocks.cached:
                blocks.predicted.pop(
                    h, None
                )  # re-inserted last: insertion order stays expiry order
                blocks.predicted[h] = expires
        now = time.monotonic()
        while blocks.predicted:
            oldest, expiry = next(iter(blocks.predicted.items()))
            if expiry > now and len(blocks.predicted) <= MAX_PREDICTED_BLOCKS:
                break
            del blocks.predicted[oldest]
