"""How long a step's outputs and a command's reply wait for the worker's event loop (issue 39). The
engine thread hands each step's outputs and each reply to the loop (call_soon_threadsafe) and,
while the step launched before runs on the device or nothing is left to run, waits with the GIL
released until the loop has them (at most engine_core._HANDOVER_WAIT_S); before aeef4a5 (outputs)
and the session after it (replies) it went straight on with the stats and the next step's launch,
and the loop, woken, waited for the GIL.

An EngineCore on an asyncio loop, as in a worker; --streams requests at a time, each of
--max-tokens tokens after a --prompt-len prompt. Per stream count, in turns --repeats times: with
the wait, and without it (its bound set to 0: the old behaviour). Meanwhile a caller on the loop
asks the engine for its counters (ReadCounters, a command with a reply, as a decode's reservation
or a peer's LeasePrefix) again and again. Prints the lag from each step's return on the engine
thread to the loop taking its outputs, and from the engine thread applying each call to the loop
having its reply (median, p90, max over every step or call of every repeat), and the tokens per
second of the whole run. On the CPU, where a step has run by the time it is launched, the engine
waits only at a request's end (nothing left to run), so the two rows differ only there, unless
--as-on-a-device counts the CPU's launched step as still running (as the tests do).

    python bench/engine_handover.py                                   # the tiny model on the CPU
    python bench/engine_handover.py --device cuda --model <8B checkpoint> --streams 1,16,64
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time

from tandem.engine import engine_core
from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.engine_core import EngineCore
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.messages import AddRequest, ReadCounters
from tandem.engine.sampling_options import SamplingOptions

_VARIANTS = {"wait": engine_core._HANDOVER_WAIT_S, "no wait": 0.0}


async def _run(
    engine: LLMEngine, streams: int, prompt_len: int, max_tokens: int, seed: int
) -> tuple[list[float], list[float], float]:
    """One pass: returns the outputs' lags (seconds, one per step with outputs), the replies' lags
    (one per call) and the tokens per second."""
    returned: list[float] = []  # when each step with outputs returned on the engine thread
    taken: list[float] = []  # when the loop took each step's outputs (the same order)
    replies: list[float] = []
    core = EngineCore(engine, asyncio.get_running_loop())
    read_counters = core._handlers[ReadCounters]
    # The call's reply carries when the engine thread applied it.
    core._handlers[ReadCounters] = lambda c: (time.perf_counter(), read_counters(c))
    done = asyncio.Event()

    async def caller():
        while not done.is_set():
            applied, _ = await core.call(ReadCounters())
            replies.append(time.perf_counter() - applied)

    step = engine.step

    def timed_step():
        outputs = step()
        if outputs:
            returned.append(time.perf_counter())
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
    queues = [asyncio.Queue() for _ in range(streams)]
    core.start()
    calling = asyncio.ensure_future(caller())
    started = time.perf_counter()
    try:
        for i, queue in enumerate(queues):
            prompt = [1] + [rng.randrange(4, vocab) for _ in range(prompt_len - 1)]
            core.add_request(AddRequest(f"h{seed}-{i}", prompt, options), queue)
        num_tokens = 0
        for queue in queues:
            while True:
                out = await asyncio.wait_for(queue.get(), timeout=300)
                num_tokens += len(out.new_token_ids)
                if out.finished:
                    break
        wall = time.perf_counter() - started
        done.set()
        await calling
    finally:
        core.stop()  # (close would close the engine too: it serves every pass)
        del engine.step
    return [t - r for r, t in zip(returned, taken)], replies, num_tokens / wall


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
        f"# a step's outputs (a call's reply): from the step's return (the call applied) on the engine thread to the loop taking "
        f"them, ms; {args.repeats} passes per row in turns (each other round the other first), prompt {args.prompt_len}, "
        f"{args.max_tokens} tokens each; device {args.device}"
    )
    print(
        f"{'streams':>8}{'engine thread':>15}{'outputs: median':>17}{'p90':>9}{'max':>9}"
        f"{'replies: median':>17}{'p90':>9}{'max':>9}{'tok/s':>11}"
    )
    for streams in counts:
        lags: dict[str, list[float]] = {name: [] for name in _VARIANTS}
        reply_lags: dict[str, list[float]] = {name: [] for name in _VARIANTS}
        rates: dict[str, list[float]] = {name: [] for name in _VARIANTS}
        for r in range(args.repeats):
            order = list(_VARIANTS.items())
            for name, bound in order if r % 2 == 0 else order[::-1]:
                engine_core._HANDOVER_WAIT_S = bound
                try:
                    got, replied, rate = asyncio.run(
                        _run(engine, streams, args.prompt_len, args.max_tokens, seed=r + 1)
                    )
                finally:
                    engine_core._HANDOVER_WAIT_S = _VARIANTS["wait"]
                lags[name] += got
                reply_lags[name] += replied
                rates[name].append(rate)
        for name in _VARIANTS:
            line = f"{streams:>8}{name:>15}"
            for samples in (lags[name], reply_lags[name]):
                ms = sorted(x * 1e3 for x in samples)
                line += f"{statistics.median(ms):>17.3f}{ms[int(0.9 * (len(ms) - 1))]:>9.3f}{ms[-1]:>9.3f}"
            print(line + f"{statistics.median(rates[name]):>11.1f}")
    engine.close()


if __name__ == "__main__":
    main()
