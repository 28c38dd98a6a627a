"""The one lease table of a prefill worker.

A finished context phase leaves the engine with its KV blocks under a lease: the decode side
pulls them, then confirms the lease (Worker/ConfirmLease, over the authenticated internal
plane), and the blocks go back to the pool. Every way a lease can end goes through release()
here: pulled, the decode fell back to computing the prompt itself, the router's ReleaseKv,
the handoff never reached its caller, a stop string in the first token, pause_generation, or
expiry when nobody came. A lease ends once, and its blocks are reused only after it ended:
so a confirm that finds the lease live proves the decode's READ, done before it, read the
lease's KV. NIXL notifications end nothing: any agent that got hold of our metadata could
send them.

Handoffs that go back to a client (its context_only requests) may pin only part of the pool,
per client and all clients together, counted from admission (before the prompt runs) until
the lease ends: a client that never pulls cannot starve the requests of others. The router's
own splits are not counted (their handoffs go straight to a decode worker).

Thread-safe: leases open on the engine thread, notifications and expiry arrive on the KV
poller thread, RPCs on the event loop.
"""

from __future__ import annotations

import enum
import logging
import secrets
import threading
import time
from collections import Counter
from dataclasses import dataclass

from tandem.common.exceptions import RetryLaterError
from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import FreeBlocks, Lease

log = logging.getLogger("tandem.prefill.leases")

# A lease's blocks are freed this long after the expiry its handoff announces: a decode that
# started its READ just inside the announced time (it needs a second of lease left to start)
# still reads blocks nobody else owns.
EXPIRY_GRACE_S = 1.0


class LeaseEnd(enum.Enum):
    PULLED = "pulled"  # the decode's READ landed and it confirmed the lease (ConfirmLease)
    FALLBACK = "fallback"  # the decode computes the prompt itself (ConfirmLease, not pulled)
    RELEASED = "released"  # ReleaseKv (the router, once the request is over)
    UNDELIVERED = "undelivered"  # the handoff never reached whoever asked for it
    STOPPED = "stopped"  # a stop string ended the request on its first token
    PAUSED = "paused"  # pause_generation
    EXPIRED = "expired"  # nobody released it in time (the decode side died or never came)


@dataclass
class Claim:
    """Blocks a client's handoff pins (or will, once its context phase ends)."""

    client: str
    num_blocks: int
    expires_at: float = float("inf")


class LeaseKeeper:
    def __init__(
        self,
        lease_seconds: float,
        max_unclaimed_fraction: float = 1.0,
        max_unclaimed_fraction_per_client: float = 1.0,
    ):
        self.lease_seconds = lease_seconds
        self.max_unclaimed_fraction = max_unclaimed_fraction
        self.max_unclaimed_fraction_per_client = max_unclaimed_fraction_per_client
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._core: EngineCore | None = None
        # How leases ended, by LeaseEnd value (for stats, metrics and the tests).
        self.endings: Counter[str] = Counter()
        self.num_opened = 0
        self.num_ignored_notifications = 0
        # Clients' handoffs: by request id while the context phase runs, then by lease id.
        self._admitted: dict[str, Claim] = {}
        self._claimed: dict[int, Claim] = {}
        self._held: Counter[str] = Counter()
        self.num_refused = 0
        # The router's own splits: request id -> its disagg_request_id while the context phase
        # runs, then the lease's id by it. The router releases by that id a handoff whose reply it
        # lost (cancelled after the context phase ended, before the reply was read).
        self._split_ids: dict[str, int] = {}
        self._split_leases: dict[int, int] = {}
        self._split_of_lease: dict[int, int] = {}

    def attach(self, core: EngineCore) -> None:
        """The engine thread that frees the blocks of ended leases."""
        self._core = core

    # -- clients' handoffs --
    def admit(self, request_id: str, client: str, num_prompt_tokens: int) -> None:
        """Counts a client's context phase against its share of the pool before it runs; refused
        (RetryLaterError) when the client's, or all clients', unclaimed handoffs would pin more."""
        limits = self._core.facts.limits
        num_blocks = limits.num_blocks_for(num_prompt_tokens + 1)
        per_client = int(limits.num_blocks * self.max_unclaimed_fraction_per_client)
        overall = int(limits.num_blocks * self.max_unclaimed_fraction)
        with self._lock:
            if self._held[client] + num_blocks > per_client:
                who, limit, mine = "this client's", per_client, True
            elif sum(self._held.values()) + num_blocks > overall:
                who, limit, mine = "all clients'", overall, False
            else:
                self._admitted[request_id] = Claim(client, num_blocks)
                self._held[client] += num_blocks
                return
            expiries = [
                c.expires_at for c in self._claimed.values() if not mine or c.client == client
            ]
            self.num_refused += 1
        retry_after = min(expiries, default=time.time() + 1.0) + EXPIRY_GRACE_S - time.time()
        raise RetryLaterError(
            f"context_only handoffs not yet pulled would pin more than {limit} of the "
            f"{limits.num_blocks} KV blocks ({who} share): pull or release them first",
            max(0.1, min(retry_after, self.lease_seconds + EXPIRY_GRACE_S)),
        )

    def expect_split(self, request_id: str, disagg_request_id: int) -> None:
        """A context phase of the router's own split: its lease is also released by disagg_request_id."""
        with self._lock:
            self._split_ids[request_id] = disagg_request_id

    def forget(self, request_id: str) -> None:
        """The request ended without a handoff (finished in its context phase, aborted, failed)."""
        with self._lock:
            self._split_ids.pop(request_id, None)
            claim = self._admitted.pop(request_id, None)
            if claim is not None:
                self._unhold(claim)

    def _unhold(self, claim: Claim) -> None:
        self._held[claim.client] -= claim.num_blocks
        if self._held[claim.client] <= 0:
            del self._held[claim.client]

    # -- the engine's LeaseTable --
    def open(self, request_id: str | None, block_ids: list[int]) -> Lease:
        """A lease over block_ids for the request request_id's handoff (its client's claim and the
        router's split id follow it), or for none (None: a prefix leased to a peer, which no
        request's id may name)."""
        # Unguessable ids: a lease id is all a release names.
        lease = Lease(secrets.randbits(62) + 1, list(block_ids), time.time() + self.lease_seconds)
        with self._lock:
            self._leases[lease.lease_id] = lease
            self.num_opened += 1
            if request_id is None:
                return lease
            disagg_request_id = self._split_ids.pop(request_id, None)
            if disagg_request_id is not None:
                self._split_leases[disagg_request_id] = lease.lease_id
                self._split_of_lease[lease.lease_id] = disagg_request_id
            claim = self._admitted.pop(request_id, None)
            if claim is not None:
                claim.expires_at = lease.expires_at
                self._claimed[lease.lease_id] = claim
        return lease

    def abandon(self, lease_id: int) -> None:
        self.release(lease_id, LeaseEnd.UNDELIVERED)

    def is_open(self, lease_id: int) -> bool:
        return lease_id in self._leases

    @property
    def num_leases(self) -> int:
        return len(self._leases)

    @property
    def num_leased_blocks(self) -> int:
        with self._lock:
            return sum(len(lease.block_ids) for lease in self._leases.values())

    # -- ending leases --
    def release(self, lease_id: int, reason: LeaseEnd) -> bool:
        """Ends a lease; False when no lease has that id (ended already, or never ours)."""
        with self._lock:
            lease = self._leases.pop(lease_id, None)
            if lease is not None:
                self.endings[reason.value] += 1
                disagg_request_id = self._split_of_lease.pop(lease_id, None)
                if disagg_request_id is not None:
                    del self._split_leases[disagg_request_id]
            claim = self._claimed.pop(lease_id, None)
            if claim is not None:
                self._unhold(claim)
        if lease is None:
            return False
        self._core.send(FreeBlocks(lease.block_ids))
        return True

    def release_split(self, disagg_request_id: int, reason: LeaseEnd) -> bool:
        """Ends the lease of the router's split with that disagg_request_id; False when none is out."""
        with self._lock:
            lease_id = self._split_leases.get(disagg_request_id)
        return lease_id is not None and self.release(lease_id, reason)

    def release_all(self, reason: LeaseEnd) -> int:
        with self._lock:
            lease_ids = list(self._leases)
        return sum(self.release(lease_id, reason) for lease_id in lease_ids)

    def expire(self, now: float) -> bool:
        """Ends the leases past their time; returns whether any lease is still out."""
        with self._lock:
            expired = [
                i for i, lease in self._leases.items() if lease.expires_at + EXPIRY_GRACE_S <= now
            ]
        for lease_id in expired:
            self.release(lease_id, LeaseEnd.EXPIRED)
        return bool(self._leases)

    def confirm(self, lease_id: int, pulled: bool) -> bool:
        """A decode worker's ConfirmLease: whether the lease was live, ending it in the same step."""
        return self.release(lease_id, LeaseEnd.PULLED if pulled else LeaseEnd.FALLBACK)

    def on_notification(self, peer: str, message: bytes) -> None:
        """NIXL notifications are counted and dropped: nobody is authenticated on that channel."""
        self.num_ignored_notifications += 1
        log.debug("ignored NIXL notification from %s: %r", peer, message[:64])
