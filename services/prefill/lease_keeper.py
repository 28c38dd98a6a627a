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

from tandem.engine.engine_core import EngineCore
from tandem.engine.messages import FreeBlocks, Lease

log = logging.getLogger("tandem.prefill.leases")

# A lease's blocks are freed this long after the expiry its handoff announces: a decode that
# started its READ just inside the announced time (it needs a second of lease left to start)
# still reads blocks nobody else owns.
EXPIRY_GRACE_S = 1.0


class LeaseEnd(enum.Enum):
    PULLED = "pulled"            # the decode's READ landed and it confirmed the lease (ConfirmLease)
    FALLBACK = "fallback"        # the decode computes the prompt itself (ConfirmLease, not pulled)
    RELEASED = "released"        # ReleaseKv (the router, once the request is over)
    UNDELIVERED = "undelivered"  # the handoff never reached whoever asked for it
    STOPPED = "stopped"          # a stop string ended the request on its first token
    PAUSED = "paused"            # pause_generation
    EXPIRED = "expired"          # nobody released it in time (the decode side died or never came)


class LeaseKeeper:
    def __init__(self, lease_seconds: float):
        self.lease_seconds = lease_seconds
        self._lock = threading.Lock()
        self._leases: dict[int, Lease] = {}
        self._core: EngineCore | None = None
        # How leases ended, by LeaseEnd value (for stats, metrics and the tests).
        self.endings: Counter[str] = Counter()
        self.num_opened = 0
        self.num_ignored_notifications = 0

    def attach(self, core: EngineCore) -> None:
        """The engine thread that frees the blocks of ended leases."""
        self._core = core

    # -- the engine's LeaseTable --
    def open(self, request_id: str, block_ids: list[int]) -> Lease:
        # Unguessable ids: a lease id is all a release names.
        lease = Lease(secrets.randbits(62) + 1, list(block_ids), time.time() + self.lease_seconds)
        with self._lock:
            self._leases[lease.lease_id] = lease
            self.num_opened += 1
        return lease

    def abandon(self, lease_id: int) -> None:
        self.release(lease_id, LeaseEnd.UNDELIVERED)

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
        if lease is None:
            return False
        self._core.send(FreeBlocks(lease.block_ids))
        return True

    def release_all(self, reason: LeaseEnd) -> int:
        with self._lock:
            lease_ids = list(self._leases)
        return sum(self.release(lease_id, reason) for lease_id in lease_ids)

    def expire(self, now: float) -> bool:
        """Ends the leases past their time; returns whether any lease is still out."""
        with self._lock:
            expired = [i for i, lease in self._leases.items() if lease.expires_at + EXPIRY_GRACE_S <= now]
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
