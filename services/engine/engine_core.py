"""The engine thread and its bridge to the asyncio loop.

The gRPC loop never runs model code: it puts typed commands (engine/messages.py) on a
queue; one thread owns the LLMEngine, applies the commands between steps, runs the steps
and hands each step's outputs back to the loop with call_soon_threadsafe. A slow client
never stalls a step.
"""

from __future__ import annotations

import asyncio
import logging
import os
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from tandem.engine.iteration_stats import iteration_stats
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.memory import collect_ipc, return_freed_memory
from tandem.engine.messages import (
    AbortRequest,
    AddRequest,
    CheckIdle,
    CopyWeights,
    EngineFailure,
    FreeBlocks,
    HoldSteps,
    KvConfirmed,
    Lease,
    LeasePrefix,
    ReadCounters,
    ReleaseMemory,
    RemoteKvArrived,
    ResumeMemory,
    StepOutput,
    SwapWeights,
    WeightsChecksum,
    WeightsInfo,
    coalesce,
)

log = logging.getLogger("tandem.engine_core")


class LeaseTable(Protocol):
    """Who keeps the KV of finished context phases for the decode side (the prefill's lease
    keeper). open() runs on the loop as the output that hands the blocks off is delivered, so a
    handoff's blocks are never owned by nobody (an output nobody takes is abandoned at once);
    the table gives them back with FreeBlocks when the lease ends."""

    def open(self, request_id: str, block_ids: list[int]) -> Lease: ...

    def abandon(self, lease_id: int) -> None:
        """The output that carried the lease reached nobody (its request was aborted meanwhile)."""


_STOP = object()

# How long the engine thread waits in all, GIL released, for the loop to take what it was handed
# (a step's outputs, command replies) while one launched step runs on the device: the waits
# after its outputs and before the next launch share it (a loop busy elsewhere gets them later,
# as before).
_HANDOVER_WAIT_S = 0.002
# The loop's turns the engine thread waits for after the one that ran the posted callbacks: the
# tasks those woke (a stream's reader, a command's caller) run in the next turn, and one behind
# asyncio.shield (a prefix lease's holder) in the one after.
_HANDOVER_TURNS = 2

# Test-only: the engine thread runs this many engine steps as one and hands their outputs over
# as one multi-token output per sequence, the shape speculative decoding's steps will have
# (tests/test_internal_plane.py drives the whole path with it). Unset: 1.
TOKENS_PER_STEP_ENV = "TANDEM_TEST_TOKENS_PER_STEP"


def _tokens_per_step() -> int:
    value = os.environ.get(TOKENS_PER_STEP_ENV, "1")
    if not value.isdigit() or not 1 <= int(value) <= 64:
        raise ValueError(f"{TOKENS_PER_STEP_ENV} must be a whole number in [1, 64], got {value!r}")
    return int(value)


class JsonBuffer:
    """Dicts the engine thread publishes (iteration stats, KV events) for Get*/Stream* RPCs.
    Lives on the asyncio side; bounded, oldest dropped first."""

    def __init__(self, maxlen: int):
        self.items: deque[dict] = deque(maxlen=maxlen)
        self._event = asyncio.Event()

    def push(self, items: list[dict]) -> None:
        self.items.extend(items)
        self._event.set()

    async def drain(self, timeout: float | None) -> list[dict]:
        """What arrived since the last drain, waiting up to timeout seconds (None: forever) for something."""
        if not self.items:
            self._event.clear()
            try:
                await asyncio.wait_for(self._event.wait(), timeout)
            except asyncio.TimeoutError:
                return []
        items = list(self.items)
        self.items.clear()
        return items


class EngineCore:
    def __init__(
        self,
        engine: LLMEngine,
        loop: asyncio.AbstractEventLoop,
        stats_history: int = 1000,
        on_stats: Callable[[dict], None] | None = None,
        on_kv_events: Callable[[list[dict]], None] | None = None,
        leases: LeaseTable | None = None,
        weight_openers: dict[str, Callable] | None = None,
        on_undelivered: Callable[[str, list[int]], None] | None = None,
    ):
        """leases: a prefill worker's lease table, which takes the KV its context phases hand off
        (without one, in an engine core process, the IO process's table takes it:
        on_undelivered(request_id, block_ids) then hands back the blocks of an output nobody took).
        weight_openers: kind -> open(payload, model, device), the in-place weight updates
        (update_weights by IPC handles or NIXL) the engine takes (write_weights)."""
        self.engine = engine
        self.loop = loop
        self.leases = leases
        self.weight_openers = weight_openers or {}
        self.on_undelivered = on_undelivered
        # What the IO side may know without asking (fixed), and what it learns from the replies
        # of the commands that change it: the weights served, the memory released.
        self.facts = engine.facts()
        self.weights: WeightsInfo = engine.weights_info()
        self.released_tags: list[str] = engine.released_tags
        # Called on the loop with each batch of KV events (the worker's KV block feed), as on_stats.
        self.on_kv_events = on_kv_events
        # Called on the loop with each step's iteration stats (the worker's metrics), off the engine thread.
        self.on_stats = on_stats
        self._commands: queue.Queue = queue.Queue()
        self.tokens_per_step = _tokens_per_step()
        # request id -> the asyncio queue its StepOutputs (or an EngineFailure) go to.
        self._streams: dict[str, asyncio.Queue] = {}
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self._stopping = False
        # pause_generation in keep mode: requests stay, no step runs (set on the engine thread).
        self._held = False
        self.iteration_stats = JsonBuffer(stats_history)
        self.kv_events = JsonBuffer(stats_history * 10)
        self._next_event_id = 0
        # Seconds each request admitted since the last stats record waited in the command queue.
        self._new_request_waits: list[float] = []
        # Whether something a request or a caller waits for (outputs, a command's reply, a
        # failure) went to the loop since the last handover (_hand_over).
        self._posted = False
        # The launched step (its iteration) the handovers' waits were for, and what is left of
        # their shared bound.
        self._waited_for = -1
        self._wait_left = 0.0
        self._handlers = {
            AddRequest: self._add,
            AbortRequest: lambda c: engine.abort_request(c.request_id),
            RemoteKvArrived: lambda c: engine.remote_kv_arrived(
                c.request_id, c.num_blocks, c.confirmed, c.first_token_ids, c.draft_token_ids
            ),
            KvConfirmed: lambda c: engine.kv_confirmed(c.request_id),
            FreeBlocks: lambda c: engine.free_blocks(c.block_ids),
            LeasePrefix: lambda c: engine.lease_prefix(c.token_ids, c.cache_salt),
            CheckIdle: self._check_idle,
            HoldSteps: self._hold,
            ReleaseMemory: lambda c: engine.release_memory(c.tags, self._held),
            ResumeMemory: lambda c: engine.resume_memory(c.tags),
            SwapWeights: lambda c: engine.swap_weights(
                c.model, c.source, c.fingerprint, self._held
            ),
            CopyWeights: lambda c: engine.copy_weights(c.updates, c.finalize, self._held),
            ReadCounters: lambda c: engine.snapshot(),
            WeightsChecksum: lambda c: engine.weights_checksum(),
        }

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stopping = True
        self._commands.put((_STOP, None))
        self._thread.join(timeout=10)

    # -- the asyncio side --
    def add_request(self, command: AddRequest, stream: asyncio.Queue) -> None:
        """Queues a sequence; its StepOutputs (or an EngineFailure) arrive on stream."""
        self.register(command.request_id, stream)
        self._commands.put((command, None))

    def register(self, request_id: str, stream: asyncio.Queue) -> None:
        """Routes a request's outputs to stream (a remote-KV sequence registers once its KV is there)."""
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already running on this worker")
        self._streams[request_id] = stream

    def abort(self, request_id: str) -> bool:
        """Stops a request; no further output reaches its stream. Returns whether it was known."""
        known = self._streams.pop(request_id, None) is not None
        self._commands.put((AbortRequest(request_id), None))
        return known

    def send(self, command) -> None:
        """Queues a command without waiting for it (safe from any thread)."""
        self._commands.put((command, None))

    def submit(self, command) -> asyncio.Future:
        """Queues a command at once (in order with send and add_request); its reply resolves the
        future."""
        future = self.loop.create_future()
        self._commands.put((command, future))
        if isinstance(command, (SwapWeights, CopyWeights, ReleaseMemory, ResumeMemory)):
            future.add_done_callback(lambda f: self._learn(command, f))
        return future

    async def call(self, command) -> Any:
        """Runs a command on the engine thread between steps and returns its reply."""
        return await self.submit(command)

    def _learn(self, command, future: asyncio.Future) -> None:
        """What a reply says of the weights served or the memory released."""
        if future.cancelled() or future.exception() is not None:
            return
        if isinstance(command, (SwapWeights, CopyWeights)):
            self.weights = future.result()
        else:
            self.released_tags = future.result()

    async def load_weights(self, path: str, fingerprint: str) -> WeightsInfo:
        """Reads a checkpoint's weights off both the loop and the engine thread (steps go on),
        then serves them from the engine thread."""
        model = await asyncio.to_thread(self.engine.runner.load_weights, path)
        try:
            return await self.call(SwapWeights(model, path, fingerprint))
        finally:
            del model

    async def write_weights(self, kind: str, payload) -> None:
        """Weights written in place: weight_openers[kind](payload, model, device) opens them (IPC
        handles, NIXL reads) off the loop, as an update with `.updates` (CopyWeights'); the engine
        thread copies them in. Refused on a tensor-parallel engine."""
        runner = self.engine.runner
        runner.require_single_rank("update_weights")
        update = await asyncio.to_thread(
            self.weight_openers[kind], payload, runner.model, runner.device
        )
        try:
            await self.call(CopyWeights(update.updates))
        finally:
            del update

    def close(self) -> None:
        """Stops the engine thread and the engine's other ranks."""
        self.stop()
        self.engine.close()

    async def aclose(self) -> None:
        self.close()

    async def trim_memory(self, ipc: bool = False) -> None:
        """Hands what the engine freed back to the OS (and, ipc, lets go of the handles a weight
        update opened)."""
        await asyncio.to_thread(return_freed_memory)
        if ipc:
            await asyncio.to_thread(collect_ipc)

    def send_guide_info(self, tokenizer_info: str) -> None:
        """Compiled guides reach this engine as they are: nothing to send."""

    @property
    def num_active(self) -> int:
        return len(self._streams)

    # -- the engine thread: admit, step, emit --
    def _run(self) -> None:
        while not self._stopping:
            self._apply_commands(self._wait_time())
            if self._stopping:
                break
            self._hand_over()  # the commands' replies, before the next step's launch
            if self.engine.num_unfinished and not self._held:
                self._step()
            self._publish_kv_events()

    def _wait_time(self) -> float | None:
        """How long to block for the first command: not at all while there is work; a little when
        every request waits for blocks (held by leases, say), instead of spinning on empty steps
        with the GIL held; long when idle or held (pause_generation in keep mode)."""
        if not self.engine.num_unfinished or self._held:
            return 0.5
        return 0.005 if self.engine.last_step_was_idle else None

    def _apply_commands(self, first_wait: float | None) -> None:
        try:
            item = (
                self._commands.get(timeout=first_wait)
                if first_wait
                else self._commands.get_nowait()
            )
        except queue.Empty:
            return
        while True:
            command, future = item
            if command is _STOP:
                return
            self._apply(command, future)
            try:
                item = self._commands.get_nowait()
            except queue.Empty:
                return

    def _apply(self, command, future: asyncio.Future | None) -> None:
        try:
            result = self._handlers[type(command)](command)
        except Exception as exc:  # noqa: BLE001 - reported to whoever sent the command
            if future is not None:
                self._post(_set_exception, future, exc)
            elif isinstance(command, AddRequest):
                self._deliver(command.request_id, EngineFailure(exc))
            else:
                log.exception("engine command %s failed", type(command).__name__)
            return
        if future is not None:
            self._post(_set_result, future, result)

    def _check_idle(self, command: CheckIdle) -> None:
        if not (command.unless_held and self._held):
            self.engine.require_idle(command.what, self._held)

    def _hold(self, command: HoldSteps) -> int:
        """Returns how many requests the engine holds (frozen when held)."""
        self._held = command.held
        return self.engine.num_unfinished

    def _add(self, command: AddRequest):
        e = self.engine
        waited = time.monotonic() - command.enqueued_at
        if command.remote_kv:
            plan = e.add_remote_kv_request(
                command.request_id,
                command.prompt_token_ids,
                command.output_token_ids,
                command.options,
                command.priority,
                command.cache_salt,
                command.adapter,
                command.draft_token_ids,
                command.phase,
                command.ahead_of_handoff,
            )
            if plan is not None:  # a request refused for room is asked again: it is not new yet
                self._new_request_waits.append(waited)
            return plan
        self._new_request_waits.append(waited)
        e.add_request(
            command.request_id,
            command.prompt_token_ids,
            command.options,
            command.phase,
            command.priority,
            command.cache_salt,
            command.output_token_ids,
            command.adapter,
        )
        return None

    def _step(self) -> None:
        outputs: list[StepOutput] = []
        try:
            for _ in range(self.tokens_per_step):
                outputs = coalesce(outputs, self.engine.step())
                if not self.engine.num_unfinished:
                    break
        except Exception as exc:  # noqa: BLE001 - a failed step fails its batch, not the worker
            log.exception("engine step failed")
            if outputs:  # what the steps before it made is its sequences'
                self._post(self._put_all, outputs)
            for request_id in self.engine.current_batch_ids:
                self.engine.abort_request(request_id)
                self._deliver(request_id, EngineFailure(exc))
            return
        if outputs:  # one hop to the loop per step, not per output
            self._post(self._put_all, outputs)
            self._hand_over()
        self._record_stats(outputs)

    def _post(self, callback, *args) -> None:
        """Hands callback(*args) to the loop: something a request or a caller waits for (the
        stats and the KV events, which nobody waits for, go by call_soon_threadsafe alone)."""
        self.loop.call_soon_threadsafe(callback, *args)
        self._posted = True

    def _hand_over(self) -> None:
        """Lets the loop take what was posted before this thread goes on: waits, GIL released,
        until the loop has run it (at most _HANDOVER_WAIT_S). Otherwise this thread keeps the GIL
        through the stats and the next step's launch (Python, its short GIL-free calls rarely won
        by a waiting thread) and each token, each reply, waits ~1.5 ms on the loop's side. Only
        while the device is busy with the step launched before (overlap scheduling; its draws'
        event not reached) or nothing is left to run or queued: with no step on the device
        (--no-overlap-scheduling, a step that verified drafts, one the device has finished, the
        CPU, whose next forward would run beside the loop's Python) the next launch goes first.
        The waits while one step runs share _HANDOVER_WAIT_S. One wait covers all that was
        posted since the last (the loop runs its callbacks in order), and the _HANDOVER_TURNS
        turns after it: the tasks that what was posted woke run then."""
        if not self._posted:
            return
        self._posted = False
        e = self.engine
        running = e.has_step_in_flight
        if running:
            if e.counters.iteration != self._waited_for:  # a step launched since the last wait
                self._waited_for, self._wait_left = e.counters.iteration, _HANDOVER_WAIT_S
            bound = self._wait_left
        elif not (e.num_unfinished or self._commands.qsize()):
            bound = _HANDOVER_WAIT_S  # idle: the wait delays the stats only
        else:
            return
        if bound <= 0:
            return
        taken = threading.Event()
        try:
            self.loop.call_soon_threadsafe(self._after_turns, taken, _HANDOVER_TURNS)
        except RuntimeError:  # the loop closed meanwhile: nobody to hand over to
            return
        started = time.perf_counter()
        taken.wait(bound)
        if running:
            self._wait_left -= time.perf_counter() - started

    def _after_turns(self, taken: threading.Event, turns: int) -> None:
        """Sets taken once the loop has run `turns` more turns (on the loop: what this turn
        schedules runs in the next)."""
        if turns:
            self.loop.call_soon(self._after_turns, taken, turns - 1)
        else:
            taken.set()

    def _deliver(self, request_id: str, item: StepOutput | EngineFailure) -> None:
        self._post(self._put, request_id, item)

    def _put_all(self, outputs: list[StepOutput]) -> None:
        for out in outputs:
            self._put(out.request_id, out)

    def _put(self, request_id: str, item) -> None:
        stream = self._streams.get(request_id)
        kept = item.kept_block_ids if isinstance(item, StepOutput) else None
        if kept is not None and self.leases is not None:
            item.lease = self.leases.open(request_id, kept)
        if stream is None:  # aborted meanwhile: nobody takes the handoff, its blocks go back
            if kept is not None and self.leases is not None:
                self.leases.abandon(item.lease.lease_id)
            elif kept is not None and self.on_undelivered is not None:
                self.on_undelivered(request_id, kept)
            return
        if isinstance(item, EngineFailure) or item.finished:
            self._streams.pop(request_id, None)
        stream.put_nowait(item)

    def _record_stats(self, outputs: list[StepOutput]) -> None:
        waits, self._new_request_waits = self._new_request_waits, []
        stats = iteration_stats(self.engine, outputs, waits)
        self.loop.call_soon_threadsafe(self._publish_stats, stats)

    def _publish_stats(self, stats: dict) -> None:
        self.iteration_stats.push([stats])
        if self.on_stats is not None:
            self.on_stats(stats)

    def _publish_kv_events(self) -> None:
        """KV events in TensorRT-LLM's shape: {event_id, data, window_size}."""
        if not self.engine.block_manager.events:
            return
        events = []
        for data in self.engine.block_manager.drain_events():
            events.append(
                {
                    "event_id": self._next_event_id,
                    "data": data,
                    "window_size": self.engine.max_model_len,
                }
            )
            self._next_event_id += 1
        self.loop.call_soon_threadsafe(self._push_kv_events, events)

    def _push_kv_events(self, events: list[dict]) -> None:
        self.kv_events.push(events)
        if self.on_kv_events is not None:
            self.on_kv_events(events)


def _set_result(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _set_exception(future: asyncio.Future, exc: BaseException) -> None:
    if not future.done():
        future.set_exception(exc)
