"""Typed errors of the KV transfer path.

Each one subclasses the builtin a caller would naturally catch (ValueError for
bad input, TimeoutError for a deadline) so that a servicer can map it to a gRPC
status without knowing this module: a layout mismatch becomes
FAILED_PRECONDITION, never a bare INTERNAL.
"""


class KvTransferError(Exception):
    """Base of every error raised by tandem.kvtransfer."""


class LayoutMismatchError(KvTransferError, ValueError):
    """The peer's KV layout (model, dtype, shape, block size) differs from ours."""

    def __init__(self, local_hash: str, remote_hash: str, peer_name: str):
        self.local_hash = local_hash
        self.remote_hash = remote_hash
        self.peer_name = peer_name
        super().__init__(
            f"KV layout of peer {peer_name!r} is {remote_hash!r}, ours is {local_hash!r}: "
            "the two workers do not serve the same model/KV layout"
        )


class UnknownPeerError(KvTransferError, LookupError):
    """A transfer names a peer that was never added (or was removed)."""


class TransferError(KvTransferError, RuntimeError):
    """NIXL reported a failure while posting or progressing a transfer."""


class TransferTimeoutError(TransferError, TimeoutError):
    """A transfer did not complete within the caller's deadline."""


class TransceiverClosedError(KvTransferError, RuntimeError):
    """The transceiver was closed; no further transfers are possible."""
