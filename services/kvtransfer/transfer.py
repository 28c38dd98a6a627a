"""Transfer: the handle of one in-flight NIXL READ, polled by its owner thread."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from nixl import _bindings as nixl_bindings
from nixl._api import nixl_agent, nixl_xfer_handle

from tandem.kvtransfer.errors import TransferError, TransferTimeoutError

logger = logging.getLogger(__name__)

# Every binding error derives straight from Exception; catching this tuple keeps
# programming errors (TypeError, ...) out of the NIXL error path.
NIXL_ERRORS = tuple(
    getattr(nixl_bindings, name)
    for name in dir(nixl_bindings)
    if name.startswith("nixl") and name.endswith("Error")
)
# A late poll adds its whole sleep to the transfer time: on a 1.4 ms GPU read a
# 200 us back-off cap cost 10% of the bandwidth (measured on 2x H200).
_MAX_POLL_SLEEP_S = 2e-5


class Transfer:
    """One in-flight READ; releases its NIXL handle as soon as it finishes."""

    def __init__(
        self,
        agent: nixl_agent | None,
        handle: nixl_xfer_handle | None,
        peer_name: str,
        num_descriptors: int,
        nbytes: int,
        on_finish: Callable[[Transfer], None] | None = None,
    ):
        self._agent = agent
        self._handle = handle
        self._on_finish = on_finish
        self._error: TransferError | None = None
        self.peer_name = peer_name
        self.num_descriptors = num_descriptors
        self.nbytes = nbytes
        self.posted_at = time.perf_counter()
        # Seconds from posting to the poll that found it finished (None while it runs).
        self.seconds: float | None = None if handle is not None else 0.0

    @classmethod
    def completed(cls, peer_name: str) -> Transfer:
        return cls(None, None, peer_name, num_descriptors=0, nbytes=0)

    def done(self) -> bool:
        """True once the data is in the local blocks; raises TransferError on failure."""
        if self._handle is None:
            if self._error is not None:
                raise self._error
            return True
        try:
            state = self._agent.check_xfer_state(self._handle)
        except NIXL_ERRORS as exc:
            state = f"ERR ({type(exc).__name__})"
        if state == "PROC":
            return False
        self._finish()
        if state != "DONE":
            self._error = TransferError(
                f"NIXL READ from peer {self.peer_name!r} ({self.num_descriptors} descriptors, "
                f"{self.nbytes} bytes) failed: state {state}"
            )
            raise self._error
        return True

    def wait(self, timeout_s: float) -> None:
        """Block until done; TransferTimeoutError if it is still running at the deadline."""
        deadline = time.monotonic() + timeout_s
        # Spin first: small transfers finish in microseconds and a sleep would
        # dominate their latency; back off so a long one does not burn a core.
        sleep_s = 0.0
        while not self.done():
            if time.monotonic() >= deadline:
                raise TransferTimeoutError(
                    f"READ from peer {self.peer_name!r} ({self.nbytes} bytes) not done after {timeout_s} s"
                )
            if sleep_s:
                time.sleep(sleep_s)
            sleep_s = min(max(2 * sleep_s, 1e-5), _MAX_POLL_SLEEP_S)

    def abort(self) -> None:
        """Release the handle now; NIXL cancels the transfer if it is still running."""
        if self._handle is not None:
            self._finish()
            self._error = TransferError(f"READ from peer {self.peer_name!r} was aborted")

    def _finish(self) -> None:
        self.seconds = time.perf_counter() - self.posted_at
        handle, self._handle = self._handle, None
        try:
            self._agent.release_xfer_handle(handle)
        except NIXL_ERRORS as exc:
            # The handle object re-queues itself for release at agent teardown.
            logger.warning("releasing NIXL handle for peer %r failed: %s", self.peer_name, exc)
        if self._on_finish is not None:
            self._on_finish(self)


def settled(transfer: Transfer) -> bool:
    """Polls once; a failed transfer counts as settled: nothing of it is in flight."""
    try:
        return transfer.done()
    except TransferError:
        return True
