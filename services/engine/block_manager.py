"""KV block bookkeeping: a free list, reference counts, and prefix caching by a
hash chain over full blocks. Pure CPU, no tensors.

A full block's hash covers its tokens and its parent's hash (and, at the root, the
request's cache_salt and LoRA adapter), so equal hashes mean equal prefixes computed
with equal weights. A freed block keeps
its hash and stays findable until the allocator reuses it, least recently freed
first; that is when it leaves the cache (a "removed" KV event), or, with a host tier
(kv_tier.py), stays findable there ("updated", cache_level 0 -> 1): the tier took a copy when the
block was freed (write-through) or takes it now.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

from tandem.common.kv_hash import chain_hash
from tandem.engine.kv_tier import HostKvTier
from tandem.engine.sequence import Sequence

# TRT-LLM's default retention priority, reported on stored blocks.
DEFAULT_PRIORITY = 35
# In match_prefix's blocks: a block found in the host tier (its device block is allocated, and
# its KV copied up, when the prefix is taken).
IN_HOST_TIER = -1


def _level_change(block_hash: int, old: int, new: int) -> dict:
    """TensorRT-LLM's "updated" KV event for a block moving between cache levels."""
    return {
        "type": "updated",
        "block_hash": block_hash,
        "cache_level": {"type": "event_diff", "old_value": old, "new_value": new},
        "priority": None,
    }


class NoFreeBlocksError(RuntimeError):
    pass


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool = True,
        host_tier: HostKvTier | None = None,
    ):
        self.num_blocks = num_blocks
        # The tier evicted blocks go down to (None: they are forgotten); only with prefix caching.
        self.host_tier = host_tier if enable_prefix_caching else None
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self._ref_counts = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._block_hash: list[int | None] = [None] * num_blocks
        self._by_hash: dict[int, int] = {}
        # KV events in TensorRT-LLM's schema, drained by the engine.
        self.events: list[dict] = [
            {
                "type": "created",
                "num_blocks_per_cache_level": [
                    num_blocks,
                    self.host_tier.num_slots if self.host_tier is not None else 0,
                ],
            }
        ]
        self.num_cache_hits = 0  # blocks served from the cache
        self.num_new_blocks = 0  # blocks handed out fresh (their KV computed or pulled anew)
        # vLLM's prefix cache metrics, in tokens: looked up, and found cached.
        self.num_prefix_query_tokens = 0
        self.num_prefix_hit_tokens = 0

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._by_hash)

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= len(self._free)

    def allocate(self, num_blocks: int) -> list[int]:
        if num_blocks > len(self._free):
            raise NoFreeBlocksError(f"need {num_blocks} KV blocks, {len(self._free)} free")
        blocks = []
        for _ in range(num_blocks):
            block, _ = self._free.popitem(last=False)
            self._evict(block)
            self._ref_counts[block] = 1
            blocks.append(block)
        self.num_new_blocks += num_blocks
        return blocks

    def free(self, blocks: list[int]) -> None:
        # Tail first: the least recently freed is evicted first, and a prefix's root must go last,
        # or one eviction would strand all the blocks that chain from it.
        idle = []
        for b in reversed(blocks):
            if self._ref_counts[b] <= 0:
                raise RuntimeError(f"double free of KV block {b}")
            self._ref_counts[b] -= 1
            if self._ref_counts[b] == 0:
                self._free[b] = None
                idle.append(b)
        if self.host_tier is not None and idle:
            self._write_through(idle)

    # -- prefix cache --
    def match_prefix(
        self, token_ids: list[int], salt: str | None, max_tokens: int, lora: str | None = None
    ) -> tuple[list[int], list[int]]:
        """Cached blocks holding the longest prefix of token_ids (at most max_tokens tokens) under
        this salt and adapter fingerprint: (block ids, their hashes); IN_HOST_TIER for a block
        the host tier holds."""
        blocks: list[int] = []
        hashes: list[int] = []
        if not self.enable_prefix_caching:
            return blocks, hashes
        bs = self.block_size
        tier = self.host_tier
        parent = None
        for start in range(0, (max_tokens // bs) * bs, bs):
            h = chain_hash(parent, token_ids[start : start + bs], salt, lora)
            block = self._by_hash.get(h)
            if block is None:
                if tier is None or h not in tier:
                    break
                block = IN_HOST_TIER
            blocks.append(block)
            hashes.append(h)
            parent = h
        return blocks, hashes

    def num_free_needed(self, cached_blocks: list[int], num_new_blocks: int) -> int:
        """Free-list blocks that taking cached_blocks plus num_new_blocks fresh ones consumes (a
        block in the host tier takes a fresh one)."""
        return (
            sum(1 for b in cached_blocks if b == IN_HOST_TIER or self._ref_counts[b] == 0)
            + num_new_blocks
        )

    def take(self, blocks: list[int], hashes: list[int]) -> list[int]:
        """One more reference to each of match_prefix's blocks (their KV stays put while held);
        a block in the host tier gets a fresh device block, its KV owed a copy up (the engine
        flushes it before anything reads the block), and is the device cache's again. Returns
        the device block ids, in order; free() gives them back."""
        for b in blocks:
            if b == IN_HOST_TIER:
                continue
            if self._ref_counts[b] == 0:
                del self._free[b]
            self._ref_counts[b] += 1
        blocks = list(blocks)
        # Claimed before any fresh block is allocated: the evictions allocating does push blocks
        # down, which must not push out the ones about to come up.
        slots = {
            i: self.host_tier.claim(hashes[i]) for i, b in enumerate(blocks) if b == IN_HOST_TIER
        }
        # After the device blocks are taken: a fresh block must not be one of them. Paired with
        # the slots in order, so that ranges of both copy up as one (kv_tier.runs).
        fresh = sorted(self.allocate(len(slots)))
        self.num_new_blocks -= len(slots)  # hits, not new KV
        for i, block in zip(sorted(slots, key=slots.get), fresh):
            blocks[i] = block
        for i, slot in slots.items():
            block = blocks[i]
            self.host_tier.copy_up(slot, block)
            self._by_hash[hashes[i]] = block
            self._block_hash[block] = hashes[i]
            self.events.append(_level_change(hashes[i], 1, 0))
        return blocks

    def take_cached(
        self, seq: Sequence, blocks: list[int], hashes: list[int], num_queried_tokens: int
    ) -> None:
        """Gives seq the cached prefix blocks: their KV counts as computed. num_queried_tokens:
        how many of its tokens the lookup was for (the prefix cache's queries). Blocks in the host
        tier get fresh device blocks, their KV owed a copy up (the engine flushes it before the
        step that reads it), and are the device cache's again."""
        blocks = self.take(blocks, hashes)
        seq.block_table = blocks
        seq.block_hashes = list(hashes)
        seq.num_computed_tokens = len(blocks) * self.block_size
        self.num_cache_hits += len(blocks)
        if self.enable_prefix_caching:
            self.num_prefix_query_tokens += num_queried_tokens
            self.num_prefix_hit_tokens += len(blocks) * self.block_size

    def register_computed_blocks(self, seqs: Iterable[Sequence]) -> None:
        """register_computed for each of seqs. Most sequences of a decode step complete no block:
        they are passed over before any hashing work."""
        if not self.enable_prefix_caching:
            return
        bs = self.block_size
        for seq in seqs:
            if (
                seq.caches_blocks
                and not seq.kv_unconfirmed
                and min(seq.num_computed_tokens, seq.num_tokens) // bs > len(seq.block_hashes)
            ):
                self.register_computed(seq)

    def register_computed(self, seq: Sequence) -> None:
        """Hashes seq's newly full, computed blocks into the cache (a "stored" event)."""
        if not self.enable_prefix_caching or not seq.caches_blocks or seq.kv_unconfirmed:
            return
        bs = self.block_size
        # A token drawn by a step still in flight may have its KV computed but no id on the host yet.
        num_full = min(min(seq.num_computed_tokens, seq.num_tokens) // bs, len(seq.block_table))
        if num_full <= len(seq.block_hashes):
            return
        parent = seq.block_hashes[-1] if seq.block_hashes else None
        for i in range(len(seq.block_hashes), num_full):
            chunk = seq.token_slice(i * bs, (i + 1) * bs)
            h = chain_hash(parent, chunk, seq.cache_salt, seq.lora_fingerprint)
            seq.block_hashes.append(h)
            block = seq.block_table[i]
            if h not in self._by_hash and self._block_hash[block] is None:
                self._by_hash[h] = block
                self._block_hash[block] = h
                # One event per block: its parent is exact even when a neighbour was cached already.
                self.events.append(
                    {
                        "type": "stored",
                        "parent_hash": parent,
                        "blocks": [
                            {
                                "type": "stored_block",
                                "block_hash": h,
                                # TensorRT-LLM writes token_extra_id for every token (its
                                # consumers read it); tandem has no extra ids (multimodal): 0.
                                "tokens": [
                                    {"type": "unique_token", "token_id": t, "token_extra_id": 0}
                                    for t in chunk
                                ],
                                "lora_id": seq.adapter.int_id if seq.adapter is not None else None,
                                "cache_level": 0,
                                "priority": DEFAULT_PRIORITY,
                            }
                        ],
                    }
                )
            parent = h

    def _evict(self, block: int) -> None:
        h = self._block_hash[block]
        if h is not None:
            self._block_hash[block] = None
            if self._by_hash.get(h) != block:
                return
            del self._by_hash[h]
            if self.host_tier is None:
                self.events.append({"type": "removed", "block_hashes": [h]})
                return
            pushed_out = self.host_tier.offload(h, block)
            if pushed_out != h:
                self.events.append(_level_change(h, 0, 1))
            self._pushed_out(pushed_out)

    def _write_through(self, blocks: list[int]) -> None:
        """Cached blocks no request holds go down to the tier now (kv_tier.py), while they idle,
        so that evicting them later costs no copy; tail first, as they were freed."""
        items = []
        for block in blocks:
            h = self._block_hash[block]
            if h is not None and self._by_hash.get(h) == block:
                items.append((h, block))
        for h in self.host_tier.store_many(items):
            self._pushed_out(h)

    def _pushed_out(self, block_hash: int | None) -> None:
        """The tier let block_hash go: it has left the cache unless the device still holds it."""
        if block_hash is not None and block_hash not in self._by_hash:
            self.events.append({"type": "removed", "block_hashes": [block_hash]})

    def reset_prefix_cache(self) -> None:
        """Forgets every cached block (their KV is about to become invalid: new weights, a new pool)."""
        hashes = list(self._by_hash)
        for block in self._by_hash.values():
            self._block_hash[block] = None
        self._by_hash.clear()
        if self.host_tier is not None:
            hashes = list(dict.fromkeys(hashes + self.host_tier.clear()))  # a block in both: once
        if hashes:
            self.events.append({"type": "removed", "block_hashes": hashes})

    def drain_events(self) -> list[dict]:
        events, self.events = self.events, []
        return events

    # -- per-sequence helpers --
    def blocks_needed(self, seq: Sequence, num_new_tokens: int) -> int:
        """Extra blocks seq needs so that num_new_tokens more tokens have KV slots."""
        return max(
            0, self.num_blocks_for(seq.num_computed_tokens + num_new_tokens) - len(seq.block_table)
        )

    def grow(self, seq: Sequence, num_new_tokens: int) -> None:
        seq.block_table.extend(self.allocate(self.blocks_needed(seq, num_new_tokens)))

    def fork(self, seq: Sequence) -> tuple[list[int], list[int], list[tuple[int, int]]]:
        """A new beam from seq: seq's full computed blocks shared (one more reference each) and its
        partial last block copied into a new one. Returns (block table, block hashes, [(source,
        copy)] for the device). With no block free the beam gets none and recomputes its KV."""
        num_full = seq.num_computed_tokens // self.block_size
        partial = seq.num_computed_tokens % self.block_size and num_full < len(seq.block_table)
        if partial and not self._free:
            return [], [], []
        shared = seq.block_table[:num_full]
        for b in shared:
            self._ref_counts[b] += 1
        table, copies = list(shared), []
        if partial:
            (copy,) = self.allocate(1)
            copies.append((seq.block_table[num_full], copy))
            table.append(copy)
        return table, list(seq.block_hashes[:num_full]), copies

    def release(self, seq: Sequence) -> None:
        self.free(seq.block_table)
        seq.block_table = []
        seq.block_hashes = []
