"""A second KV tier below the device pool: host memory (--host-kv-cache-gb).

The device pool's prefix cache forgets a block when the allocator reuses it. With a tier below,
that block's KV is kept here (an "updated" KV event, cache_level 0 -> 1, where the cache alone
would report "removed"), and a later prefix lookup that runs past the device's blocks goes on in
the tier: the blocks found there get fresh device blocks and are copied back up ahead of the step
that reads them (cache_level 1 -> 0). The tier is LRU by block hash, the same hash chain as the
device cache (so a block there is valid for the same prompts, salts, adapters and weights), and it
holds each hash once.

Write-through: a cached block is copied down when the device frees it (its request finished; it
stays cached on the device too), not when the allocator reuses it, so the copy runs while the
block idles, off the path of the request that reuses its device block (which would otherwise wait
for the copy down of every block it evicts before its own copies up). A block copied up stays
here, so a session's history goes down once, not once a turn.

This class is the tier's bookkeeping (pure CPU: slots, LRU, the copies owed); the copies
themselves are the model runner's (ModelRunner.copy_kv_tier), run in batches when the engine
flushes them: before a step's forward (the blocks it writes may be ones just evicted; the blocks
it reads may be ones to copy up) and before a KV pull writes into freshly reserved blocks. A
store behind the same calls (store_many, offload, claim, copy_up, take_copies, clear) could be a disk
or a remote one (LMCache, Mooncake); host memory is the one built.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import NamedTuple

from tandem.common.block_runs import coalesce_runs


def runs(pairs: list[tuple[int, int]]) -> list[tuple[int, int, int]]:
    """Copies [(source, destination)] as runs (source, destination, count) of blocks consecutive
    on both sides, in either order (a session's blocks are freed tail first, so its slots and the
    device blocks it later gets back often run downwards together). Of two copies into one
    destination only the later is kept (what it overwrote was let go in between: a slot pushed
    out of a small tier twice in one batch, a block freed and taken again before its copy up
    ran), so the runs may copy in any order."""
    last = {dst: src for src, dst in pairs}
    ordered = sorted((src, dst) for dst, src in last.items())
    return coalesce_runs([src for src, _ in ordered], [dst for _, dst in ordered])


class TierCopies(NamedTuple):
    """One flush's copies: down [(device block, slot)] first, then up [(slot, device block)];
    reused: device blocks about to be written again whose KV went (or is going) down, so the
    device must not overwrite them before their copies down have landed."""

    down: list[tuple[int, int]]
    up: list[tuple[int, int]]
    reused: list[int]


class HostKvTier:
    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"a host KV tier needs at least one block, got {num_slots}")
        self.num_slots = num_slots
        # hash -> slot, least recently used first.
        self._slot_of: OrderedDict[int, int] = OrderedDict()
        self._free_slots = list(range(num_slots - 1, -1, -1))
        # Slots owed a copy up: not overwritten before take_copies hands that copy out.
        self._copying_up: set[int] = set()
        self._down: list[tuple[int, int]] = []
        self._up: list[tuple[int, int]] = []
        self._reused: list[int] = []
        self.num_copied_down = 0
        self.num_copied_up = 0

    def __contains__(self, block_hash: int) -> bool:
        return block_hash in self._slot_of

    def __len__(self) -> int:
        return len(self._slot_of)

    def store_many(self, items: list[tuple[int, int]]) -> list[int]:
        """Keeps a copy of each (hash, device block) of items here (the device blocks stay
        valid), least recently used first (the order they enter the LRU), with the slots the new
        ones get paired in block order (ranges of blocks land in ranges of slots: their copies run
        as one, runs()). A hash here already (written through before, or copied up and kept) is
        the same KV: it only becomes the most recently used. Returns the hashes this pushed out
        of the tier; when every slot is owed a copy up, the earliest items are not kept."""
        new: dict[int, int] = {}
        for block_hash, block in items:
            if block_hash in self._slot_of:
                self._slot_of.move_to_end(block_hash)
            else:
                new[block_hash] = block
        slots, pushed_out = [], []
        for _ in new:
            if self._free_slots:
                slots.append(self._free_slots.pop())
                continue
            # The least recently used slot that no copy up still reads.
            victim = next((h for h, s in self._slot_of.items() if s not in self._copying_up), None)
            if victim is None:
                break
            pushed_out.append(victim)
            slots.append(self._slot_of.pop(victim))
        kept = list(new.items())[len(new) - len(slots) :]
        slot_of_block = dict(zip(sorted(b for _, b in kept), sorted(slots)))
        for block_hash, block in kept:
            slot = slot_of_block[block]
            self._slot_of[block_hash] = slot
            self._down.append((block, slot))
        self.num_copied_down += len(kept)
        return pushed_out

    def offload(self, block_hash: int, block: int) -> int | None:
        """The device is about to reuse block, which holds block_hash's KV: keep it here, and the
        device waits for that copy before it writes the block. Returns the hash this pushed out
        of the tier, or None; block_hash itself when every slot is owed a copy up (nothing can go
        down now)."""
        pushed_out = self.store_many([(block_hash, block)])
        if block_hash not in self._slot_of:
            return block_hash
        self._reused.append(block)
        return pushed_out[0] if pushed_out else None

    def claim(self, block_hash: int) -> int:
        """A prefix hit on block_hash: its slot, most recently used now and not overwritten
        before its copy up (copy_up) has been handed out. The block stays here: its KV is still
        valid, and the device's copy going down again later costs nothing."""
        slot = self._slot_of[block_hash]
        self._slot_of.move_to_end(block_hash)
        self._copying_up.add(slot)
        return slot

    def copy_up(self, slot: int, block: int) -> None:
        """The claimed slot's KV goes into device block ahead of the next step."""
        self._up.append((slot, block))
        self.num_copied_up += 1

    def take_copies(self) -> TierCopies:
        """The copies owed since the last call, for the runner to run in order (down, then up)."""
        copies = TierCopies(self._down, self._up, self._reused)
        self._down, self._up, self._reused = [], [], []
        self._copying_up.clear()
        return copies

    def clear(self) -> list[int]:
        """Forgets every block (their KV is no longer valid: new weights); returns their hashes.
        Copies owed are dropped: copies up are flushed right after the lookup that owed them
        (before any command, a weight update or a release, can run), and copies down written
        through since the last flush are of KV no one will ask for again (a copy still running
        lands in a slot that is free now, and whatever goes into that slot later is queued behind
        it on the copy stream)."""
        hashes = list(self._slot_of)
        self._slot_of.clear()
        self._down, self._up, self._reused = [], [], []
        self._copying_up.clear()
        self._free_slots = list(range(self.num_slots - 1, -1, -1))
        return hashes
