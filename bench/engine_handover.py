"""How long a step's outputs and a command's reply wait for the worker's event loop (issue 39). The
engine thread hands each step's outputs and each reply to the loop (call_soon_threadsafe) and,
while the step launched before runs on the device or nothing is left to run, waits with the GIL
released until the loop has them (at most engine_core._HANDOVER_WAIT_S); before aeef4a5 (outputs)
and 034e2d5 (replies) it went straight on with the stats and the next step's launch, and the
loop, woken, waited for the GIL.

An EngineCore on an asyncio loop, as in a worker; --streams requests at a time, each of
--max-tokens tokens after a --prompt-len prompt, each read by a task of its own. Per stream count,
in turns --repeats times: with the wait for outputs and replies (and the tasks they wake: the
loop's _HANDOVER_TURNS turns after them), with it until the posted callbacks ran only (0 turns),
with it for outputs only (replies not waited for, as in aeef4a5's engine thread), and without it
(its bound set to 0: the engine thread before aeef4a5).
Meanwhile a caller on the loop asks the engine thread for the time (a command with a reply and no
work, as a decode's reservation or a peer's LeasePrefix) again and again (--call-every-ms apart).
Prints the lag from each step's return on the engine thread to the loop taking its outputs (the
callback that puts them on the streams) and to each output's reader having it, and from the
engine thread applying each call to the caller having its reply (median and p90 over every step,
output or call of every repeat), and the tokens per second of the whole run. On the CPU, where a
step has run by the time it is launched, the engine waits only at a request's end (nothing left
to run), unless --as-on-a-device counts the CPU's launched step as still running (as the tests
do); --launch-gil-ms gives each step the GIL-held host time of a GPU step's launch.

    python bench/engine_handover.py                                   # the tiny model on the CPU
    python bench/engine_handover.py --as-on-a-device --launch-gil-ms 1         # as on a GPU
    python bench/engine_handover.py --device cuda --model <8B checkpoint> --streams 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import math
import random
import statistics
import time

from tandem.engine import engine_core
from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import AddRequest
from tandem.engine.sampling_options import SamplingOptions


class _Ping:
    """The caller's command (a reply and no work, as a decode's reservation or a peer's LeasePrefix
    on a step's scale)."""


# name -> (the wait's bound, whether replies are waited for too, the loop's turns waited for after
# the posted callbacks)
_VARIANTS = {
    "wait": (engine_core._HANDOVER_WAIT_S, True, engine_core._HANDOVER_TURNS),
    "0 turns": (engine_core._HANDOVER_WAIT_S, True, 0),
    "outputs only": (engine_core._HANDOVER_WAIT_S, False, engine_core._HANDOVER_TURNS),
    "no wait": (0.0, False, 0),
}


async def _run(
    engine: LLMEngine,
    streams: int,
    prompt_len: int,
    max_tokens: int,
    seed: int,
    replies_wait: bool = True,
    call_every_s: float = 0.0,
    launch_gil_s: float = 0.0,
) -> tuple[dict[str, list[float]], float]:
    """One pass: returns the lags (seconds) by what they time: "taken" (a step's return to the
    loop's callback that puts its outputs on the streams, one per step with outputs), "read"
    (the return to each output's reader having it, one per output), "replies" (a call applied to
    its caller having the reply, one per call); and the tokens per second."""
    returned: list[float] = []  # when each step with outputs returned on the engine thread
    taken: list[float] = []  # when the loop took each step's outputs (the same order)
    lags: dict[str, list[float]] = {"taken": [], "read": [], "replies": []}
    returned_at: dict[int, float] = {}  # id of each output -> its step's return
    core = EngineCore(engine, asyncio.get_running_loop())
    # A command whose reply is when the engine thread applied it (nothing else: ReadCounters
    # would add its own host time, ~1 ms on the 8B model, to each turn).
    core._handlers[_Ping] = lambda c: time.perf_counter()
    if not replies_wait:  # as in aeef4a5: no wait between the commands and a step
        apply_commands = core._apply_commands

        def apply_then_go_on(first_wait):
            apply_commands(first_wait)
            core._posted = False

        core._apply_commands = apply_then_go_on
    done = asyncio.Event()

    async def caller():
        while not done.is_set():
            applied = await core.call(_Ping())
            lags["replies"].append(time.perf_counter() - applied)
            if call_every_s:
                await asyncio.sleep(call_every_s)

    step = engine.step

    def timed_step():
        if launch_gil_s:  # a GPU step's launch: Python on the host, the GIL held
            end = time.perf_counter() + launch_gil_s
            while time.perf_counter() < end:
                pass
        outputs = step()
        if outputs:
            now = time.perf_counter()
            returned.append(now)
            for out in outputs:
                returned_at[id(out)] = now
        return outputs

    put_all = core._put_all

    def timed_put_all(outputs):
        taken.append(time.perf_counter())
        put_all(outputs)

    engine.step = timed_step
    core._put_all = timed_put_all
    rng = random.Random(seed)
    vocab = min(engine.model_config.vocab_size, 30_000)
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)

    async def reader(queue: asyncio.Queue) -> int:
        num_tokens = 0
        while True:
            async with asyncio.timeout(300):  # (no task of its own, unlike wait_for on 3.11)
                out = await queue.get()
            lags["read"].append(time.perf_counter() - returned_at.pop(id(out), math.nan))
            num_tokens += len(out.new_token_ids)
            if out.finished:
                return num_tokens

    queues = [asyncio.Queue() for _ in range(streams)]
    core.start()
    calling = asyncio.ensure_future(caller())
    started = time.perf_counter()
    try:
        for i, queue in enumerate(queues):
            prompt = [1] + [rng.randrange(4, vocab) for _ in range(prompt_len - 1)]
            core.add_request(AddRequest(f"h{seed}-{i}", prompt, options), queue)
        num_tokens = sum(await asyncio.gather(*(reader(queue) for queue in queues)))
        wall = time.perf_counter() - started
        done.set()
        await calling
    finally:
        core.stop()  # (close would close the engine too: it serves every pass)
        del engine.step
    lags["taken"] = [t - r for r, t in zip(returned, taken)]
    return lags, num_tokens / wall


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF checkpoint (default: the tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--streams", default="1,4")
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num-blocks", type=int, default=4096)
    parser.add_argument(
        "--call-every-ms",
        type=float,
        default=0.0,
        help="the caller's pause between calls (0: one call after another)",
    )
    parser.add_argument(
        "--launch-gil-ms",
        type=float,
        default=0.0,
        help="Python host work holding the GIL before each step (a GPU step's launch: ~1 ms "
        "for the 8B model on an H100); the CPU's tiny model launches in far less",
    )
    parser.add_argument(
        "--as-on-a-device",
        action="store_true",
        help="count a launched step as still running on the CPU too (the engine then waits there)",
    )
    args = parser.parse_args()
    if args.as_on_a_device:
        LLMEngine.has_step_in_flight = property(lambda engine: engine._in_flight is not None)
    counts = [int(s) for s in args.streams.split(",")]
    engine = LLMEngine(
        EngineConfig(
            args.model or str(tiny_model_dir()),
            device=args.device,
            max_num_seqs=max(counts),
            num_blocks=args.num_blocks,
        )
    )
    for streams in counts:  # warm-up: each batch's shapes (and graphs) before anything is timed
        asyncio.run(_run(engine, streams, args.prompt_len, 8, seed=0))
    print(
        f"# ms from a step's return on the engine thread to the loop taking its outputs (taken) and "
        f"to each output's reader having it (read), and from the engine thread applying a call to "
        f"its caller having the reply (replies); median and p90 of every step, output or call of "
        f"{args.repeats} passes per row in turns (each other round the other first), prompt "
        f"{args.prompt_len}, {args.max_tokens} tokens each, a call every {args.call_every_ms} ms, "
        f"launch GIL {args.launch_gil_ms} ms; device {args.device}"
    )
    print(
        f"{'streams':>8}{'engine thread':>15}"
        + "".join(f"{kind + ' median':>16}{'p90':>8}" for kind in ("taken", "read", "replies"))
        + f"{'tok/s':>10}"
    )
    for streams in counts:
        lags = {name: {"taken": [], "read": [], "replies": []} for name in _VARIANTS}
        rates: dict[str, list[float]] = {name: [] for name in _VARIANTS}
        for r in range(args.repeats):
            order = list(_VARIANTS.items())
            for name, (bound, replies_wait, turns) in order if r % 2 == 0 else order[::-1]:
                engine_core._HANDOVER_WAIT_S, engine_core._HANDOVER_TURNS = bound, turns
                try:
                    got, rate = asyncio.run(
                        _run(
                            engine,
                            streams,
                            args.prompt_len,
                            args.max_tokens,
                            r + 1,
                            replies_wait,
                            args.call_every_ms / 1e3,
                            args.launch_gil_ms / 1e3,
                        )
                    )
                finally:
                    engine_core._HANDOVER_WAIT_S, _, engine_core._HANDOVER_TURNS = _VARIANTS["wait"]
                for kind, samples in got.items():
                    lags[name][kind] += [x for x in samples if not math.isnan(x)]
                rates[name].append(rate)
        for name in _VARIANTS:
            line = f"{streams:>8}{name:>15}"
            for samples in lags[name].values():
                ms = sorted(x * 1e3 for x in samples)
                line += f"{statistics.median(ms):>16.3f}{ms[int(0.9 * (len(ms) - 1))]:>8.3f}"
            print(line + f"{statistics.median(rates[name]):>10.1f}")
    engine.close()


if __name__ == "__main__":
    main()
