"""Cross-worker prefix pulls, the router's half: when the worker a request is sent to holds less
of its prompt's prefix than another worker of the same role and KV layout (by the KV index),
the one cost model here says whether reading the extra blocks from that peer beats computing
them; if so the request's submit names the peer (SessionSubmit.prefix_source) and the worker
leases and pulls the prefix there (decode/prefix_pull.py), or computes as usual if that fails.

The model: a pull costs a fixed set-up (LeasePrefix, the peer's state once, ConfirmLease) plus
the blocks' bytes over the pull bandwidth; computing costs the blocks' tokens over the compute
rate. Fewer than min_blocks extra blocks are never pulled (the set-up and the risk of a wasted
round trip are not worth it). The inputs are router flags (--prefix-pull-*); the defaults suit
a GPU cluster over NVLink/RDMA, and a CPU cluster should lower the bandwidth to what it measures.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from tandem.v1 import worker_pb2

if TYPE_CHECKING:
    from tandem.router.kv_index import KvIndex
    from tandem.router.policies import Placement
    from tandem.router.workers import WorkerHandle


@dataclass(frozen=True)
class PrefixPullCost:
    # Extra blocks a pull must bring at least.
    min_blocks: int = 4
    # KV bytes per second a pull moves (the READ), in GB/s.
    pull_gbps: float = 10.0
    # Prompt tokens per second a worker computes (prefill throughput).
    compute_tokens_per_s: float = 20_000.0
    # Seconds a pull costs whatever its size (LeasePrefix and ConfirmLease round trips).
    setup_s: float = 0.002

    def __post_init__(self):
        if self.min_blocks < 1:
            raise ValueError(f"prefix pulls need min_blocks >= 1, got {self.min_blocks}")
        for name in ("pull_gbps", "compute_tokens_per_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0, got {getattr(self, name)}")
        if self.setup_s < 0:
            raise ValueError(f"setup_s must be >= 0, got {self.setup_s}")

    def pull_seconds(self, num_blocks: int, block_bytes: int) -> float:
        return self.setup_s + num_blocks * block_bytes / (self.pull_gbps * 1e9)

    def compute_seconds(self, num_blocks: int, block_size: int) -> float:
        return num_blocks * block_size / self.compute_tokens_per_s

    def pull_wins(self, num_blocks: int, block_size: int, block_bytes: int) -> bool:
        """Whether pulling num_blocks blocks (block_bytes of KV each, block_size tokens each)
        beats computing them."""
        if num_blocks < self.min_blocks or block_bytes <= 0:
            return False
        return self.pull_seconds(num_blocks, block_bytes) < self.compute_seconds(
            num_blocks, block_size
        )


def choose_source(
    cost: PrefixPullCost,
    index: KvIndex,
    placement: Placement,
    chosen: WorkerHandle,
    candidates: list[WorkerHandle],
    overlap: dict[str, int],
) -> worker_pb2.PrefixSource | None:
    """The peer to pull the prompt's prefix from on its way to chosen, or None. overlap:
    address -> leading blocks of the prompt each candidate holds, as known before the pick
    (the pick itself predicts the prompt on chosen). Only peers of chosen's KV layout that lease
    their prefixes (--kv-prefix-pulls); never for an adapter's prompt (a peer leases base-model
    blocks only)."""
    block_size = index.block_size
    if not block_size or placement.adapter_id is not None or not chosen.kv_layout_hash:
        return None
    # The last prompt token is always computed (its logits give the first token).
    usable = (len(placement.token_ids) - 1) // block_size
    ours = min(overlap.get(chosen.address, 0), usable)
    best, best_blocks = None, ours
    for w in candidates:
        if w is chosen or w.kv_layout_hash != chosen.kv_layout_hash or not w.leases_prefixes:
            continue
        held = min(overlap.get(w.address, 0), usable)
        if held > best_blocks:
            best, best_blocks = w, held
    if best is None or not cost.pull_wins(best_blocks - ours, block_size, chosen.kv_block_bytes):
        return None
    return worker_pb2.PrefixSource(address=best.address, num_blocks=best_blocks)
