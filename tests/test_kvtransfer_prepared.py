"""READs over prepared descriptor lists (make_prepped_xfer) across two real processes.

A spawned "prefill" process opens transceivers of several KV shapes and TP sizes over pools of
seeded random bytes; this process pulls random block sets from them and compares every byte with
the same seeded pools built here. Peers of the same TP size take the prepared lists, the others
the per-READ lists of read_plan; both must move exactly the same bytes.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import random
import time

import numpy as np
import pytest
import torch

from tandem.kvtransfer import (
    KvTransceiver,
    TransceiverState,
    TransferError,
    UnknownPeerError,
    coalesce_runs,
)
from tandem.kvtransfer.descriptors import count_runs
from tandem.kvtransfer.head_slices import PoolGeometry, read_plan

WAIT_S = 10.0
PEER_LIFETIME_S = 90.0
REMOTE_NUM_BLOCKS = 40
LOCAL_NUM_BLOCKS = 32
# (num_layers, block_size, num_kv_heads, head_dim) of a bf16 pool.
SHAPES = [(2, 16, 2, 32), (1, 4, 4, 8), (3, 8, 4, 16)]

pytestmark = pytest.mark.timeout(120)


def seeded_kv(dims: tuple[int, ...], num_blocks: int, seed: int) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim] of random bytes as bf16."""
    num_layers, block_size, num_kv_heads, head_dim = dims
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(
        0, 256, (2 * torch.Size(shape).numel(),), dtype=torch.uint8, generator=generator
    )
    return raw.view(torch.bfloat16).view(shape)


def zero_kv(dims: tuple[int, ...], num_blocks: int) -> torch.Tensor:
    num_layers, block_size, num_kv_heads, head_dim = dims
    shape = (num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim)
    return torch.zeros(shape, dtype=torch.bfloat16)


def rank_pools(kv: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """Each TP rank's pool: its contiguous slice of the KV heads."""
    return [chunk.contiguous() for chunk in kv.chunk(tp_size, dim=4)]


def layout_hash(dims: tuple[int, ...]) -> str:
    return "test/bf16/L{}/B{}/H{}/D{}".format(*dims)


def prefill_main(conn, deadline_s: float) -> None:
    """Opens (or reopens: a restart under the same name) transceivers on command; polls them all."""
    transceivers: dict[str, KvTransceiver] = {}
    received: list[list[str]] = []
    end = time.monotonic() + deadline_s
    try:
        while time.monotonic() < end:
            for transceiver in transceivers.values():
                received += [[n, m.hex()] for n, m in transceiver.poll_notifications()]
            if not conn.poll(0.002):
                continue
            try:
                command = json.loads(conn.recv_bytes())
            except EOFError:
                break
            if command["op"] == "open":
                name, dims = command["name"], tuple(command["dims"])
                if name in transceivers:
                    transceivers.pop(name).close()
                kv = seeded_kv(dims, REMOTE_NUM_BLOCKS, command["seed"])
                transceivers[name] = KvTransceiver(
                    name, rank_pools(kv, command["tp"]), layout_hash(dims), progress_thread=False
                )
                conn.send_bytes(transceivers[name].get_state())
            elif command["op"] == "notifs":
                conn.send_bytes(json.dumps(received).encode())
                received = []
            elif command["op"] == "stop":
                break
    finally:
        for transceiver in transceivers.values():
            transceiver.close()


@pytest.fixture(scope="module")
def prefill():
    context = mp.get_context("spawn")
    parent_conn, child_conn = context.Pipe()
    process = context.Process(target=prefill_main, args=(child_conn, PEER_LIFETIME_S), daemon=True)
    process.start()
    child_conn.close()

    def open_peer(name: str, dims: tuple[int, ...], tp: int, seed: int) -> bytes:
        parent_conn.send_bytes(
            json.dumps({"op": "open", "name": name, "dims": dims, "tp": tp, "seed": seed}).encode()
        )
        if not parent_conn.poll(30):
            pytest.fail(f"prefill process did not open {name!r} within 30 s")
        return parent_conn.recv_bytes()

    def notifications(expected: int) -> list[tuple[str, bytes]]:
        received: list[tuple[str, bytes]] = []
        end = time.monotonic() + WAIT_S
        while len(received) < expected and time.monotonic() < end:
            parent_conn.send_bytes(json.dumps({"op": "notifs"}).encode())
            received += [(n, bytes.fromhex(m)) for n, m in json.loads(parent_conn.recv_bytes())]
            time.sleep(0.01)
        return received

    yield open_peer, notifications
    try:
        parent_conn.send_bytes(json.dumps({"op": "stop"}).encode())
    except (BrokenPipeError, OSError):
        pass
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join(5)


def random_block_ids(rng: random.Random, num_blocks: int) -> tuple[list[int], list[int]]:
    """Paired ids, some in runs on both sides (NIXL merges those), the rest scattered."""
    remote_start = rng.randrange(0, REMOTE_NUM_BLOCKS - 8)
    local_start = rng.randrange(0, LOCAL_NUM_BLOCKS - 8)
    run = rng.randint(2, 8)
    remote = list(range(remote_start, remote_start + run))
    local = list(range(local_start, local_start + run))
    remote += rng.sample([b for b in range(REMOTE_NUM_BLOCKS) if b not in remote], num_blocks)
    local += rng.sample([b for b in range(LOCAL_NUM_BLOCKS) if b not in local], num_blocks)
    return remote, local


def assert_read_moves_the_blocks(transceiver, local_pools, peer, remote_kv, remote_ids, local_ids):
    for pool in local_pools:
        pool.zero_()
    transfer = transceiver.read_blocks(peer, remote_ids, local_ids, b"")
    transfer.wait(WAIT_S)
    local_kv = torch.cat(local_pools, dim=4).view(torch.uint8)
    expected = remote_kv.view(torch.uint8)
    for remote_id, local_id in zip(remote_ids, local_ids):
        assert torch.equal(local_kv[local_id], expected[remote_id]), (
            f"local block {local_id} differs from remote block {remote_id}"
        )
    untouched = sorted(set(range(LOCAL_NUM_BLOCKS)) - set(local_ids))
    assert not local_kv[untouched].any(), "a read wrote outside its local blocks"
    return transfer


@pytest.mark.parametrize("remote_tp, local_tp", [(1, 1), (2, 2), (1, 2), (2, 1)])
def test_read_moves_exactly_the_blocks_for_random_ids(prefill, remote_tp, local_tp):
    open_peer, _ = prefill
    for shape_index, dims in enumerate(SHAPES):
        seed = 100 * remote_tp + 10 * local_tp + shape_index
        peer = f"prefill-{remote_tp}{local_tp}-{shape_index}"
        remote_kv = seeded_kv(dims, REMOTE_NUM_BLOCKS, seed)
        state = open_peer(peer, dims, remote_tp, seed)
        local_pools = rank_pools(zero_kv(dims, LOCAL_NUM_BLOCKS), local_tp)
        num_layers, block_size, num_kv_heads, head_dim = dims
        geometry = PoolGeometry(num_layers, block_size, num_kv_heads, head_dim, 2)
        with KvTransceiver(
            f"decode-{remote_tp}{local_tp}-{shape_index}",
            local_pools,
            layout_hash(dims),
            progress_thread=False,
        ) as transceiver:
            transceiver.add_peer(state)
            is_prepared = transceiver._peer_dlists[peer] is not None
            assert is_prepared == (remote_tp == local_tp)
            rng = random.Random(seed)
            for num_scattered in (0, 1, 7, 20):
                remote_ids, local_ids = random_block_ids(rng, num_scattered)
                transfer = assert_read_moves_the_blocks(
                    transceiver, local_pools, peer, remote_kv, remote_ids, local_ids
                )
                plan = read_plan(remote_ids, local_ids, geometry, remote_tp, local_tp)
                assert transfer.num_descriptors == len(plan)
                assert transfer.nbytes == int(plan[:, 4].sum())

            # Removed and added again: the peer's blocks are prepared anew.
            assert transceiver.remove_peer(peer)
            assert transceiver._peer_dlists.get(peer) is None
            with pytest.raises(UnknownPeerError):
                transceiver.read_blocks(peer, [0], [0], b"")
            transceiver.add_peer(state)
            assert (transceiver._peer_dlists[peer] is not None) == is_prepared
            remote_ids, local_ids = random_block_ids(rng, 5)
            assert_read_moves_the_blocks(
                transceiver, local_pools, peer, remote_kv, remote_ids, local_ids
            )

            # Restarted under the same name with a new pool: READs reach the new one.
            restarted_kv = seeded_kv(dims, REMOTE_NUM_BLOCKS, seed + 1)
            transceiver.add_peer(open_peer(peer, dims, remote_tp, seed + 1))
            assert_read_moves_the_blocks(
                transceiver, local_pools, peer, restarted_kv, remote_ids, local_ids
            )
        assert transceiver._peer_dlists == {} and transceiver._local_dlist is None


def test_prepared_and_per_read_lists_agree_and_ids_are_still_checked(prefill):
    open_peer, notifications = prefill
    dims = SHAPES[0]
    remote_kv = seeded_kv(dims, REMOTE_NUM_BLOCKS, 7)
    state = open_peer("prefill-checks", dims, 1, 7)
    rng = random.Random(7)
    pools = {name: zero_kv(dims, LOCAL_NUM_BLOCKS) for name in ("p", "u")}
    prepared = KvTransceiver("decode-p", pools["p"], layout_hash(dims), progress_thread=False)
    per_read = KvTransceiver(
        "decode-u", pools["u"], layout_hash(dims), progress_thread=False, prepared_descriptors=False
    )
    with prepared, per_read:
        prepared.add_peer(state)
        per_read.add_peer(state)
        assert prepared._peer_dlists["prefill-checks"] is not None
        assert per_read._peer_dlists["prefill-checks"] is None
        for num_scattered in (0, 3, 12):
            remote_ids, local_ids = random_block_ids(rng, num_scattered)
            one, other = (
                assert_read_moves_the_blocks(
                    transceiver, [pools[key]], "prefill-checks", remote_kv, remote_ids, local_ids
                )
                for transceiver, key in ((prepared, "p"), (per_read, "u"))
            )
            assert (one.num_descriptors, one.nbytes) == (other.num_descriptors, other.nbytes)

        # numpy integers are ids too (checked one by one).
        assert_read_moves_the_blocks(
            prepared, [pools["p"]], "prefill-checks", remote_kv, [np.int64(3)], [np.int32(4)]
        )
        for remote_ids, local_ids in [
            ([REMOTE_NUM_BLOCKS], [0]),
            ([0], [LOCAL_NUM_BLOCKS]),
            ([-1], [0]),
            ([0], [-1]),
            ([0, 1], [0]),
            ([0, 1], [3, 3]),
            ([True], [0]),
            ([0, True], [0, 1]),
            ([0.0], [0]),
            ([np.int64(REMOTE_NUM_BLOCKS)], [0]),
            ([2**70], [0]),
        ]:
            with pytest.raises(ValueError):
                prepared.read_blocks("prefill-checks", remote_ids, local_ids, b"refused")

        # A state whose pool NIXL does not know: its READs fail as TransferError, as before.
        bogus = dataclasses.replace(
            TransceiverState.from_bytes(state), base_address=4096, rank_pools=((4096, 0),)
        )
        with KvTransceiver(
            "decode-bogus",
            zero_kv(dims, LOCAL_NUM_BLOCKS),
            layout_hash(dims),
            progress_thread=False,
        ) as transceiver:
            transceiver.add_peer(bogus.to_bytes())
            assert transceiver._peer_dlists["prefill-checks"] is None
            with pytest.raises(TransferError):
                transceiver.read_blocks("prefill-checks", [0], [0], b"")

        # An empty READ only notifies.
        transfer = prepared.read_blocks("prefill-checks", [], [], b"empty")
        assert transfer.done() and transfer.num_descriptors == 0 and transfer.nbytes == 0
        assert notifications(1) == [("decode-p", b"empty")]


def test_count_runs_counts_what_coalesce_runs_groups():
    rng = random.Random(3)
    for _ in range(500):
        n = rng.randint(1, 40)
        start = rng.randrange(0, 100)
        remote = [start + i if rng.random() < 0.7 else rng.randrange(0, 200) for i in range(n)]
        local = [start + 5 + i if rng.random() < 0.7 else rng.randrange(0, 200) for i in range(n)]
        assert count_runs(np.array(remote), np.array(local)) == len(coalesce_runs(remote, local))
