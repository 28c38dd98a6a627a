"""The one thread that drives a transceiver's NIXL agent.

NIXL's agent is not thread-safe, and without its UCX progress thread a READ progresses only
while someone polls, on both sides. So one thread owns the agent: it runs the agent calls the
asyncio side asks for (add a peer, post a READ, send a notification), polls the READs in
flight and the notifications that arrive, and resolves asyncio futures on the loop. The gRPC
event loop never sleeps-and-polls.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tandem.kvtransfer.errors import TransferError, TransferTimeoutError
from tandem.kvtransfer.transceiver import KvTransceiver
from tandem.kvtransfer.transfer import Transfer

log = logging.getLogger("tandem.kvtransfer.poller")

# Poll back-off while READs are in flight: a late poll adds its whole sleep to the transfer
# (a 200 us cap cost 10% of a 1.4 ms GPU read on H200).
_READ_POLL_MAX_S = 2e-5
# While peers may be reading our blocks (tight) or nothing is going on (idle).
_TIGHT_POLL_S = 5e-4
_IDLE_POLL_S = 2e-2


@dataclass(frozen=True)
class ReadDone:
    """What a finished READ moved, and how long it ran: from its posting to the poll that found it
    done (the poller polls every 20 us while READs run)."""

    nbytes: int
    seconds: float


@dataclass
class PendingRead:
    """A READ posted by the poller. done resolves to its ReadDone (or a TransferError);
    settled resolves once NIXL holds nothing of it any more, so its blocks may be reused."""

    done: asyncio.Future
    settled: asyncio.Future
    deadline: float
    transfer: Transfer | None = None
    abandon: bool = field(default=False)
    # Its id when the READ runs in an engine core process (worker/core_client.RemotePoller).
    read_id: int = 0
    # Called once it has landed, on the poller's thread, before the loop hears of it (a pull's
    # last READ tells the engine at once: decode/generation.pull_blocks).
    on_landed: Callable[[], None] | None = None


class TransferPoller:
    def __init__(
        self,
        transceiver: KvTransceiver,
        loop: asyncio.AbstractEventLoop,
        on_notification: Callable[[str, bytes], None] | None = None,
        on_tick: Callable[[float], bool] | None = None,
    ):
        """on_notification(peer, message) runs on the poller thread for each notification;
        on_tick(now) runs every round and says whether peers may be reading our blocks now
        (then the poller polls tightly, which their READs need to progress)."""
        self.transceiver = transceiver
        self.loop = loop
        self._on_notification = on_notification
        self._on_tick = on_tick
        self._calls: queue.Queue = queue.Queue()
        self._reads: list[PendingRead] = []
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="kv-poller", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        """Aborts the READs in flight and stops the thread (the caller closes the transceiver)."""
        self._stopping = True
        self._calls.put(None)
        self._thread.join(timeout=5)

    # -- the asyncio side --
    def call(self, fn: Callable[[KvTransceiver], Any]) -> asyncio.Future:
        """Runs fn(transceiver) on the poller thread; the future has its result."""
        future = self.loop.create_future()
        self._calls.put((fn, future))
        return future

    def add_peer(self, state: bytes) -> asyncio.Future:
        """Loads a peer's transceiver state (GetDataTransceiverState's bytes); the future has the
        TransceiverState."""
        return self.call(lambda transceiver: transceiver.add_peer(state))

    def read(
        self,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes,
        timeout_s: float,
        on_landed: Callable[[], None] | None = None,
    ) -> PendingRead:
        """Posts a READ of the peer's blocks into ours; the peer gets notify once it has landed,
        and on_landed (on this poller's thread, safe from any thread) is called then."""
        pending = PendingRead(
            self.loop.create_future(),
            self.loop.create_future(),
            time.monotonic() + timeout_s,
            on_landed=on_landed,
        )

        def post(transceiver: KvTransceiver) -> None:
            pending.transfer = transceiver.read_blocks(
                peer_name, remote_block_ids, local_block_ids, notify
            )
            self._reads.append(pending)

        def failed(future: asyncio.Future) -> None:
            if future.exception() is not None:  # nothing was posted: nothing to settle
                _resolve(pending.done, exc=future.exception())
                _resolve(pending.settled, True)

        self.call(post).add_done_callback(failed)
        return pending

    async def settle(self, pending: PendingRead, timeout_s: float = 2.0) -> None:
        """Waits until a READ holds nothing of our blocks, aborting it after timeout_s."""
        try:
            await asyncio.wait_for(asyncio.shield(pending.settled), timeout_s)
        except asyncio.TimeoutError:
            log.warning("a KV READ did not settle in %.1f s; aborting it", timeout_s)
            pending.abandon = True
            await asyncio.shield(pending.settled)

    # -- the poller thread --
    def _run(self) -> None:
        while not self._stopping:
            try:
                self._round()
            except Exception:  # noqa: BLE001 - the poller must outlive one bad round
                log.exception("KV transfer poller")
                time.sleep(_TIGHT_POLL_S)
        for pending in self._reads:
            pending.transfer.abort()
            if not self.loop.is_closed():
                self._finish(pending, TransferError("the transceiver is closing"))
        while True:  # what was asked but not run (a READ not posted, a peer not added)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                break
            if item is not None and not self.loop.is_closed():
                self.loop.call_soon_threadsafe(
                    _resolve, item[1], None, TransferError("the transceiver is closing")
                )

    def _round(self) -> None:
        self._poll_reads()
        if self._on_notification is not None:
            for peer, message in self.transceiver.poll_notifications():
                self._on_notification(peer, message)
        tight = self._on_tick(time.time()) if self._on_tick is not None else False
        if self._reads:
            self._run_calls(block_s=0.0)
            time.sleep(_READ_POLL_MAX_S)
        else:
            self._run_calls(block_s=_TIGHT_POLL_S if tight else _IDLE_POLL_S)

    def _run_calls(self, block_s: float) -> None:
        try:
            item = self._calls.get(timeout=block_s) if block_s else self._calls.get_nowait()
        except queue.Empty:
            return
        while item is not None:
            fn, future = item
            try:
                result = fn(self.transceiver)
            except Exception as exc:  # noqa: BLE001 - reported to the caller
                self.loop.call_soon_threadsafe(_resolve, future, None, exc)
            else:
                self.loop.call_soon_threadsafe(_resolve, future, result)
            try:
                item = self._calls.get_nowait()
            except queue.Empty:
                return

    def _poll_reads(self) -> None:
        now = time.monotonic()
        still = []
        for pending in self._reads:
            try:
                if pending.transfer.done():
                    self._finish(pending, None)
                    continue
            except TransferError as exc:
                self._finish(pending, exc)
                continue
            if pending.abandon or now > pending.deadline:
                pending.transfer.abort()
                self._finish(
                    pending,
                    TransferTimeoutError(
                        f"KV READ from {pending.transfer.peer_name!r} ({pending.transfer.nbytes} bytes) "
                        f"did not finish in time"
                    ),
                )
                continue
            still.append(pending)
        self._reads = still

    def _finish(self, pending: PendingRead, error: BaseException | None) -> None:
        if error is None and pending.on_landed is not None:
            try:
                pending.on_landed()
            except Exception:  # noqa: BLE001 - the READ still resolves
                log.exception("a landed READ's callback failed")
        if error is None:
            transfer = pending.transfer
            self.loop.call_soon_threadsafe(
                _resolve, pending.done, ReadDone(transfer.nbytes, transfer.seconds)
            )
        else:
            self.loop.call_soon_threadsafe(_resolve, pending.done, None, error)
        self.loop.call_soon_threadsafe(_resolve, pending.settled, True)


def _resolve(future: asyncio.Future, value=None, exc: BaseException | None = None) -> None:
    if future.done():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(value)
