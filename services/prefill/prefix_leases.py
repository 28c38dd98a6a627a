"""The serving side of cross-worker prefix pulls (Worker/LeasePrefix): a peer about to run a
prompt whose prefix our prefix cache holds leases the leading blocks we still have, and pulls
them (decode/prefix_pull.py). The blocks are held in the engine (one more reference each, so
they can be neither reused nor evicted), under a lease of the one lease table (lease_keeper.py),
and come back by the same path as a handoff's: ConfirmLease after the peer's READ (or instead
of it), or expiry. The answer is a handoff in the same signed format as a context phase's,
bound to the leased prefix's tokens.

Blocks the host tier holds are copied up into fresh device blocks first (LLMEngine.lease_prefix):
the peer reads device memory only, since only the device pool is registered with NIXL.

Leased prefixes pin blocks until the peer confirms or the lease expires: together they may hold
at most max_fraction of the pool (--max-prefix-lease-kv-fraction). A lease that would pass it is
cut to what is left, before the engine looks (nothing at all once the share is held): a prefix
pull is an optimization, so the peer computes the rest, and this worker's own requests keep the
pool. A call counts the blocks it asks for while the engine looks (the blocks it gets may be
fewer), and a call whose caller went away keeps counting until its blocks are sent back.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable

from tandem.engine.messages import FreeBlocks, LeasePrefix
from tandem.kvtransfer.handoff import HandoffFormat
from tandem.prefill.lease_keeper import LeaseKeeper
from tandem.v1 import worker_pb2

# The longest prefix a peer may ask for, in tokens (checked before any work).
MAX_PREFIX_TOKENS = 1 << 16


class PrefixLeases:
    def __init__(
        self,
        core,
        keeper: LeaseKeeper,
        handoff_format: HandoffFormat,
        endpoint: str,
        agent_name: str,
        weights_id: Callable[[], str] = lambda: "",
        max_fraction: float = 0.25,
    ):
        self.core = core
        self.keeper = keeper
        self.handoff_format = handoff_format
        self.endpoint = endpoint
        self.agent_name = agent_name
        self.weights_id = weights_id
        self.num_opened = 0
        self.num_trimmed = 0  # calls cut short (or answered with nothing) by the share
        self.max_blocks = int(core.facts.limits.num_blocks * max_fraction)
        # The blocks of the leases opened here, by lease id, while they are out; and those that
        # calls the engine is looking at now may take (on the event loop: no lock needed).
        self._leased: dict[int, int] = {}
        self._reserved = 0

    async def lease(
        self,
        request: worker_pb2.LeasePrefixRequest,
        time_remaining: Callable[[], float | None],
        paused: Callable[[], bool] = lambda: False,
    ) -> worker_pb2.LeasePrefixResponse:
        """time_remaining: the call's (None: no deadline); a caller whose deadline passed while
        the engine looked is not waiting for a lease: none is opened. paused: whether the worker
        is paused now (no lease opens while it is)."""
        token_ids = list(request.token_ids)
        block_size = self.core.facts.limits.block_size
        if not token_ids or len(token_ids) % block_size or len(token_ids) > MAX_PREFIX_TOKENS:
            raise ValueError(
                f"LeasePrefix takes whole KV blocks of {block_size} tokens, 1 to "
                f"{MAX_PREFIX_TOKENS} tokens; got {len(token_ids)} tokens"
            )
        salt = request.cache_salt if request.HasField("cache_salt") else None
        room = self.max_blocks - self._num_leased_blocks() - self._reserved
        num_wanted = len(token_ids) // block_size
        if room < num_wanted:
            self.num_trimmed += 1
            if room <= 0:
                return worker_pb2.LeasePrefixResponse()
            token_ids = token_ids[: room * block_size]
            num_wanted = room
        # Counted against the share until the blocks are under a lease or on their way back.
        self._reserved += num_wanted
        try:
            future = self.core.submit(LeasePrefix(token_ids, salt))
        except BaseException:
            self._reserved -= num_wanted
            raise
        try:
            block_ids = await asyncio.shield(future)
        except asyncio.CancelledError:
            # The caller went away while the engine held the blocks: give them back once it has,
            # and only then this call's room (the blocks stay pinned until then).
            future.add_done_callback(lambda f: self._give_back(f, num_wanted))
            raise
        except BaseException:
            self._reserved -= num_wanted
            raise
        self._reserved -= num_wanted
        left = time_remaining()
        # A caller whose deadline passed, or a pause that began while the engine looked (it
        # ended every lease; none opens until it is over): the blocks go back.
        if block_ids and (left is not None and left <= 0 or paused()):
            self.core.send(FreeBlocks(block_ids))
            block_ids = []
        if not block_ids:
            return worker_pb2.LeasePrefixResponse()
        # No await between the engine's answer and the lease: every held block is under one.
        lease = self.keeper.open(None, block_ids)
        self.num_opened += 1
        self._leased[lease.lease_id] = len(block_ids)
        leased = token_ids[: len(block_ids) * block_size]
        return worker_pb2.LeasePrefixResponse(
            num_blocks=len(block_ids),
            opaque_state=self.handoff_format.build(
                self.endpoint,
                self.agent_name,
                lease.lease_id,
                lease.block_ids,
                lease.expires_at,
                leased,
                salt,
                None,
                self.weights_id(),
            ),
        )

    def _num_leased_blocks(self) -> int:
        """Blocks under the leases opened here that are still out (those that ended: dropped)."""
        for lease_id in [i for i in self._leased if not self.keeper.is_open(i)]:
            del self._leased[lease_id]
        return sum(self._leased.values())

    def _give_back(self, future: asyncio.Future, num_reserved: int) -> None:
        try:
            if not future.cancelled() and future.exception() is None and future.result():
                self.core.send(FreeBlocks(future.result()))
        finally:
            self._reserved -= num_reserved
