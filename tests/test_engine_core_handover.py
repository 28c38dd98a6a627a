"""The engine thread hands each step's outputs, and each command's reply, to the event loop before
it starts the next step (while the step launched before runs on the device, overlap scheduling's
default): it releases the GIL until the loop has them and has run the tasks they woke, rather
than keeping it through the next step's host work (a waiting loop thread seldom wins the GIL from
a busy Python thread before Python's switch interval, 5 ms), so a token or a reply (a decode's
reservation, a peer's LeasePrefix) does not wait on the worker's side for the step after it.

The engine's wait is bounded (2 ms a launched step); the tests lift the bound so that a loaded
machine's slow wake-up of the loop does not count against the handover. Against the old code they
are not deterministic either way: the loop sometimes wins the GIL by itself (while the engine
thread writes to the loop's wake-up pipe), which is why they ask for most in time, not all."""

from __future__ import annotations

import asyncio
import time

from tandem.engine import engine_core
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import AddRequest, ReadCounters
from tandem.engine.sampling_options import SamplingOptions

_HOST_WORK_S = 0.003  # a step's launch on the host, in Python (shorter than the switch interval)


async def _serve(model_dir, num_tokens: int, calls: bool = False) -> list:
    """Runs one request of num_tokens tokens, its outputs read as they come; with calls, a caller
    on the loop asks for the engine's counters (ReadCounters) again and again meanwhile. Returns
    the events in order: launch (a step starts), made (an output), read (its reader has it),
    applied (the engine thread ran a call), replied (its caller has the reply)."""
    engine = LLMEngine(EngineConfig(str(model_dir), block_size=4, num_blocks=64, max_num_seqs=2))
    events: list[str] = []
    step = engine.step

    def launch_then_step():
        events.append("launch")
        end = time.perf_counter() + _HOST_WORK_S
        while time.perf_counter() < end:  # holds the GIL, as a step's Python does
            pass
        outputs = step()
        events.extend(["made"] * len(outputs))
        return outputs

    engine.step = launch_then_step
    core = EngineCore(engine, asyncio.get_running_loop())
    read_counters = core._handlers[ReadCounters]

    def applied(command):
        events.append("applied")
        return read_counters(command)

    core._handlers[ReadCounters] = applied
    done = asyncio.Event()

    async def caller():
        while not done.is_set():
            async with asyncio.timeout(60):  # (no task of its own, unlike wait_for)
                await core.call(ReadCounters())
            events.append("replied")

    core.start()
    calling = asyncio.ensure_future(caller()) if calls else None
    try:
        stream: asyncio.Queue = asyncio.Queue()
        options = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
        core.add_request(AddRequest("r", [5, 9, 2, 7, 1, 3], options), stream)
        received = 0
        while True:
            async with asyncio.timeout(60):
                out = await stream.get()
            events.append("read")
            received += len(out.new_token_ids)
            if out.finished:
                break
        assert received == num_tokens
        done.set()
        if calling is not None:
            await calling
        return events
    finally:
        core.close()


def _in_time(events: list, sent: str, received: str) -> tuple[int, int]:
    """Per step launch after a `sent` event: whether the last `sent` event since the launch before
    had its `received` event (the same ordinal) before this launch. Returns (how many did, how
    many launches had one)."""
    received_at = [i for i, kind in enumerate(events) if kind == received]
    in_time = count = 0
    last = None  # the ordinal of the last `sent` event since the launch before
    num_sent = 0
    for i, kind in enumerate(events):
        if kind == sent:
            last, num_sent = num_sent, num_sent + 1
        elif kind == "launch" and last is not None:
            count += 1
            in_time += last < len(received_at) and received_at[last] < i
            last = None
    return in_time, count


def _as_on_a_device(monkeypatch) -> None:
    monkeypatch.setattr(engine_core, "_HANDOVER_WAIT_S", 0.1)
    # As on an accelerator, where a launched step still runs on the device when the next starts
    # (a CPU step has run by then, and the engine goes on without waiting).
    monkeypatch.setattr(
        LLMEngine, "has_step_in_flight", property(lambda engine: engine._in_flight is not None)
    )


def test_each_steps_outputs_reach_their_reader_before_the_next_step_starts(model_dirs, monkeypatch):
    _as_on_a_device(monkeypatch)
    num_tokens = 12
    events = asyncio.run(_serve(model_dirs["llama"], num_tokens))
    assert events.count("made") == events.count("read") == num_tokens
    # Each output but the last (after it the engine idles): read before the next step starts?
    in_time, count = _in_time(events, "made", "read")
    assert count == num_tokens - 1, "".join(kind[0] for kind in events)
    assert in_time >= count * 0.75, "".join(kind[0] for kind in events)


def test_each_commands_reply_reaches_its_caller_before_the_next_step_starts(
    model_dirs, monkeypatch
):
    """A reply the engine thread posts between steps (a decode's reservation, a peer's
    LeasePrefix) is its caller's before the next step's launch takes the GIL."""
    _as_on_a_device(monkeypatch)
    events = asyncio.run(_serve(model_dirs["llama"], 16, calls=True))
    in_time, count = _in_time(events, "applied", "replied")
    assert count >= 8, "".join(kind[0] for kind in events)
    assert in_time >= count * 0.75, "".join(kind[0] for kind in events)


def test_a_cpu_step_is_not_in_flight_once_launched(model_dirs):
    """On the CPU the forward runs when the step is launched: the engine thread does not wait for
    the loop then (the next forward would run beside the loop's Python, on another core)."""
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=4, num_blocks=64))
    try:
        engine.add_request("r", [5, 9, 2, 7], SamplingOptions(max_tokens=8, ignore_eos=True))
        engine.step()
        assert engine._in_flight is not None  # overlap scheduling: its draws read next step
        assert not engine.has_step_in_flight
    finally:
        engine.close()
