"""KvTransceiver across two real processes over NIXL/UCX on CPU memory.

A spawned "prefill" process owns a pool of seeded random bytes; this process is
the "decode" side and pulls blocks from it. Only bytes cross the pipe.
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import random
import struct
import time

import pytest
import torch

from tandem.kvtransfer import (
    KvTransceiver,
    LayoutMismatchError,
    TransceiverClosedError,
    TransceiverState,
    UnknownPeerError,
    coalesce_runs,
)

# [num_layers, 2, block_size, num_kv_heads, head_dim] of one block; bf16.
BLOCK_SHAPE = (2, 2, 16, 2, 32)
PREFILL_NUM_BLOCKS = 64
DECODE_NUM_BLOCKS = 48
SEED = 1234
LAYOUT_HASH = "tiny-llama/bf16/L2/H2/D32/B16"
PREFILL_NAME = "test-prefill"
PEER_LIFETIME_S = 45.0
WAIT_S = 10.0

pytestmark = pytest.mark.timeout(60)


def seeded_pool(num_blocks: int, seed: int) -> torch.Tensor:
    """Random bytes viewed as bf16: bytes compare exactly, NaN patterns included."""
    nbytes = num_blocks * torch.Size(BLOCK_SHAPE).numel() * 2
    generator = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator)
    return raw.view(torch.bfloat16).view(num_blocks, *BLOCK_SHAPE)


def prefill_main(conn, deadline_s: float) -> None:
    """Owns the prefill pool; answers b"notifs" with the notifications received so far."""
    pool = seeded_pool(PREFILL_NUM_BLOCKS, SEED)
    with KvTransceiver(PREFILL_NAME, pool, LAYOUT_HASH) as transceiver:
        conn.send_bytes(transceiver.get_state())
        received: list[tuple[str, bytes]] = []
        # Bounded so that a crashed test run never leaves this process behind.
        end = time.monotonic() + deadline_s
        while time.monotonic() < end:
            received += transceiver.poll_notifications()
            if not conn.poll(0.002):
                continue
            try:
                command = conn.recv_bytes()
            except EOFError:
                break
            if command == b"notifs":
                conn.send_bytes(json.dumps([[name, msg.hex()] for name, msg in received]).encode())
                received = []
            elif command == b"stop":
                break


@pytest.fixture(scope="module")
def prefill():
    parent_conn, child_conn = mp.get_context("spawn").Pipe()
    process = mp.get_context("spawn").Process(
        target=prefill_main, args=(child_conn, PEER_LIFETIME_S), daemon=True
    )
    process.start()
    child_conn.close()
    if not parent_conn.poll(30):
        process.kill()
        pytest.fail("prefill process did not publish its state within 30 s")
    state = parent_conn.recv_bytes()
    yield parent_conn, state
    try:
        parent_conn.send_bytes(b"stop")
    except (BrokenPipeError, OSError):
        pass
    process.join(10)
    if process.is_alive():
        process.kill()
        process.join(5)


@pytest.fixture(scope="module")
def decode(prefill):
    _, state = prefill
    pool = torch.zeros(DECODE_NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16)
    transceiver = KvTransceiver("test-decode", pool, LAYOUT_HASH)
    transceiver.add_peer(state)
    yield transceiver, pool
    transceiver.close()


def wait_notifications(conn, expected: int, timeout_s: float = WAIT_S) -> list[tuple[str, bytes]]:
    received: list[tuple[str, bytes]] = []
    end = time.monotonic() + timeout_s
    while len(received) < expected and time.monotonic() < end:
        conn.send_bytes(b"notifs")
        received += [(name, bytes.fromhex(msg)) for name, msg in json.loads(conn.recv_bytes())]
        time.sleep(0.01)
    return received


def random_segments(rng: random.Random, num_segments: int) -> tuple[list[int], list[int]]:
    """Paired ids made of runs of 1-5 blocks; consecutive runs never merge, so #runs == num_segments."""
    remote_free = list(range(PREFILL_NUM_BLOCKS))
    local_free = set(range(DECODE_NUM_BLOCKS))
    remote_ids: list[int] = []
    local_ids: list[int] = []
    while len(remote_ids) == 0 or len(coalesce_runs(remote_ids, local_ids)) < num_segments:
        length = rng.randint(1, 5)
        remote_start = rng.choice(remote_free[: PREFILL_NUM_BLOCKS - length])
        local_start = rng.randrange(0, DECODE_NUM_BLOCKS - length)
        local_range = set(range(local_start, local_start + length))
        continues = (
            remote_ids and remote_start == remote_ids[-1] + 1 and local_start == local_ids[-1] + 1
        )
        if continues or not local_range <= local_free:
            continue
        remote_ids += range(remote_start, remote_start + length)
        local_ids += range(local_start, local_start + length)
        local_free -= local_range
    return remote_ids, local_ids


def assert_blocks_equal(local_pool, remote_ids, local_ids):
    expected = seeded_pool(PREFILL_NUM_BLOCKS, SEED)
    for remote_id, local_id in zip(remote_ids, local_ids):
        assert torch.equal(
            local_pool[local_id].view(torch.uint8), expected[remote_id].view(torch.uint8)
        ), f"local block {local_id} differs from remote block {remote_id}"


def test_read_copies_runs_and_scattered_blocks_and_notifies(prefill, decode):
    conn, _ = prefill
    transceiver, pool = decode
    remote_ids, local_ids = random_segments(random.Random(SEED), num_segments=6)
    assert any(b - a == 1 for a, b in zip(remote_ids, remote_ids[1:])), (
        "want at least one multi-block run"
    )

    transfer = transceiver.read_blocks(PREFILL_NAME, remote_ids, local_ids, b"req-1:done")
    transfer.wait(WAIT_S)

    assert transfer.done()
    assert transfer.num_descriptors == 6
    assert transfer.nbytes == len(remote_ids) * transceiver.block_nbytes
    assert_blocks_equal(pool, remote_ids, local_ids)
    untouched = sorted(set(range(DECODE_NUM_BLOCKS)) - set(local_ids))
    assert not pool[untouched].view(torch.uint8).any(), "a read wrote outside its local blocks"
    assert wait_notifications(conn, 1) == [("test-decode", b"req-1:done")]


def test_empty_read_still_notifies(prefill, decode):
    conn, _ = prefill
    transceiver, _ = decode
    transfer = transceiver.read_blocks(PREFILL_NAME, [], [], b"req-empty:done")
    assert transfer.done() and transfer.num_descriptors == 0 and transfer.nbytes == 0
    assert wait_notifications(conn, 1) == [("test-decode", b"req-empty:done")]


def test_second_read_reuses_cached_peer(prefill):
    conn, state = prefill
    pool = torch.zeros(DECODE_NUM_BLOCKS, *BLOCK_SHAPE, dtype=torch.bfloat16)
    with KvTransceiver("test-decode-cache", pool, LAYOUT_HASH) as transceiver:
        loads = []
        load_remote = transceiver._agent.add_remote_agent
        transceiver._agent.add_remote_agent = lambda metadata: (
            loads.append(1) or load_remote(metadata)
        )

        first = transceiver.add_peer(state)
        assert transceiver.add_peer(state) is first
        transceiver.read_blocks(PREFILL_NAME, [0, 1], [5, 6], b"a").wait(WAIT_S)
        transceiver.add_peer(state)
        transceiver.read_blocks(PREFILL_NAME, [9], [0], b"b").wait(WAIT_S)

        assert len(loads) == 1
        assert transceiver.peer_names == (PREFILL_NAME,)
        assert_blocks_equal(pool, [0, 1, 9], [5, 6, 0])
        assert sorted(wait_notifications(conn, 2)) == [
            ("test-decode-cache", b"a"),
            ("test-decode-cache", b"b"),
        ]


def test_layout_mismatch_is_typed_and_names_both_hashes(prefill, decode):
    _, state = prefill
    transceiver, _ = decode
    foreign = dataclasses.replace(
        TransceiverState.from_bytes(state), agent_name="other", layout_hash="qwen/fp8"
    )
    with pytest.raises(LayoutMismatchError) as excinfo:
        transceiver.add_peer(foreign.to_bytes())
    assert "qwen/fp8" in str(excinfo.value) and LAYOUT_HASH in str(excinfo.value)
    assert isinstance(excinfo.value, ValueError)
    assert "other" not in transceiver.peer_names


def test_malformed_state_raises_value_error(prefill, decode):
    _, state = prefill
    transceiver, _ = decode
    parsed = TransceiverState.from_bytes(state)
    header = json.dumps({"agent_name": "x"}).encode()
    bad_states = [
        b"",
        b"garbage",
        state[:-1],
        state + b"\0",
        b"XXXX" + state[4:],
        state[:4] + struct.pack("!H", 99) + state[6:],
        struct.pack("!4sHI", b"TKVS", 1, len(header)) + header + struct.pack("!I", 1) + b"m",
        dataclasses.replace(
            parsed, agent_name="junk-peer", agent_metadata=b"not nixl metadata"
        ).to_bytes(),
    ]
    for bad in bad_states:
        with pytest.raises(ValueError):
            transceiver.add_peer(bad)
    assert transceiver.peer_names == (PREFILL_NAME,)


def test_bad_block_ids_and_unknown_peer(decode):
    transceiver, _ = decode
    for remote_ids, local_ids in [
        ([PREFILL_NUM_BLOCKS], [0]),
        ([0], [DECODE_NUM_BLOCKS]),
        ([-1], [0]),
        ([0, 1], [0]),
        ([0, 1], [3, 3]),
        ([True], [0]),
    ]:
        with pytest.raises(ValueError):
            transceiver.read_blocks(PREFILL_NAME, remote_ids, local_ids, b"")
    with pytest.raises(UnknownPeerError):
        transceiver.read_blocks("nobody", [0], [0], b"")


def test_state_round_trip_and_close_is_idempotent():
    pool = torch.zeros(4, *BLOCK_SHAPE, dtype=torch.bfloat16)
    transceiver = KvTransceiver("test-standalone", pool, LAYOUT_HASH)
    state = TransceiverState.from_bytes(transceiver.get_state())
    assert state.to_bytes() == transceiver.get_state()
    assert (state.agent_name, state.base_address, state.num_blocks) == (
        "test-standalone",
        pool.data_ptr(),
        4,
    )
    assert (state.block_nbytes, state.memory_type, state.device_id) == (
        pool[0].numel() * 2,
        "DRAM",
        0,
    )
    transceiver.close()
    transceiver.close()
    with pytest.raises(TransceiverClosedError):
        transceiver.poll_notifications()
    with pytest.raises(TransceiverClosedError):
        transceiver.read_blocks(PREFILL_NAME, [], [], b"")


def test_coalesce_runs_requires_both_sides_consecutive():
    assert coalesce_runs([4, 5, 6, 9, 10, 11], [0, 1, 7, 8, 9, 2]) == [
        (4, 0, 2),
        (6, 7, 1),
        (9, 8, 2),
        (11, 2, 1),
    ]
    assert coalesce_runs([], []) == []


def test_split_runs_caps_descriptor_length():
    from tandem.kvtransfer.transceiver import split_runs

    assert split_runs([(10, 0, 5), (3, 20, 2)], 2) == [
        (10, 0, 2),
        (12, 2, 2),
        (14, 4, 1),
        (3, 20, 2),
    ]
    assert split_runs([(10, 0, 5)], None) == [(10, 0, 5)]
