"""The engine thread hands each step's outputs, and each command's reply, to the event loop before
it starts the next step (while the step launched before runs on the device, overlap scheduling's
default): it releases the GIL until the loop has them, rather than keeping it through the next step's host work (a waiting loop
thread seldom wins the GIL from a busy Python thread before Python's switch interval, 5 ms), so a
token or a reply (a decode's reservation, a peer's LeasePrefix) does not wait on the worker's side
for the step after it.

The engine's wait is bounded (2 ms); the test lifts the bound so that a loaded machine's slow
wake-up of the loop does not count against the handover. Against the old code the test is not
deterministic either way: the loop sometimes wins the GIL by itself (while the engine thread
writes to the loop's wake-up pipe), which is why it asks for most outputs in time, not all."""

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


class _RecordingQueue(asyncio.Queue):
    def __init__(self, events: list):
        super().__init__()
        self.events = events

    def put_nowait(self, item):
        self.events.append("taken")
        super().put_nowait(item)


async def _serve(model_dir, num_tokens: int, calls: bool = False) -> list:
    """Runs one request of num_tokens tokens; with calls, a caller on the loop asks for the
    engine's counters (ReadCounters) again and again meanwhile. Returns the events in order:
    launch (a step starts), made (an output), taken (the loop has it), applied (the engine
    thread ran a call), replied (the loop has its reply)."""
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
            await asyncio.wait_for(core.call(ReadCounters()), timeout=60)
            events.append("replied")

    core.start()
    calling = asyncio.ensure_future(caller()) if calls else None
    try:
        stream = _RecordingQueue(events)
        options = SamplingOptions(max_tokens=num_tokens, ignore_eos=True)
        core.add_request(AddRequest("r", [5, 9, 2, 7, 1, 3], options), stream)
        received = 0
        while True:
            out = await asyncio.wait_for(stream.get(), timeout=60)
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
    """(how many of the `sent` events that a step launch follows had their `received` event
    before that launch, how many such events there were)."""
    launches = [i for i, kind in enumerate(events) if kind == "launch"]
    pairs = zip(
        [i for i, kind in enumerate(events) if kind == sent],
        [i for i, kind in enumerate(events) if kind == received],
    )
    followed = [(s, r) for s, r in pairs if any(i > s for i in launches)]
    return sum(r < min(i for i in launches if i > s) for s, r in followed), len(followed)


def _as_on_a_device(monkeypatch) -> None:
    monkeypatch.setattr(engine_core, "_HANDOVER_WAIT_S", 0.1)
    # As on an accelerator, where a launched step still runs on the device when the next starts
    # (a CPU step has run by then, and the engine goes on without waiting).
    monkeypatch.setattr(
        LLMEngine, "has_step_in_flight", property(lambda engine: engine._in_flight is not None)
    )


def test_each_steps_outputs_reach_the_loop_before_the_next_step_starts(model_dirs, monkeypatch):
    _as_on_a_device(monkeypatch)
    num_tokens = 12
    events = asyncio.run(_serve(model_dirs["llama"], num_tokens))
    assert events.count("made") == events.count("taken") == num_tokens
    # Each output but the last (after it the engine idles): taken before the next step starts?
    in_time, count = _in_time(events, "made", "taken")
    assert count == num_tokens - 1, "".join(kind[0] for kind in events)
    assert in_time >= (num_tokens - 1) * 0.75, "".join(kind[0] for kind in events)


def test_each_commands_reply_reaches_the_loop_before_the_next_step_starts(model_dirs, monkeypatch):
    """A reply the engine thread posts between steps (a decode's reservation, a peer's
    LeasePrefix) is the loop's before the next step's launch takes the GIL."""
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
