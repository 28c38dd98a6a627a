"""KvTransceiver: moves KV blocks between workers with NIXL one-sided READs.

The decode worker pulls: it holds the prefill's state (agent metadata + pool
address), issues a READ of the prefill's blocks into its own, and NIXL delivers
the caller's notification to the prefill once the data has landed, which is the
prefill's cue to free the leased blocks.

The pool is one block-major tensor [num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim], so block b of every layer is one contiguous byte range
and a run of consecutive blocks is one contiguous range too: a request needs
one descriptor per run, not one per block and layer.

A tensor-parallel worker registers every rank's pool with its one agent (rank 0 maps the
followers' pools, engine/kv_share.py) and its state lists them; a READ between workers of
different TP sizes moves head slices (head_slices.py).

Not thread-safe: one owner thread (the worker's engine thread) drives it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

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
from tandem.kvtransfer.head_slices import PoolGeometry, coalesce_runs, read_plan, split_runs  # noqa: F401 (re-exported)
from tandem.kvtransfer.state import TransceiverState, local_host_id
from tandem.kvtransfer.transfer import NIXL_ERRORS, Transfer, settled
from tandem.kvtransfer.ucx_env import apply_defaults as apply_ucx_defaults

logger = logging.getLogger(__name__)

KV_CACHE_NDIM = 6


class KvTransceiver:
    """Owns one NIXL agent and the registration of one KV pool."""

    def __init__(
        self,
        agent_name: str,
        kv_cache: torch.Tensor | list[torch.Tensor],
        layout_hash: str,
        *,
        progress_thread: bool = True,
        max_descriptor_bytes: int | None = None,
    ):
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
        pools = [kv_cache] if isinstance(kv_cache, torch.Tensor) else list(kv_cache)
        for pool in pools:
            if (
                not isinstance(pool, torch.Tensor)
                or pool.dim() != KV_CACHE_NDIM
                or pool.shape != pools[0].shape
            ):
                raise ValueError(
                    "kv_cache must be a tensor [num_blocks, num_layers, 2, block_size, num_kv_heads, "
                    "head_dim], or one such tensor of one shape per tensor-parallel rank"
                )
            if not pool.is_contiguous() or pool.numel() == 0:
                raise ValueError(
                    "kv_cache must be contiguous and non-empty: blocks are addressed by byte offset"
                )
        kv_cache = pools[0]
        if kv_cache.device.type == "cpu":
            memory_type, device_id = "DRAM", 0
        elif kv_cache.device.type == "cuda":
            memory_type, device_id = "VRAM", kv_cache.device.index
        else:
            raise ValueError(f"kv_cache on {kv_cache.device} is not supported (cpu or cuda)")

        self._pools = pools  # keeps the registered storage alive
        num_blocks, num_layers, _, block_size, heads_per_rank, head_dim = kv_cache.shape
        self._geometry = PoolGeometry(
            num_layers, block_size, heads_per_rank * len(pools), head_dim, kv_cache.element_size()
        )
        self._layout_hash = layout_hash
        self._peers: dict[str, TransceiverState] = {}
        self._in_flight: set[Transfer] = set()
        apply_ucx_defaults(memory_type)
        self._agent: nixl_agent | None = nixl_agent(
            agent_name, nixl_agent_config(enable_prog_thread=progress_thread, backends=["UCX"])
        )
        if "UCX" not in self._agent.backends:
            raise KvTransferError("NIXL UCX backend is not available in this environment")
        try:
            self._registration = self._agent.register_memory(pools)
        except NIXL_ERRORS as exc:
            raise KvTransferError(
                f"registering the KV pool ({memory_type}) with NIXL failed: {exc}"
            ) from exc
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
            rank_pools=tuple((pool.data_ptr(), _device_id(pool)) for pool in pools),
            host_id=local_host_id(),
        )
        self._state_bytes = self._local.to_bytes()
        if max_descriptor_bytes is not None and max_descriptor_bytes <= 0:
            raise ValueError(f"max_descriptor_bytes must be > 0, got {max_descriptor_bytes}")
        self._max_run_blocks = (
            max(1, max_descriptor_bytes // self.block_nbytes) if max_descriptor_bytes else None
        )

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
    def tp_size(self) -> int:
        return self._local.tp_size

    @property
    def local_state(self) -> TransceiverState:
        return self._local

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
        if remote.block_nbytes * remote.tp_size != self.block_nbytes * self.tp_size:
            raise ValueError(
                f"peer {remote.agent_name!r} has {remote.block_nbytes}-byte blocks on each of {remote.tp_size} "
                f"ranks, ours are {self.block_nbytes} bytes on {self.tp_size}, yet the layout hashes match: the "
                f"hash misses a KV dimension"
            )
        if self._geometry.num_kv_heads % remote.tp_size:
            raise ValueError(
                f"peer {remote.agent_name!r} splits {self._geometry.num_kv_heads} KV heads over "
                f"{remote.tp_size} ranks"
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
            raise ValueError(
                f"NIXL rejected the metadata of peer {remote.agent_name!r}: {exc}"
            ) from exc
        # The binding returns the name as bytes.
        loaded_name = loaded_name.decode() if isinstance(loaded_name, bytes) else loaded_name
        if loaded_name != remote.agent_name:
            agent.remove_remote_agent(loaded_name)
            raise ValueError(
                f"state names agent {remote.agent_name!r} but its metadata is agent {loaded_name!r}"
            )
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
            raise KvTransferError(
                f"peer {name!r} has {num_running} transfers in flight; wait or abort them first"
            )
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
            raise UnknownPeerError(
                f"peer {peer_name!r} was not added (known: {sorted(self._peers)})"
            )
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

        plan = read_plan(
            remote_block_ids,
            local_block_ids,
            self._geometry,
            peer.tp_size,
            self.tp_size,
            self._max_run_blocks,
        )
        remote_pools, local_pools = (
            np.array(peer.rank_pools, dtype=np.uint64),
            np.array(self._local.rank_pools, dtype=np.uint64),
        )
        remote_descs = np.stack(
            [
                remote_pools[plan[:, 0], 0] + plan[:, 1].astype(np.uint64),
                plan[:, 4].astype(np.uint64),
                remote_pools[plan[:, 0], 1],
            ],
            axis=1,
        )
        local_descs = np.stack(
            [
                local_pools[plan[:, 2], 0] + plan[:, 3].astype(np.uint64),
                plan[:, 4].astype(np.uint64),
                local_pools[plan[:, 2], 1],
            ],
            axis=1,
        )
        num_bytes = int(plan[:, 4].sum())
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
        transfer = Transfer(agent, handle, peer_name, len(plan), num_bytes, self._in_flight.discard)
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


def _device_id(pool: torch.Tensor) -> int:
    return pool.device.index if pool.device.type == "cuda" else 0
