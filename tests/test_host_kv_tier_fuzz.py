"""The block manager and the host KV tier against a model of the device pool, the host slots
and the two CUDA streams of ModelRunner.copy_kv_tier (the worst case: a copy batch runs as late
as the stream order allows): random requests, tier hits, aborts before a step, prefix leases, KV
pulls into fresh blocks, beam forks, finishes and weight resets. After every flush each slot and
cached device block holds its hash's KV, no block is written before a copy that reads it (or
while one writes it) has run, and the KV events (stored / updated cache_level / removed) say
exactly which blocks each tier holds."""

import os
import random

import pytest
from test_host_kv_tier import _Seq

from tandem.engine.block_manager import BlockManager
from tandem.engine.kv_tier import HostKvTier, runs

RESET = True  # weight resets among the operations (False: a strict race check without them)


class _Model:
    """Device/host contents + a race detector for the copy stream."""

    def __init__(self, bm):
        self.bm = bm
        self.tier = bm.host_tier
        self.device = {}
        self.host = {}
        # Copy batches not yet known to have run (no wait_stream since): (down srcs, up dsts).
        self.unordered = []
        self.pending = []  # ModelRunner._tier_pending; nothing ever completes (the worst case)
        self.batch = 0
        self.last_writer = {}
        self.strict = True

    def flush(self):
        copies = self.tier.take_copies()
        if not copies.down and not copies.up and not copies.reused:
            return False
        # Contents: in stream order the batch's effect is as if run now (races checked apart).
        for block, slot, n in runs(copies.down):
            for i in range(n):
                self.host[slot + i] = self.device.get(block + i)
        for slot, block, n in runs(copies.up):
            for i in range(n):
                self.device[block + i] = self.host.get(slot + i)
        if copies.down or copies.up:
            self.batch += 1
            pairs = [
                (block + i, slot + i) for block, slot, n in runs(copies.down) for i in range(n)
            ]
            for _, slot in pairs:
                self.last_writer[slot] = self.batch
            self.unordered.append(
                ({b for b, _ in copies.down}, {b for _, b in copies.up}, pairs, self.batch)
            )
            # ModelRunner._tier_pending: the blocks each batch reads or writes.
            self.pending.append({b for b, _ in copies.down} | {b for _, b in copies.up})
        if copies.up or any(b in blocks for blocks in self.pending for b in copies.reused):
            self.unordered.clear()  # the device's stream waits for the copy stream
            return True
        return False

    def device_write(self, block, value, what):
        for srcs, dsts, pairs, k in self.unordered:
            if not self.strict:
                # A racing copy down may read the new data: its slot holds garbage unless a later
                # copy (stream-ordered after it) wrote the slot again.
                for b, slot in pairs:
                    if b == block and self.last_writer.get(slot) == k:
                        self.host[slot] = ("garbage", k)
            else:
                assert block not in srcs, f"{what}: block {block} written before its copy down ran"
            assert block not in dsts, f"{what}: block {block} written while a copy up writes it"
        self.device[block] = value

    def compute(self, seq, what):
        """seq's uncached blocks get their KV (a forward, or a NIXL pull), hashed as computed."""
        first_new = len(seq.block_hashes)
        seq.num_computed_tokens = seq.num_tokens
        self.bm.register_computed(seq)
        for i in range(first_new, len(seq.block_table)):
            value = seq.block_hashes[i] if i < len(seq.block_hashes) else ("partial", id(seq))
            self.device_write(seq.block_table[i], value, what)

    def device_read(self, block, want, what):
        for _, dsts, _, _ in self.unordered:
            assert block not in dsts, f"{what}: block {block} read before its copy up"
        assert self.device.get(block) == want, f"{what}: block {block} holds wrong KV"

    def check_tier(self):
        """After a flush: every slot holds its hash's KV; slots free xor mapped."""
        tier = self.tier
        mapped = list(tier._slot_of.values())
        assert len(set(mapped)) == len(mapped)
        assert not set(mapped) & set(tier._free_slots)
        assert len(mapped) + len(tier._free_slots) == tier.num_slots
        for h, slot in tier._slot_of.items():
            assert self.host.get(slot) == h, (
                f"slot {slot} mapped to {h} holds {self.host.get(slot)}"
            )
        for h, b in self.bm._by_hash.items():
            assert self.device.get(b) == h, (
                f"device block {b} cached as {h} holds {self.device.get(b)}"
            )


def _levels(bm, levels):
    for e in bm.drain_events():
        if e["type"] == "stored":
            for blk in e["blocks"]:
                levels.setdefault(blk["block_hash"], set()).add(0)
        elif e["type"] == "updated":
            d = e["cache_level"]
            s = levels.setdefault(e["block_hash"], set())
            s.discard(d["old_value"])
            s.add(d["new_value"])
        elif e["type"] == "removed":
            for h in set(e["block_hashes"]):  # (duplicates: test_reset_reports_...)
                assert h in levels, f"removed {h} never stored"
                levels.pop(h)
    on_device = set(bm._by_hash)
    in_tier = set(bm.host_tier._slot_of)
    for h in on_device | in_tier:
        assert h in levels, f"{h} held but reported removed (device={h in on_device})"
    for h in on_device | in_tier:
        want = {0} if h in on_device else {1}
        if h in on_device and levels[h] == {0, 1}:
            continue  # computed again while in the tier: 'stored' at 0 (pre-existing)
        assert levels[h] == want, (h, levels[h], h in on_device, h in in_tier)
    for h in levels:
        assert h in on_device or h in in_tier, f"{h} left both tiers with no removed event"


@pytest.mark.parametrize("seed", range(int(os.environ.get("SEEDS", 300))))
def test_fuzz_tier_data_and_stream_order(seed):
    rng = random.Random(seed)
    bs = 2
    bm = BlockManager(rng.randrange(6, 14), bs, host_tier=HostKvTier(rng.randrange(1, 10)))
    model = _Model(bm)
    model.strict = not RESET
    levels = {}
    roots = [[rng.randrange(100) for _ in range(rng.randrange(2, 10))] for _ in range(4)]
    live = []  # (seq, leased?)
    for step in range(int(os.environ.get("STEPS", 200))):
        op = rng.random()
        if op < 0.45:  # a request: prefix lookup, take, grow, flush, forward
            ids = list(rng.choice(roots)) + [rng.randrange(100) for _ in range(rng.randrange(0, 4))]
            seq = _Seq(ids)
            cached, hashes = bm.match_prefix(ids, None, len(ids) - 1)
            need = bm.num_blocks_for(len(ids)) - len(cached)
            if not bm.can_allocate(bm.num_free_needed(cached, need)):
                continue
            bm.take_cached(seq, cached, hashes, len(ids))
            bm.grow(seq, len(ids) - seq.num_computed_tokens)
            if rng.random() < 0.15:  # aborted before its step ran
                bm.release(seq)
                continue
            model.flush()
            for i, h in enumerate(seq.block_hashes):
                model.device_read(seq.block_table[i], h, f"step {step} read")
            model.compute(seq, f"step {step} forward")
            live.append(seq)
        elif op < 0.55:  # a lease (lease_prefix): take, flush, the peer reads
            ids = list(rng.choice(roots))
            cached, hashes = bm.match_prefix(ids, None, len(ids))
            while cached and not bm.can_allocate(bm.num_free_needed(cached, 0)):
                cached, hashes = cached[:-1], hashes[:-1]
            if not cached:
                continue
            blocks = bm.take(cached, hashes)
            model.flush()  # True: synchronize(), as lease_prefix does (the model cleared it)
            for b, h in zip(blocks, hashes):
                model.device_read(b, h, f"step {step} lease read")
            s = _Seq(ids)
            s.num_computed_tokens = 0
            s.block_table = blocks
            live.append(s)
        elif op < 0.65:  # a KV pull into fresh blocks (add_remote_kv_request)
            ids = list(rng.choice(roots)) + [rng.randrange(100) for _ in range(3)]
            seq = _Seq(ids)
            cached, hashes = bm.match_prefix(ids, None, len(ids))
            n = bm.num_blocks_for(len(ids) + 1)
            if not bm.can_allocate(bm.num_free_needed(cached, n - len(cached))):
                continue
            bm.take_cached(seq, cached, hashes, len(ids))
            seq.block_table += bm.allocate(n - len(cached))
            model.flush()  # True: synchronize(), as add_remote_kv_request does
            model.compute(seq, f"step {step} NIXL pull")
            live.append(seq)
        elif op < 0.72 and live:  # a beam fork of a live sequence
            parent = rng.choice(live)
            if not parent.block_hashes:
                continue
            parent.num_computed_tokens = min(
                parent.num_computed_tokens, len(parent.block_table) * bs
            )
            table, hashes, pairs = bm.fork(parent)
            model.flush()
            for src, dst in pairs:
                model.device_write(dst, model.device.get(src), f"step {step} fork copy")
            child = _Seq(parent.all_token_ids)
            child.block_table, child.block_hashes = table, hashes
            child.num_computed_tokens = parent.num_computed_tokens
            live.append(child)
        elif op < 0.74 and RESET:  # new weights
            model.flush()
            bm.reset_prefix_cache()
            for s in live:
                s.caches_blocks = False
        elif live:  # a request finishes
            seq = live.pop(rng.randrange(len(live)))
            bm.free(seq.block_table)
            seq.block_table = []
        if rng.random() < 0.5:
            model.flush()
            model.check_tier()
        _levels(bm, levels)
