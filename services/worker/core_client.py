"""The IO process's handle on an engine core in a process of its own (worker/core_process.py):
the interface of engine_core.EngineCore (add_request, register, abort, send, submit/call,
facts, weights, the stats and KV-event buffers), over two ZeroMQ IPC sockets.

When the core process dies, every request it held fails UNAVAILABLE (the router moves its
stream to another worker with the tokens so far), every call in flight fails, and on_death
runs: the worker goes NOT_SERVING and exits non-zero (its supervisor or Kubernetes restarts it).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import zmq
import zmq.asyncio

from tandem.common.errors import unavailable
from tandem.engine import wire
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import JsonBuffer, LeaseTable
from tandem.engine.messages import (
    AddRequest,
    EngineFailure,
    FreeBlocks,
    ReleaseMemory,
    ResumeMemory,
    StepOutput,
    WeightsInfo,
)
from tandem.kvtransfer.poller import PendingRead, ReadDone
from tandem.kvtransfer.state import TransceiverState
from tandem.worker.core_protocol import (
    AbandonRead,
    Abort,
    AddPeer,
    Failed,
    GuideInfo,
    KvEvents,
    LoadWeights,
    Notification,
    Outputs,
    PostRead,
    ReadFinished,
    ReadSettled,
    Ready,
    Register,
    Reply,
    Start,
    StartTransceiver,
    Stats,
    Stop,
    StopTransceiver,
    TransceiverInfo,
    TrimMemory,
    Undelivered,
    WriteWeights,
)

log = logging.getLogger("tandem.worker")

# How often the lease table's expiry runs (the in-process poller ticks every 0.5-20 ms).
_EXPIRY_TICK_S = 0.01
# How long the core may take to stop (its engine thread and tensor-parallel ranks) before a kill.
STOP_TIMEOUT_S = 10.0


class RemoteEngineCore:
    """Built by spawn(); the IO side of one engine core process."""

    def __init__(self, loop, process, context, inbox, outbox, directory, ready: Ready):
        self.loop = loop
        self.process = process
        self._context, self._inbox, self._outbox = context, inbox, outbox
        self._directory = directory
        self.pid = ready.pid
        self.facts = ready.facts
        self.weights: WeightsInfo = ready.weights
        self.released_tags: list[str] = ready.released_tags
        self.warmup_s = ready.warmup_s
        self.iteration_stats = JsonBuffer(1000)
        self.kv_events = JsonBuffer(10000)
        self.on_stats: Callable[[dict], None] | None = None
        self.on_kv_events: Callable[[list[dict]], None] | None = None
        self.on_death: Callable[[str], None] | None = None
        self.leases: LeaseTable | None = None
        self._streams: dict[str, asyncio.Queue] = {}
        self._calls: dict[int, tuple[asyncio.Future, Any]] = {}
        self._tags = itertools.count(1)
        self._closing = False
        self._guide_info_sent = False
        self._reader: asyncio.Task | None = None
        self._watcher: asyncio.Task | None = None
        self._reads: dict[int, PendingRead] = {}
        self._read_ids = itertools.count(1)
        self._expiry: asyncio.Task | None = None
        self._reaping: asyncio.Future | None = None
        # The lease table's NIXL notifications (on the loop here; on the poller thread in-process).
        self.on_notification: Callable[[str, bytes], None] | None = None

    @classmethod
    async def spawn(
        cls, config: EngineConfig, hands_off: bool, adapter_capacity: int = 0
    ) -> RemoteEngineCore:
        """Starts the core process, hands it the config and waits until it has loaded and warmed
        up its engine (a failure there is raised here, with the core's own message)."""
        loop = asyncio.get_running_loop()
        directory = tempfile.mkdtemp(prefix="tandem-core-")  # 0700: only this user connects
        inbox_address = f"ipc://{directory}/commands"
        outbox_address = f"ipc://{directory}/outputs"
        context = zmq.asyncio.Context()
        inbox, outbox = context.socket(zmq.PUSH), context.socket(zmq.PULL)
        inbox.bind(inbox_address)
        outbox.bind(outbox_address)
        process = None
        try:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "tandem.worker.core_process",
                "--inbox",
                inbox_address,
                "--outbox",
                outbox_address,
                "--parent",
                str(os.getpid()),
                env=dict(os.environ),
            )
            inbox.send(wire.encode(Start(config, hands_off, adapter_capacity)))
            message = await _first_frame(outbox, process)
            if isinstance(message, Failed):
                raise RuntimeError(f"the engine core failed to start: {message.error}")
        except BaseException:
            if process is not None and process.returncode is None:
                process.kill()
                await process.wait()
            context.destroy(linger=0)
            shutil.rmtree(directory, ignore_errors=True)
            raise
        core = cls(loop, process, context, inbox, outbox, directory, message)
        core._reader = asyncio.ensure_future(core._read())
        core._reader.add_done_callback(core._reader_ended)
        core._watcher = asyncio.ensure_future(core._watch())
        return core

    # -- EngineCore's interface --
    def start(self) -> None:
        """The core process runs from spawn() on."""

    @property
    def num_active(self) -> int:
        return len(self._streams)

    def add_request(self, command: AddRequest, stream: asyncio.Queue) -> None:
        self.register_local(command.request_id, stream)
        self._send(command)

    def register_local(self, request_id: str, stream: asyncio.Queue) -> None:
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running on this worker")
        self._streams[request_id] = stream

    def register(self, request_id: str, stream: asyncio.Queue) -> None:
        self.register_local(request_id, stream)
        self._send(Register(request_id))

    def abort(self, request_id: str) -> bool:
        known = self._streams.pop(request_id, None) is not None
        self._send(Abort(request_id))
        return known

    def send(self, command) -> None:
        """Safe from any thread, as EngineCore.send (the lease keeper's expiry may run off the loop)."""
        if self.loop.is_closed():
            return
        try:
            running = asyncio.get_running_loop() is self.loop
        except RuntimeError:
            running = False
        if running:
            self._send(command)
        else:
            self.loop.call_soon_threadsafe(self._send, command)

    def submit(self, command) -> asyncio.Future:
        return self._call(command)

    async def call(self, command) -> Any:
        return await self._call(command)

    async def load_weights(self, path: str, fingerprint: str) -> WeightsInfo:
        self.weights = await self._call(LoadWeights(path, fingerprint))
        return self.weights

    async def write_weights(self, kind: str, payload) -> None:
        await self._call(WriteWeights(kind, payload))

    async def start_transceiver(self, agent_name: str, progress_thread: bool) -> RemotePoller:
        """The NIXL agent over the core's KV pool, in the core; the poller that reaches it."""
        info: TransceiverInfo = await self._call(StartTransceiver(agent_name, progress_thread))
        if self.leases is not None and self._expiry is None:
            self._expiry = asyncio.ensure_future(self._expire_leases())
        return RemotePoller(self, RemoteTransceiver(info))

    async def _expire_leases(self) -> None:
        """The lease table's clock (the poller thread's tick, in-process)."""
        while True:
            try:
                self.leases.expire(time.time())
            except Exception:  # noqa: BLE001 - the clock must keep ticking
                log.exception("lease expiry")
            await asyncio.sleep(_EXPIRY_TICK_S)

    async def trim_memory(self, ipc: bool = False) -> None:
        """In the core, where the memory was freed (or the handles opened)."""
        await self._call(TrimMemory(ipc))

    def send_guide_info(self, tokenizer_info: str) -> None:
        """The tokenizer's xgrammar TokenizerInfo, once, before the first compiled guide."""
        if not self._guide_info_sent:
            self._guide_info_sent = True
            self._send(GuideInfo(tokenizer_info))

    def close(self) -> None:
        """Stops the core (Stop, then a kill after STOP_TIMEOUT_S) and lets go of the sockets."""
        if self._reaping is None:
            self._reaping = asyncio.ensure_future(self._reap())

    async def aclose(self) -> None:
        self.close()
        await self._reaping

    async def _reap(self) -> None:
        self._closing = True
        if self.process.returncode is None:
            try:
                self._inbox.send(wire.encode(Stop()), flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                await asyncio.wait_for(self.process.wait(), STOP_TIMEOUT_S)
            except asyncio.TimeoutError:
                self.process.kill()
                await self.process.wait()
        for task in (self._reader, self._watcher, self._expiry):
            if task is not None and task is not asyncio.current_task():
                task.cancel()
        self._fail_pending(unavailable("the worker is stopping"))
        if not self._context.closed:
            self._context.destroy(linger=0)
        shutil.rmtree(self._directory, ignore_errors=True)

    # -- frames --
    @property
    def _gone(self) -> bool:
        return self.process.returncode is not None or self._context.closed

    def _send(self, obj, tag: int = 0) -> None:
        """Sends a frame; once the core is gone, nothing (what waits on it fails with its end)."""
        frame = wire.encode(obj, tag)
        if not self._gone:
            self._inbox.send(frame, copy=False)

    def _call(self, command) -> asyncio.Future:
        future = self.loop.create_future()
        if self._gone:
            future.set_exception(unavailable("the engine core process is gone"))
            return future
        tag = next(self._tags)
        try:
            frame = wire.encode(command, tag)
        except Exception as exc:  # noqa: BLE001 - the caller's error, as an answer would be
            future.set_exception(exc)
            return future
        self._calls[tag] = (future, command)
        self._inbox.send(frame, copy=False)
        return future

    async def _read(self) -> None:
        while True:
            frame = await self._outbox.recv()
            try:
                self._take(*wire.decode(frame))
            except Exception:  # noqa: BLE001 - one bad frame or callback must not stop the rest
                log.exception("a frame from the engine core failed")

    def _reader_ended(self, task: asyncio.Task) -> None:
        """The reader stops only when the worker closes; otherwise nothing would reach any
        request again: the core is taken down, and its end runs as a death."""
        if self._closing or task.cancelled():
            return
        log.error("the engine core's reader ended (%r): stopping the core", task.exception())
        if self.process.returncode is None:
            self.process.kill()

    def _take(self, message, tag: int) -> None:
        if isinstance(message, Outputs):
            for request_id, kind, payload in message.items:
                try:
                    self._put(request_id, wire.unpack(kind, payload))
                except Exception:  # noqa: BLE001 - the other requests' outputs still go
                    log.exception("the engine core's output for %s failed", request_id)
        else:
            self._take_other(message, tag)

    def _take_other(self, message, tag: int) -> None:
        if isinstance(message, Reply):
            self._reply(tag, message)
        elif isinstance(message, Stats):
            self.iteration_stats.push([message.record])
            if self.on_stats is not None:
                self.on_stats(message.record)
        elif isinstance(message, KvEvents):
            self.kv_events.push(message.events)
            if self.on_kv_events is not None:
                self.on_kv_events(message.events)
        elif isinstance(message, Undelivered):
            self._undelivered(message.request_id, message.block_ids)
        elif isinstance(message, ReadFinished):
            self._read_finished(message)
        elif isinstance(message, ReadSettled):
            pending = self._reads.pop(message.read_id, None)
            if pending is not None and not pending.settled.done():
                pending.settled.set_result(True)
        elif isinstance(message, Notification):
            if self.on_notification is not None:
                self.on_notification(message.peer, message.message)

    def _put(self, request_id: str, item) -> None:
        """As EngineCore._put, on the IO side: the lease table opens a handoff's lease here."""
        stream = self._streams.get(request_id)
        kept = item.kept_block_ids if isinstance(item, StepOutput) else None
        if kept is not None and self.leases is not None:
            item.lease = self.leases.open(request_id, kept)
        if stream is None:  # aborted meanwhile: nobody takes the handoff, its blocks go back
            if kept is not None:
                self._undelivered_lease(item)
            return
        if isinstance(item, EngineFailure) or item.finished:
            self._streams.pop(request_id, None)
        stream.put_nowait(item)

    def _read_finished(self, message: ReadFinished) -> None:
        pending = self._reads.get(message.read_id)
        if pending is None or pending.done.done():
            return
        if message.error is not None:
            pending.done.set_exception(message.error)
        else:
            pending.done.set_result(ReadDone(message.nbytes, message.seconds))

    def _undelivered_lease(self, item: StepOutput) -> None:
        if item.lease is not None:
            self.leases.abandon(item.lease.lease_id)
        else:
            self._send(FreeBlocks(item.kept_block_ids))

    def _undelivered(self, request_id: str, block_ids: list[int]) -> None:
        """The core dropped a handoff's output (its request was aborted there first)."""
        if self.leases is None:
            self._send(FreeBlocks(block_ids))
            return
        self.leases.abandon(self.leases.open(request_id, block_ids).lease_id)

    def _reply(self, tag: int, reply: Reply) -> None:
        future, command = self._calls.pop(tag, (None, None))
        if future is None or future.done():
            return
        if not reply.ok:
            future.set_exception(reply.value)
            return
        value = wire.unpack(*reply.value)
        if isinstance(command, (ReleaseMemory, ResumeMemory)):
            self.released_tags = value
        elif isinstance(value, WeightsInfo):
            self.weights = value
        future.set_result(value)

    async def _watch(self) -> None:
        """The core's exit: what it held fails, the worker is told (on_death)."""
        code = await self.process.wait()
        if self._closing:
            return
        why = f"the engine core process (pid {self.pid}) exited with {code}"
        log.error("%s: failing its %d request(s)", why, len(self._streams))
        try:
            self._fail_pending(unavailable(f"{why}; the worker is going away"))
        finally:
            if self.on_death is not None:
                self.on_death(why)

    def _fail_pending(self, error: BaseException) -> None:
        """Every request, call and READ waiting on the core ends with error."""
        streams, self._streams = self._streams, {}
        for request_id, stream in streams.items():
            try:
                stream.put_nowait(EngineFailure(error))
            except Exception:  # noqa: BLE001 - the others must end too
                log.exception("failing request %s", request_id)
        reads, self._reads = self._reads, {}
        for pending in reads.values():
            if not pending.done.done():
                pending.done.set_exception(error)
            if not pending.settled.done():
                pending.settled.set_result(True)
        calls, self._calls = self._calls, {}
        for future, _ in calls.values():
            if not future.done():
                future.set_exception(error)


class RemoteTransceiver:
    """What the IO side reads of the core's transceiver (fixed while it runs)."""

    def __init__(self, info: TransceiverInfo):
        self._state = info.state
        self.local_state = TransceiverState.from_bytes(info.state)
        self.agent_name = self.local_state.agent_name
        self.block_nbytes = info.block_nbytes

    def get_state(self) -> bytes:
        return self._state

    def close(self) -> None:
        """The core closes it (StopTransceiver)."""


class RemotePoller:
    """kvtransfer.poller.TransferPoller's interface, for a transceiver in the core process."""

    def __init__(self, core: RemoteEngineCore, transceiver: RemoteTransceiver):
        self.core = core
        self.transceiver = transceiver
        self.loop = core.loop

    def start(self) -> None:
        """The core started its poller with the transceiver."""

    def stop(self) -> None:
        """The core aborts the READs in flight and closes the agent (in order with what follows)."""
        self.core._send(StopTransceiver())

    def add_peer(self, state: bytes) -> asyncio.Future:
        return self.core._call(AddPeer(state))

    def read(
        self,
        peer_name: str,
        remote_block_ids: list[int],
        local_block_ids: list[int],
        notify: bytes,
        timeout_s: float,
        on_landed: Callable[[], None] | None = None,
    ) -> PendingRead:
        """As TransferPoller.read; on_landed is called on the loop when the core says it landed."""
        read_id = next(self.core._read_ids)
        pending = PendingRead(
            self.loop.create_future(),
            self.loop.create_future(),
            time.monotonic() + timeout_s,
            read_id=read_id,
        )
        if on_landed is not None:
            pending.done.add_done_callback(
                lambda done: (
                    on_landed() if not done.cancelled() and done.exception() is None else None
                )
            )
        self.core._reads[read_id] = pending
        self.core._send(
            PostRead(
                read_id,
                peer_name,
                list(remote_block_ids),
                list(local_block_ids),
                notify,
                timeout_s,
            )
        )
        return pending

    async def settle(self, pending: PendingRead, timeout_s: float = 2.0) -> None:
        """As TransferPoller.settle: waits until the READ holds nothing of our blocks, aborting it
        (in the core) after timeout_s."""
        try:
            await asyncio.wait_for(asyncio.shield(pending.settled), timeout_s)
        except asyncio.TimeoutError:
            log.warning("a KV READ did not settle in %.1f s; aborting it", timeout_s)
            self.core._send(AbandonRead(pending.read_id))
            await asyncio.shield(pending.settled)


async def _first_frame(outbox: zmq.asyncio.Socket, process) -> Any:
    """The core's first frame (Ready or Failed), or an error if it exits before sending one."""
    recv = asyncio.ensure_future(outbox.recv())
    exited = asyncio.ensure_future(process.wait())
    try:
        await asyncio.wait([recv, exited], return_when=asyncio.FIRST_COMPLETED)
    finally:
        exited.cancel()
    if not recv.done():
        recv.cancel()
        raise RuntimeError(f"the engine core process exited with {process.returncode} at start")
    return wire.decode(recv.result())[0]
