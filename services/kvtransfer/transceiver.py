"""KvTransceiver: moves KV blocks between workers with NIXL one-sided READs.

The decode worker pulls: it holds the prefill's state (agent metadata + pool
address), issues a READ of the prefill's blocks into its own, and NIXL delivers
the caller's notification to the prefill once the data has landed, which is the
prefill's cue to free the leased blocks.

The pool is one block-major tensor [num_blocks, num_layers, 2, block_size,
num_kv_heads, head_dim], so block b of every layer is one contiguous byte range
and a run of consecutive blocks is one contiguous range too: a request needs
one descriptor per run, not one per block and layer.

Each side's blocks are listed with NIXL once (`prep_xfer_dlist`, one descriptor per rank and
block: ours at open, a peer's at add_peer), so a READ is two index arrays for `make_prepped_xfer`,
which merges blocks adjacent on both sides into one descriptor itself, instead of descriptor
lists that NIXL checks and prepares again on every READ (`initialize_xfer`). That cut preparing
a READ 2-4x on CPU (bench/kv_read_prep.py); descriptors.py says when the per-READ lists are
still used.

A tensor-parallel worker registers every rank's pool with its one agent (rank 0 maps the
followers' pools, engine/kv_share.py) and its state lists them; a READ between workers of
different TP sizes moves head slices (head_slices.py).

Not thread-safe: one owner thread (the worker's engine thread) drives it.
"""

from __future__ import annotations

import logging

import torch
from nixl._api import nixl_agent, nixl_agent_config, nixl_prepped_dlist_handle, nixl_xfer_handle

from tandem.kvtransfer.descriptors import (
    block_descriptors,
    block_id_array,
    count_runs,
    plan_descriptors,
    prepped_indices,
)
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
        prepared_descriptors: bool = True,
    ):
        """`progress_thread`: NIXL's own UCX progress thread. With it, a READ completes
        whatever the peer is doing; without it, UCX progresses only inside
        Transfer.done() and poll_notifications(), and a READ completes only once the
        *target* also polls (measured: a 10 ms prefill poll loop gives every READ a
        10 ms floor). The price is a busy core per agent (1.0 CPU-s per s while idle),
        which on a host with ~2 cores starves memcpy; turn it off only where both
        sides poll tightly.

        `prepared_descriptors`: False builds every READ's descriptor lists anew (what a peer of
        another TP size, or a max_descriptor_bytes cut, always gets); bench/kv_read_prep.py
        compares the two.
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
        # Per peer: its blocks prepared with NIXL, or None where READs build descriptors each time.
        self._peer_dlists: dict[str, nixl_prepped_dlist_handle | None] = {}
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
        self._local_dlist: nixl_prepped_dlist_handle | None = None
        if prepared_descriptors and self._max_run_blocks is None:
            try:
                self._local_dlist = self._agent.prep_xfer_dlist(
                    "NIXL_INIT_AGENT",
                    block_descriptors(self._local.rank_pools, self.num_blocks, self.block_nbytes),
                    memory_type,
                )
            except NIXL_ERRORS as exc:
                # READs still work, each building its own lists as before prepared lists existed.
                logger.warning(
                    "preparing our KV pool's blocks with NIXL failed, READs build descriptors "
                    "each time: %s",
                    exc,
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
        self._peer_dlists[remote.agent_name] = self._prep_peer(agent, remote)
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
        _release(self._peer_dlists.pop(name, None))
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
        remote_ids = block_id_array("remote", remote_block_ids, peer.num_blocks)
        local_ids = block_id_array("local", local_block_ids, self.num_blocks)
        if len(set(local_block_ids)) != len(local_block_ids):
            raise ValueError("local block ids repeat: two reads into one block would race")
        if not remote_block_ids:
            if notify:
                agent.send_notif(peer_name, notify)
            return Transfer.completed(peer_name)

        remote_dlist = self._peer_dlists.get(peer_name)
        try:
            if remote_dlist is not None:
                handle = agent.make_prepped_xfer(
                    "READ",
                    self._local_dlist,
                    prepped_indices(local_ids, self.num_blocks, self.tp_size),
                    remote_dlist,
                    prepped_indices(remote_ids, peer.num_blocks, peer.tp_size),
                    notify,
                )
                num_descriptors = self.tp_size * count_runs(remote_ids, local_ids)
                num_bytes = len(local_ids) * self.tp_size * self.block_nbytes
            else:
                handle, num_descriptors, num_bytes = self._planned_xfer(
                    agent, peer, remote_block_ids, local_block_ids, notify
                )
        except NIXL_ERRORS as exc:
            raise TransferError(f"preparing READ from peer {peer_name!r} failed: {exc}") from exc
        transfer = Transfer(
            agent, handle, peer_name, num_descriptors, num_bytes, self._in_flight.discard
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
            _release(self._peer_dlists.pop(name, None))
            try:
                agent.remove_remote_agent(name)
            except NIXL_ERRORS as exc:
                logger.warning("removing peer %r on close failed: %s", name, exc)
        self._peers.clear()
        _release(self._local_dlist)
        self._local_dlist = None
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

    def _prep_peer(
        self, agent: nixl_agent, peer: TransceiverState
    ) -> nixl_prepped_dlist_handle | None:
        """The peer's blocks prepared with NIXL, or None where its READs build descriptors each
        time: another TP size moves head slices, not blocks."""
        if self._local_dlist is None or peer.tp_size != self.tp_size:
            return None
        try:
            return agent.prep_xfer_dlist(
                peer.agent_name,
                block_descriptors(peer.rank_pools, peer.num_blocks, peer.block_nbytes),
                peer.memory_type,
            )
        except (*NIXL_ERRORS, MemoryError, OverflowError, ValueError) as exc:
            # Its READs then fail (or not) exactly as they did before prepared lists existed.
            logger.warning(
                "preparing the blocks of peer %r failed, its READs build descriptors each time: %s",
                peer.agent_name,
                exc,
            )
            return None

    def _planned_xfer(
        self,
        agent: nixl_agent,
        peer: TransceiverState,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes,
    ) -> tuple[nixl_xfer_handle, int, int]:
        """A READ from read_plan's descriptors, built for this READ alone: (handle, descriptors,
        bytes)."""
        plan = read_plan(
            remote_block_ids,
            local_block_ids,
            self._geometry,
            peer.tp_size,
            self.tp_size,
            self._max_run_blocks,
        )
        remote_descs, local_descs = plan_descriptors(plan, peer.rank_pools, self._local.rank_pools)
        handle = agent.initialize_xfer(
            "READ",
            agent.get_xfer_descs(local_descs, self._local.memory_type),
            agent.get_xfer_descs(remote_descs, peer.memory_type),
            peer.agent_name,
            notify,
        )
        return handle, len(plan), int(plan[:, 4].sum())


def _release(dlist: nixl_prepped_dlist_handle | None) -> None:
    if dlist is None:
        return
    try:
        dlist.release()
    except NIXL_ERRORS as exc:
        logger.warning("releasing a prepared NIXL descriptor list failed: %s", exc)


def _device_id(pool: torch.Tensor) -> int:
    return pool.device.index if pool.device.type == "cuda" else 0
