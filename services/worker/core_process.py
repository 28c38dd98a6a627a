"""A worker's engine core in a process of its own (--engine-process): the scheduler, the model
runner and the KV pool run here, the worker's IO process (gRPC, sessions, text, admin, leases)
talks to it over two ZeroMQ IPC sockets in engine/wire.py's frames (vLLM v1's EngineCore
process). The GPU never waits on the IO process's interpreter: this process's only other
thread is the loop that moves frames, a small fraction of the IO side's work.

The IO process (worker/core_client.py) binds both sockets in a directory only its user can
open and starts this process with their addresses; the first frame it sends is Start (the
engine's config), the first this process sends is Ready (the engine's facts) or Failed. Then
commands come in order (fire-and-forget, or tagged calls answered by Reply) and outputs go out
batched per step, with the iteration stats and KV events. This process dies with its parent.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import dataclasses
import logging
import os
import signal
import sys
import traceback

import zmq
import zmq.asyncio

from tandem.engine import wire
from tandem.engine.engine_core import EngineCore
from tandem.engine.kv_layout import layout_hash
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.lora_adapter import AdapterStore
from tandem.engine.messages import AddRequest, EngineFailure
from tandem.kvtransfer import KvTransceiver, TransferPoller
from tandem.kvtransfer.errors import TransceiverClosedError
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
from tandem.worker.weight_openers import WEIGHT_OPENERS

log = logging.getLogger("tandem.engine_core")


class _Outbox:
    """Frames to the IO process, sent from the loop; a step's outputs go as one frame."""

    def __init__(self, socket: zmq.asyncio.Socket, loop: asyncio.AbstractEventLoop):
        self.socket = socket
        self.loop = loop
        self._items: list = []

    def send(self, obj, tag: int = 0) -> None:
        self.socket.send(wire.encode(obj, tag), copy=False)

    def output(self, request_id: str, item) -> None:
        if not self._items:
            self.loop.call_soon(self._flush)  # after the rest of this step's outputs
        self._items.append([request_id, item])

    def _flush(self) -> None:
        items, self._items = self._items, []
        try:
            self.send(Outputs([[request_id, *wire.pack(item)] for request_id, item in items]))
        except Exception:  # noqa: BLE001 - one output that does not encode fails its request only
            log.exception("a step's outputs did not encode; sending them one by one")
            self.send(Outputs([_packed(request_id, item) for request_id, item in items]))


def _packed(request_id: str, item) -> list:
    try:
        return [request_id, *wire.pack(item)]
    except Exception as exc:  # noqa: BLE001 - the request fails, the others go on
        failure = EngineFailure(RuntimeError(f"an output did not encode: {exc}"))
        return [request_id, *wire.pack(failure)]


class _Stream:
    """What EngineCore puts a request's outputs on: the outbox, under the request's id."""

    __slots__ = ("request_id", "outbox")

    def __init__(self, request_id: str, outbox: _Outbox):
        self.request_id = request_id
        self.outbox = outbox

    def put_nowait(self, item) -> None:
        self.outbox.output(self.request_id, item)


class CoreServer:
    """The core's side: frames in, EngineCore's commands; its outputs, frames out."""

    def __init__(self, core: EngineCore, outbox: _Outbox, start: Start):
        self.core = core
        self.outbox = outbox
        self.adapters = (
            AdapterStore(
                core.engine.model_config,
                start.config.max_lora_rank,
                core.engine.runner.dtype,
                start.adapter_capacity,
            )
            if start.adapter_capacity
            else None
        )
        self._tokenizer_info = None
        self.transceiver: KvTransceiver | None = None
        self.poller: TransferPoller | None = None
        self._reads: dict[int, object] = {}

    async def serve(self, inbox: zmq.asyncio.Socket) -> None:
        while True:
            message, tag = wire.decode(await inbox.recv())
            if isinstance(message, Stop):
                return
            try:
                await self._take(message, tag)
            except Exception as exc:  # noqa: BLE001 - whoever sent it hears of it
                if tag:
                    self.outbox.send(Reply(False, exc), tag)
                elif isinstance(message, AddRequest):  # its stream waits for an output
                    self.outbox.output(message.request_id, EngineFailure(exc))
                else:
                    log.exception("engine core command %s failed", type(message).__name__)

    async def _take(self, message, tag: int) -> None:
        core = self.core
        if isinstance(message, AddRequest):
            message = await self._resolve(message)
            if message.remote_kv:  # a call: its reply is the ImportPlan
                self._answer(core.submit(message), tag)
            else:
                core.add_request(message, _Stream(message.request_id, self.outbox))
        elif isinstance(message, Register):
            core.register(message.request_id, _Stream(message.request_id, self.outbox))
        elif isinstance(message, Abort):
            core.abort(message.request_id)
        elif isinstance(message, StartTransceiver):
            self._answer(asyncio.ensure_future(self._start_transceiver(message)), tag)
        elif isinstance(message, StopTransceiver):
            self._stop_transceiver()
        elif isinstance(message, AddPeer):
            if self.poller is None:
                raise TransceiverClosedError("this worker's KV transceiver is not running")
            self._answer(self.poller.add_peer(message.state), tag)
        elif isinstance(message, PostRead):
            self._post_read(message)
        elif isinstance(message, AbandonRead):
            pending = self._reads.get(message.read_id)
            if pending is not None:
                pending.abandon = True
        elif isinstance(message, GuideInfo):
            self._tokenizer_info = await asyncio.to_thread(_tokenizer_info, message.tokenizer_info)
        elif isinstance(message, TrimMemory):
            self._answer(asyncio.ensure_future(core.trim_memory(message.ipc)), tag)
        elif isinstance(message, LoadWeights):
            self._answer(
                asyncio.ensure_future(core.load_weights(message.path, message.fingerprint)), tag
            )
        elif isinstance(message, WriteWeights):
            self._answer(
                asyncio.ensure_future(core.write_weights(message.kind, message.payload)), tag
            )
        elif tag:
            self._answer(core.submit(message), tag)
        else:
            core.send(message)

    async def _start_transceiver(self, message: StartTransceiver) -> TransceiverInfo:
        engine = self.core.engine
        self.transceiver = await asyncio.to_thread(
            KvTransceiver,
            message.agent_name,
            engine.runner.kv_pools,
            layout_hash(self.core.facts.kv_layout),
            progress_thread=message.progress_thread,
        )
        loop, outbox = self.core.loop, self.outbox

        def notified(peer: str, notification: bytes) -> None:  # on the poller thread
            loop.call_soon_threadsafe(outbox.send, Notification(peer, notification))

        # Peers may be reading our blocks while handed-off KV is out (the IO side's leases).
        self.poller = TransferPoller(
            self.transceiver, loop, notified, lambda now: engine.num_handed_off > 0
        )
        self.poller.start()
        return TransceiverInfo(self.transceiver.get_state(), self.transceiver.block_nbytes)

    def _stop_transceiver(self) -> None:
        if self.poller is not None:
            self.poller.stop()
        if self.transceiver is not None:
            self.transceiver.close()
        self.transceiver = self.poller = None

    def _post_read(self, message: PostRead) -> None:
        read_id, outbox = message.read_id, self.outbox
        if self.poller is None:
            outbox.send(ReadFinished(read_id, error=RuntimeError("no KV transceiver is running")))
            outbox.send(ReadSettled(read_id))
            return
        pending = self._reads[read_id] = self.poller.read(
            message.peer_name,
            message.remote_block_ids,
            message.local_block_ids,
            message.notify,
            message.timeout_s,
        )

        def done(f: asyncio.Future) -> None:
            if f.exception() is not None:
                outbox.send(ReadFinished(read_id, error=f.exception()))
            else:
                outbox.send(ReadFinished(read_id, f.result().nbytes, f.result().seconds))

        def settled(_: asyncio.Future) -> None:
            self._reads.pop(read_id, None)
            outbox.send(ReadSettled(read_id))

        pending.done.add_done_callback(done)
        pending.settled.add_done_callback(settled)

    def _answer(self, future: asyncio.Future, tag: int) -> None:
        def reply(f: asyncio.Future) -> None:
            if f.cancelled():
                self.outbox.send(Reply(False, RuntimeError("cancelled")), tag)
            elif f.exception() is not None:
                self.outbox.send(Reply(False, f.exception()), tag)
            else:
                try:
                    self.outbox.send(Reply(True, wire.pack(f.result())), tag)
                except Exception as exc:  # noqa: BLE001 - a reply that does not encode
                    self.outbox.send(Reply(False, exc), tag)

        future.add_done_callback(reply)

    async def _resolve(self, command: AddRequest) -> AddRequest:
        """The command's adapter and guide as the engine takes them (read and rebuilt here)."""
        changes = {}
        ref = command.adapter
        if isinstance(ref, wire.AdapterRef):
            if self.adapters is None:
                raise ValueError("this engine core keeps no LoRA adapters")
            changes["adapter"] = await asyncio.to_thread(
                self.adapters.load, ref.name, ref.int_id, ref.path
            )
        guide = command.options.guide
        if isinstance(guide, wire.GuideJson):
            compiled = await asyncio.to_thread(
                _xgrammar().CompiledGrammar.deserialize_json, guide.json, self._tokenizer_info
            )
            changes["options"] = dataclasses.replace(command.options, guide=compiled)
        return dataclasses.replace(command, **changes) if changes else command


def _xgrammar():
    import xgrammar

    return xgrammar


def _tokenizer_info(serialized: str):
    return _xgrammar().TokenizerInfo.deserialize_json(serialized)


def _die_with_parent() -> None:
    """Linux: SIGKILL when the IO process goes (prctl PR_SET_PDEATHSIG)."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


async def _main(inbox_address: str, outbox_address: str) -> None:
    loop = asyncio.get_running_loop()
    context = zmq.asyncio.Context()
    inbox, out = context.socket(zmq.PULL), context.socket(zmq.PUSH)
    inbox.connect(inbox_address)
    out.connect(outbox_address)
    outbox = _Outbox(out, loop)
    start, _ = wire.decode(await inbox.recv())
    try:
        engine = await asyncio.to_thread(LLMEngine, start.config, start.hands_off)
        warmup_s = await asyncio.to_thread(_warm_up, engine)
    except Exception as exc:  # noqa: BLE001 - the IO process reports it and exits
        outbox.send(Failed(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}"))
        await asyncio.sleep(0.5)  # let the frame go
        raise SystemExit(1) from None
    core = EngineCore(
        engine,
        loop,
        on_stats=lambda record: outbox.send(Stats(record)),
        on_kv_events=lambda events: outbox.send(KvEvents(events)),
        weight_openers=WEIGHT_OPENERS,
        on_undelivered=lambda request_id, block_ids: outbox.send(
            Undelivered(request_id, block_ids)
        ),
    )
    server = CoreServer(core, outbox, start)
    core.start()
    outbox.send(Ready(core.facts, core.weights, core.released_tags, os.getpid(), warmup_s))
    try:
        await server.serve(inbox)
    finally:
        server._stop_transceiver()
        core.close()
        context.destroy(linger=1000)


def _warm_up(engine: LLMEngine) -> float:
    import time

    started = time.perf_counter()
    seconds = engine.warm_up()
    if seconds:
        log.info("attention kernel variants compiled in %.1f s", seconds)
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description="a tandem worker's engine core (internal)")
    parser.add_argument("--inbox", required=True)
    parser.add_argument("--outbox", required=True)
    parser.add_argument("--parent", type=int, required=True, help="the worker's pid")
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s engine-core %(levelname)s %(message)s"
    )
    _die_with_parent()
    if os.getppid() != args.parent:  # the worker went while this process was importing
        sys.exit(1)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the IO process stops it (Stop, then a kill)
    asyncio.run(_main(args.inbox, args.outbox))
    sys.exit(0)


if __name__ == "__main__":
    main()
