"""KvTransceiver: moves KV blocks between workers with NIXL one-sided READs.

The decode worker pulls: it holds the prefill's state (agent metadata + pool
address), issues a READ of the prefill's blocks into its own, and NIXL delivers
the caller's notification to the prefill once the data has landed, which is the
prefill's cue to free the leased blocks.

The pool is one block-major tensor [num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim], so block b of every layer is one contiguous byte range
and a run of consecutive blocks is one contiguous range too: a request needs
one descriptor per run, not one per block and layer.

Not thread-safe: one owner thread (the worker's engine thread) drives it.
"""

from __future__ import annotations

import logging
from typing import Sequence

import numpy as np
import torch
from nixl._api import nixl_agent, nixl_agent_config

from tandem.kvtransfer.errors import (
    KvTransferError,
    LayoutMismatchError,
    TransceiverClosedError,
    TransferError,
    UnknownPeerError,
)
from tandem.kvtransfer.state import TransceiverState
from tandem.kvtransfer.transfer import NIXL_ERRORS, Transfer, settled

logger = logging.getLogger(__name__)

KV_CACHE_NDIM = 6


def coalesce_runs(remote_block_ids: Sequence[int], local_block_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """Group paired ids into (remote_start, local_start, num_blocks) runs.

    A run continues only while both sides advance by exactly one block, since a
    descriptor is one contiguous range on each side.
    """
    runs: list[tuple[int, int, int]] = []
    for remote_id, local_id in zip(remote_block_ids, local_block_ids):
        if runs:
            remote_start, local_start, count = runs[-1]
            if remote_id == remote_start + count and local_id == local_start + count:
                runs[-1] = (remote_start, local_start, count + 1)
                continue
        runs.append((remote_id, local_id, 1))
    return runs


def split_runs(runs: list[tuple[int, int, int]], max_blocks: int | None) -> list[tuple[int, int, int]]:
    """Cuts runs longer than max_blocks: several descriptors let the backend move them in parallel."""
    if not max_blocks:
        return runs
    out = []
    for remote_start, local_start, count in runs:
        for offset in range(0, count, max_blocks):
            out.append((remote_start + offset, local_start + offset, min(max_blocks, count - offset)))
    return out


class KvTransceiver:
    """Owns one NIXL agent and the registration of one KV pool."""

    def __init__(self, agent_name: str, kv_cache: torch.Tensor, layout_hash: str, *, progress_thread: bool = True,
                 max_descriptor_bytes: int | None = None):
        """`progress_thread`: NIXL's own UCX progress thread. With it, a READ completes
        whatever the peer is doing; without it, UCX progresses only inside
        Transfer.done() and poll_notifications(), and a READ completes only once the
        *target* also polls (measured: a 10 ms prefill poll loop gives every READ a
        10 ms floor). The price is a busy core per agent (1.0 CPU-s per s while idle),
        which on a host with ~2 cores starves memcpy; turn it off only where both
        sides poll tightly.
        """
        if not isinstance(agent_name, str) or not agent_name:
            raise ValueError("agent_name must be a non-empty string")
        if not isinstance(layout_hash, str) or not layout_hash:
            raise ValueError("layout_hash must be a non-empty string")
        if not isinstance(kv_cache, torch.Tensor) or kv_cache.dim() != KV_CACHE_NDIM:
            raise ValueError(
                "kv_cache must be a tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]"
            )
        if not kv_cache.is_contiguous() or kv_cache.numel() == 0:
            raise ValueError("kv_cache must be contiguous and non-empty: blocks are addressed by byte offset")
        if kv_cache.device.type == "cpu":
            memory_type, device_id = "DRAM", 0
        elif kv_cache.device.type == "cuda":
            memory_type, device_id = "VRAM", kv_cache.device.index
        else:
            raise ValueError(f"kv_cache on {kv_cache.device} is not supported (cpu or cuda)")

        self._kv_cache = kv_cache  # keeps the registered storage alive
        self._layout_hash = layout_hash
        self._peers: dict[str, TransceiverState] = {}
        self._in_flight: set[Transfer] = set()
        self._agent: nixl_agent | None = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        if "UCX" not in self._agent.backends:
            raise KvTransferError("NIXL UCX backend is not available in this environment")
        try:
            self._registration = self._agent.register_memory(kv_cache)
        except NIXL_ERRORS as exc:
            raise KvTransferError(f"registering the KV pool ({memory_type}) with NIXL failed: {exc}") from exc
        # Metadata is taken after registration so that it carries the pool's keys.
        self._local = TransceiverState(
            agent_name=agent_name,
            agent_metadata=self._agent.get_agent_metadata(),
            base_address=kv_cache.data_ptr(),
            block_nbytes=kv_cache[0].numel() * kv_cache.element_size(),
            num_blocks=kv_cache.shape[0],
            memory_type=memory_type,
            device_id=device_id,
            layout_hash=layout_hash,
        )
        self._state_bytes = self._local.to_bytes()
        if max_descriptor_bytes is not None and max_descriptor_bytes <= 0:
            raise ValueError(f"max_descriptor_bytes must be > 0, got {max_descriptor_bytes}")
        self._max_run_blocks = max(1, max_descriptor_bytes // self.block_nbytes) if max_descriptor_bytes else None

    @property
    def agent_name(self) -> str:
        return self._local.agent_name

    @property
    def num_blocks(self) -> int:
        return self._local.num_blocks

    @property
    def block_nbytes(self) -> int:
        return self._local.block_nbytes

    @property
    def peer_names(self) -> tuple[str, ...]:
        return tuple(self._peers)

    @property
    def is_closed(self) -> bool:
        return self._agent is None

    def get_state(self) -> bytes:
        return self._state_bytes

    def add_peer(self, state: bytes) -> TransceiverState:
        """Load a peer's state once; re-adding the same state is a no-op."""
        agent = self._require_open()
        remote = TransceiverState.from_bytes(state)
        if remote.layout_hash != self._layout_hash:
            raise LayoutMismatchError(self._layout_hash, remote.layout_hash, remote.agent_name)
        if remote.block_nbytes != self.block_nbytes:
            raise ValueError(
                f"peer {remote.agent_name!r} has {remote.block_nbytes}-byte blocks, ours are "
                f"{self.block_nbytes} bytes, yet the layout hashes match: the hash misses a KV dimension"
            )
        if remote.agent_name == self.agent_name:
            raise ValueError(f"peer name {remote.agent_name!r} is our own agent name")
        cached = self._peers.get(remote.agent_name)
        if cached == remote:
            return cached
        if cached is not None:
            # Same name, new metadata: the peer restarted and registered a new pool.
            self.remove_peer(remote.agent_name)
        try:
            loaded_name = agent.add_remote_agent(remote.agent_metadata)
        except NIXL_ERRORS as exc:
            raise ValueError(f"NIXL rejected the metadata of peer {remote.agent_name!r}: {exc}") from exc
        # The binding returns the name as bytes.
        loaded_name = loaded_name.decode() if isinstance(loaded_name, bytes) else loaded_name
        if loaded_name != remote.agent_name:
            agent.remove_remote_agent(loaded_name)
            raise ValueError(f"state names agent {remote.agent_name!r} but its metadata is agent {loaded_name!r}")
        self._peers[remote.agent_name] = remote
        return remote

    def remove_peer(self, name: str) -> bool:
        """Forget a peer; False if it was not known. Refused while reads from it run."""
        agent = self._require_open()
        if name not in self._peers:
            return False
        running = [t for t in self._in_flight if t.peer_name == name]
        # A finished but never polled read still sits in _in_flight; polling settles it.
        num_running = sum(1 for t in running if not settled(t))
        if num_running:
            raise KvTransferError(f"peer {name!r} has {num_running} transfers in flight; wait or abort them first")
        del self._peers[name]
        agent.remove_remote_agent(name)
        return True

    def read_blocks(
        self, peer_name: str, remote_block_ids: list[int], local_block_ids: list[int], notify: bytes
    ) -> Transfer:
        """READ remote blocks into local blocks; `notify` reaches the peer when the data has landed.

        An empty `notify` sends no notification.
        """
        agent = self._require_open()
        peer = self._peers.get(peer_name)
        if peer is None:
            raise UnknownPeerError(f"peer {peer_name!r} was not added (known: {sorted(self._peers)})")
        if not isinstance(notify, bytes):
            raise ValueError(f"notify must be bytes, got {type(notify).__name__}")
        if len(remote_block_ids) != len(local_block_ids):
            raise ValueError(
                f"{len(remote_block_ids)} remote block ids but {len(local_block_ids)} local block ids"
            )
        _check_block_ids("remote", remote_block_ids, peer.num_blocks)
        _check_block_ids("local", local_block_ids, self.num_blocks)
        if len(set(local_block_ids)) != len(local_block_ids):
            raise ValueError("local block ids repeat: two reads into one block would race")
        if not remote_block_ids:
            if notify:
                agent.send_notif(peer_name, notify)
            return Transfer.completed(peer_name)

        runs = split_runs(coalesce_runs(remote_block_ids, local_block_ids), self._max_run_blocks)
        block_nbytes = self.block_nbytes
        remote_descs = np.array(
            [(peer.block_address(r), n * block_nbytes, peer.device_id) for r, _, n in runs], dtype=np.uint64
        )
        local_descs = np.array(
            [(self._local.block_address(l), n * block_nbytes, self._local.device_id) for _, l, n in runs],
            dtype=np.uint64,
        )
        try:
            handle = agent.initialize_xfer(
                "READ",
                agent.get_xfer_descs(local_descs, self._local.memory_type),
                agent.get_xfer_descs(remote_descs, peer.memory_type),
                peer_name,
                notify,
            )
        except NIXL_ERRORS as exc:
            raise TransferError(f"preparing READ from peer {peer_name!r} failed: {exc}") from exc
        transfer = Transfer(
            agent, handle, peer_name, len(runs), len(remote_block_ids) * block_nbytes, self._in_flight.discard
        )
        self._in_flight.add(transfer)
        try:
            status = agent.transfer(handle)
        except NIXL_ERRORS as exc:
            status = f"ERR ({type(exc).__name__}: {exc})"
        if status not in ("DONE", "PROC"):
            transfer.abort()
            raise TransferError(f"posting READ from peer {peer_name!r} failed: {status}")
        return transfer

    def poll_notifications(self) -> list[tuple[str, bytes]]:
        """(peer agent name, message) pairs received since the last call."""
        agent = self._require_open()
        return [(name, msg) for name, msgs in agent.get_new_notifs().items() for msg in msgs]

    def close(self) -> None:
        """Abort running reads, drop peers, deregister the pool; safe to call twice."""
        agent = self._agent
        if agent is None:
            return
        for transfer in list(self._in_flight):
            transfer.abort()
        for name in list(self._peers):
            try:
                agent.remove_remote_agent(name)
            except NIXL_ERRORS as exc:
                logger.warning("removing peer %r on close failed: %s", name, exc)
        self._peers.clear()
        agent.deregister_memory(self._registration)
        self._registration = None
        self._agent = None

    def __enter__(self) -> KvTransceiver:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def _require_open(self) -> nixl_agent:
        if self._agent is None:
            raise TransceiverClosedError(f"transceiver {self.agent_name!r} is closed")
        return self._agent


def _check_block_ids(side: str, block_ids: Sequence[int], num_blocks: int) -> None:
    for block_id in block_ids:
        if not isinstance(block_id, (int, np.integer)) or isinstance(block_id, bool):
            raise ValueError(f"{side} block id {block_id!r} is not an integer")
        if not 0 <= block_id < num_blocks:
            raise ValueError(f"{side} block id {block_id} is out of range [0, {num_blocks})")
