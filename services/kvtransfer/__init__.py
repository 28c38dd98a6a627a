"""KV cache transfer between prefill and decode workers over NIXL (decode pulls with READ)."""

from tandem.kvtransfer.errors import (
    KvTransferError,
    LayoutMismatchError,
    TransceiverClosedError,
    TransferError,
    TransferTimeoutError,
    UnknownPeerError,
)
from tandem.kvtransfer.handoff import HandoffFormat
from tandem.kvtransfer.poller import PendingRead, ReadDone, TransferPoller
from tandem.kvtransfer.state import FORMAT_VERSION, TransceiverState
from tandem.kvtransfer.transceiver import KvTransceiver, coalesce_runs
from tandem.kvtransfer.transfer import Transfer

__all__ = [
    "FORMAT_VERSION",
    "HandoffFormat",
    "PendingRead",
    "ReadDone",
    "TransferPoller",
    "KvTransceiver",
    "KvTransferError",
    "LayoutMismatchError",
    "TransceiverClosedError",
    "TransceiverState",
    "Transfer",
    "TransferError",
    "TransferTimeoutError",
    "UnknownPeerError",
    "coalesce_runs",
]
