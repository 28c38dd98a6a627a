"""The router's cost model of cross-worker prefix pulls (router/prefix_source.py): a long prefix
on a peer is pulled, a short one (or fewer blocks than the floor) computed; only a peer of the
same KV layout that holds more of the prompt than the chosen worker is named, never for an
adapter's prompt; and the picker attaches the source only where prefix pulls are on. Pure
functions and a KvIndex fed by hand: no processes."""

from __future__ import annotations

import pytest

from tandem.common.roles import Role
from tandem.router.kv_index import KvIndex
from tandem.router.policies import Picker, Placement, Policy
from tandem.router.prefix_source import PrefixPullCost, choose_source
from tandem.v1 import worker_pb2

BLOCK = 16
# A Llama-3-8B-shaped block in bf16: 32 layers x K and V x 8 heads x 128 x 16 tokens x 2 bytes.
BLOCK_BYTES = 32 * 2 * 8 * 128 * BLOCK * 2


class Handle:
    """What the picker and the cost model read of a router's WorkerHandle."""

    def __init__(self, address, layout="L", block_bytes=BLOCK_BYTES, leases_prefixes=True):
        self.address = address
        self.leases_prefixes = leases_prefixes
        self.kv_layout_hash = layout
        self.kv_block_bytes = block_bytes
        self.in_flight = 0
        self.role = Role.BOTH

    def holds(self, adapter_id, now):
        return True


def test_pull_wins_for_a_long_prefix_and_compute_for_a_short_one():
    cost = PrefixPullCost(min_blocks=4, pull_gbps=10.0, compute_tokens_per_s=20_000.0)
    # 4,096 tokens: computing takes ~0.2 s, reading 512 MiB at 10 GB/s ~0.05 s.
    assert cost.pull_wins(256, BLOCK, BLOCK_BYTES)
    assert cost.pull_seconds(256, BLOCK_BYTES) < cost.compute_seconds(256, BLOCK)
    # Below the floor: never pulled, however cheap.
    assert not cost.pull_wins(3, BLOCK, BLOCK_BYTES)
    # A slow lane (0.1 GB/s) loses to computing.
    assert not PrefixPullCost(pull_gbps=0.1).pull_wins(256, BLOCK, BLOCK_BYTES)
    # A fast engine on a few blocks: the set-up alone costs more than computing them.
    assert not PrefixPullCost(compute_tokens_per_s=1e6).pull_wins(4, BLOCK, BLOCK_BYTES)
    # An unknown block size in bytes (no state poll yet): no pull.
    assert not cost.pull_wins(256, BLOCK, 0)


@pytest.mark.parametrize(
    "settings, name",
    [
        (dict(min_blocks=0), "min_blocks"),
        (dict(pull_gbps=0), "pull_gbps"),
        (dict(compute_tokens_per_s=-1), "compute_tokens_per_s"),
        (dict(setup_s=-1), "setup_s"),
    ],
)
def test_a_bad_setting_is_refused_with_its_name(settings, name):
    with pytest.raises(ValueError, match=name):
        PrefixPullCost(**settings)


def _index(holdings: dict[str, int], prompt: list[int]) -> KvIndex:
    """A KV index where each address holds the first n blocks of prompt."""
    index = KvIndex()
    index.block_size = BLOCK
    hashes = index.hashes(prompt, None, None)
    for address, n in holdings.items():
        index.apply(
            address,
            worker_pb2.KvBlocksUpdate(tokens_per_block=BLOCK, stored=hashes[:n], snapshot=True),
        )
    return index


def test_the_source_is_the_leasing_peer_of_the_same_layout_that_holds_the_most():
    prompt = list(range(1, 64 * BLOCK + 2))  # 64 usable blocks (the last token is computed)
    cost = PrefixPullCost(min_blocks=4)
    w, s, other_layout = Handle("w:1"), Handle("s:1"), Handle("x:1", layout="M")
    index = _index({"w:1": 10, "s:1": 40, "x:1": 64}, prompt)
    placement = Placement(list(prompt))
    overlap = index.overlaps(placement.hashes(index), ["w:1", "s:1", "x:1"])
    source = choose_source(cost, index, placement, w, [w, s, other_layout], overlap)
    assert (source.address, source.num_blocks) == ("s:1", 40)
    # Only 3 blocks more than ours: below the floor.
    overlap["w:1"] = 37
    assert choose_source(cost, index, placement, w, [w, s, other_layout], overlap) is None
    # The chosen worker holds the most: nothing to pull.
    assert choose_source(cost, index, placement, s, [w, s], {"w:1": 10, "s:1": 40}) is None
    # A peer that does not lease its prefixes (no --kv-prefix-pulls) is never named.
    s.leases_prefixes = False
    assert choose_source(cost, index, placement, w, [w, s], {"w:1": 10, "s:1": 40}) is None
    s.leases_prefixes = True
    # An adapter's prompt: a peer leases base-model blocks only.
    adapted = Placement(list(prompt), adapter_id=3)
    assert choose_source(cost, index, adapted, w, [w, s], {"w:1": 10, "s:1": 40}) is None


def test_the_picker_names_the_source_only_with_prefix_pulls_on():
    prompt = list(range(1, 64 * BLOCK + 2))
    w, s = Handle("w:1"), Handle("s:1")
    for cost, expected in [(None, None), (PrefixPullCost(min_blocks=4), "s:1")]:
        index = _index({"s:1": 40}, prompt)
        picker = Picker({Role.BOTH: Policy.KV}, index, prefix_cost=cost)
        placement = Placement(list(prompt), dp_rank=1)  # names w (address order: s, w)
        chosen = picker.choose(Role.BOTH, [w, s], placement, 0.0)
        assert chosen is w
        source = placement.prefix_source_for("w:1")
        assert (source.address if source is not None else None) == expected
        # A decode-only pick never carries one (it computes no prompt).
        placement.prefix_source = None
        picker.choose(Role.DECODE, [w, s], placement, 0.0)
        assert placement.prefix_source is None
