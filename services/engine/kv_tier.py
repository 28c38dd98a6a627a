"""A second KV tier below the device pool: host memory (--host-kv-cache-gb).

The device pool's prefix cache forgets a block when the allocator reuses it. With a tier below,
that block's KV is first copied down (an "updated" KV event, cache_level 0 -> 1, where the
cache alone would report "removed"), and a later prefix lookup that runs past the device's
blocks goes on in the tier: the blocks found there get fresh device blocks and are copied back
up ahead of the step that reads them (cache_level 1 -> 0). The tier is LRU by block hash, the
same hash chain as the device cache (so a block there is valid for the same prompts, salts,
adapters and weights), and it holds each hash once: a block copied up leaves it.

This class is the tier's bookkeeping (pure CPU: slots, LRU, the copies owed); the copies
themselves are the model runner's (ModelRunner.copy_kv_tier), run in batches when the engine
flushes them: before a step's forward (the blocks it writes may be ones just evicted; the blocks
it reads may be ones to copy up) and before a KV pull writes into freshly reserved blocks. A
store behind the same calls (offload, claim, copy_up, take_copies, clear) could be a disk or a
remote one (LMCache, Mooncake); host memory is the one built.
"""

from __future__ import annotations

from collections import OrderedDict


class HostKvTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        # hash -> slot, least recently used first.
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Slots whose block is owed a copy up: reusable only once that copy has run (take_copies).
        self._copying_up: list[int] = []
        # The copies owed: (device block, slot) down, (slot, device block) up; down ones run first.
        self._down: list[tuple[int, int]] = []
        self._up: list[tuple[int, int]] = []
        self.num_copied_down = 0
        self.num_copied_up = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def offload(self, block_hash: int, block: int) -> int | None:
        """The device is about to reuse block, which holds block_hash's KV: keep a copy here.
        Returns the hash this pushed out of the tier (its least recently used), or None;
        block_hash itself when every slot is owed a copy up (nothing can go down now)."""
        if block_hash in self._slot_of:
            # Still here from before (the device computed the block again rather than take it
            # from the tier, e.g. a prompt's last block): the same hash is the same KV.
            self._slot_of.move_to_end(block_hash)
            return None
        pushed_out = None
        if self._free_slots:
            slot = self._free_slots.pop()
        elif self._slot_of:
            pushed_out, slot = self._slot_of.popitem(last=False)
        else:
            return block_hash
        self._slot_of[block_hash] = slot
        self._down.append((block, slot))
        self.num_copied_down += 1
        return pushed_out

    def claim(self, block_hash: int) -> int:
        """Takes block_hash out of the tier (a prefix hit): its slot, kept until the copy up
        (copy_up) has run, so that nothing offloaded meanwhile overwrites it."""
        slot = self._slot_of.pop(block_hash)
        self._copying_up.append(slot)
        return slot

    def copy_up(self, slot: int, block: int) -> None:
        """The claimed slot's KV goes into device block ahead of the next step."""
        self._up.append((slot, block))
        self.num_copied_up += 1

    def take_copies(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies owed since the last call, (down, up), for the runner to run in that order."""
        down, up = self._down, self._up
        self._down, self._up = [], []
        self._free_slots.extend(self._copying_up)
        self._copying_up = []
        return down, up

    def clear(self) -> list[int]:
        """Forgets every block (their KV is no longer valid: new weights); returns their hashes.
        Copies owed are dropped: the engine flushes them right after the lookup that owed them,
        before any command (a weight update, a release) can run, so none is owed here."""
        hashes = list(self._slot_of)
        self._slot_of.clear()
        self._down, self._up, self._copying_up = [], [], []
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        return hashes
