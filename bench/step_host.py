"""The engine's host work per decode step (issues 28 and 39): where the CPU time of a step goes,
by function, beside the step period, for a few batch sizes; and the first step of a sequence
whose KV was imported (a split's decode), from an idle engine, against a step in the stream.

In steady decoding the host work of step N+1 overlaps the device's step N (overlap scheduling):
it costs nothing while it is shorter than the device's step. The first step after idle has
nothing to hide behind, so its host work adds to the split's time to the second token.

    python bench/step_host.py                                # the tiny model on the CPU
    python bench/step_host.py --device cuda --model <8B checkpoint> --batches 1,64,256
    python bench/step_host.py --device cuda --model <8B checkpoint> --batches 1 --trace-first

--trace-first: the imported sequence's first step() call under torch.profiler as well (CPU ops
and the CUDA runtime calls they make, by own time): the host work cProfile shows only as C.
Per batch size also: one decode step's pack alone, called over and over (a hot-cache floor).
--parts: the first step() call taken apart by wall clock (schedule, pack, upload, the graph's
replay, the draws, the rest), back to back and after --idle-ms asleep or spinning (an engine idle
between requests), beside a step in the stream: no profiler hooks, so the numbers are the call's own.

Prints, per batch size: the step period, and the functions with the most time of their own
(cProfile; a call that waits for the device shows its wait as its own time: .tolist(),
synchronize); then the imported sequence's first steps.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import random
import statistics
import time

from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions


def _prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [1] + [rng.randrange(4, min(vocab, 30_000)) for _ in range(length - 1)]


def profile_batch(engine: LLMEngine, batch: int, steps: int, prompt_len: int, top: int) -> None:
    rng = random.Random(batch)
    vocab = engine.model_config.vocab_size
    options = SamplingOptions(max_tokens=100_000, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"b{batch}-{i}", _prompt(rng, prompt_len, vocab), options)
    for _ in range(8):  # the prompts, then decoding only
        engine.step()
    device_s, undo = _wrap_parts(engine, _DEVICE_PARTS)
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    period_ms = (time.perf_counter() - started) / steps * 1e3
    forward_ms = device_s["device"] / steps * 1e3
    undo()
    if engine.runner.device.type == "cpu":  # the forward and the draws run as they are called
        print(
            f"\n## batch {batch}: unprofiled, {period_ms:.3f} ms a step = the forward and the draws "
            f"{forward_ms:.3f} ms + the engine's host work {period_ms - forward_ms:.3f} ms"
        )
    print(f"## batch {batch}: packing one decode step's inputs alone {_pack_alone(engine):.1f} us")
    profile = cProfile.Profile()
    profile.enable()
    for _ in range(steps):
        engine.step()
    profile.disable()
    for i in range(batch):
        engine.abort_request(f"b{batch}-{i}")
    while engine.num_unfinished:
        engine.step()
    stats = pstats.Stats(profile)
    total_ms = stats.total_tt / steps * 1e3
    # The device's part, by the functions that launch it or wait for it (on the CPU they run it):
    # what is left of the profiled step is the engine's own host work.
    device_ms = (
        sum(
            cumulative
            for (path, _, name), (_, _, _, cumulative, _) in stats.stats.items()
            if (path.endswith("model_runner.py") and name == "_forward")
            or (path.endswith("sampler.py") and name == "sample")
            or name == "to_host"
        )
        / steps
        * 1e3
    )
    print(
        f"\n## batch {batch}: step period {period_ms:.3f} ms; profiled {total_ms:.3f} ms a step, "
        f"of which the forward, the draws and waiting for them {device_ms:.3f} ms; host work "
        f"{total_ms - device_ms:.3f} ms (cProfile-inflated)"
    )
    print(f"{'own ms/step':>12} {'calls/step':>11}  function")
    rows = sorted(stats.stats.items(), key=lambda kv: kv[1][2], reverse=True)[:top]
    for (path, line, name), (_, calls, own, _, _) in rows:
        where = f"{path.rsplit('/', 2)[-1] if '/' in path else path}:{line}({name})"
        print(f"{own / steps * 1e3:>12.3f} {calls / steps:>11.1f}  {where}")


def _pack_alone(engine: LLMEngine, calls: int = 200, repeats: int = 7) -> float:
    """Microseconds a call of InputBuffers.pack takes on the engine's next decode step, packed
    over and over (median of repeats of calls; a hot cache, so a floor for the step's pack)."""
    inputs = engine.runner.inputs
    pack, seen = inputs.pack, []
    inputs.pack = lambda *args: seen.append(args) or pack(*args)
    try:
        engine.step()
    finally:
        del inputs.pack  # the instance attribute shadowed the method
    args = seen[-1]
    runs = []
    for _ in range(repeats):
        started = time.perf_counter()
        for _ in range(calls):
            pack(*args)
        runs.append((time.perf_counter() - started) / calls * 1e6)
    return statistics.median(runs)


def first_steps(engine: LLMEngine, prompt_len: int, repeats: int, top: int = 0) -> None:
    """An imported sequence (its blocks reserved, the KV taken as landed) from an idle engine: the
    step() calls until its first token, against the steps after it; each of the first calls'
    own time (on CUDA the first call is the launch's host work alone), and with top, the
    functions with the most own time in the first call (cProfile, after two unprofiled repeats)."""
    rng = random.Random(7)
    vocab = engine.model_config.vocab_size
    first, later, by_call = [], [], [[], [], []]
    profile = cProfile.Profile()
    for r in range(repeats):
        rid = f"import-{r}"
        options = SamplingOptions(max_tokens=8, ignore_eos=True)
        engine.add_remote_kv_request(rid, _prompt(rng, prompt_len, vocab), [5], options)
        engine.remote_kv_arrived(rid)
        started = time.perf_counter()
        got = 0
        calls = []
        while engine.num_unfinished:
            profiled = top and r >= 2 and not calls
            if profiled:
                profile.enable()
            t = time.perf_counter()
            outs = engine.step()
            calls.append((time.perf_counter() - t) * 1e3)
            if profiled:
                profile.disable()
            if outs and not got:
                first.append((time.perf_counter() - started) * 1e3)
            got += len(outs)
        later.extend(calls[2:-1])
        for i, ms in enumerate(calls[: len(by_call)]):
            by_call[i].append(ms)
    print(
        f"\n## an imported sequence ({prompt_len} prompt tokens) from an idle engine, {repeats} times: "
        f"first token {statistics.median(first):.3f} ms after the KV landed (median); later "
        f"step() calls {statistics.median(later):.3f} ms; its first step() calls "
        + " / ".join(f"{statistics.median(c):.3f}" for c in by_call if c)
        + " ms"
    )
    if top:
        print(
            "# the first step() call (the launch), by own time, profiled (inflated by its hooks):"
        )
        pstats.Stats(profile).sort_stats("tottime").print_stats(top)


def trace_first_step(engine: LLMEngine, prompt_len: int, repeats: int, top: int) -> None:
    """The imported sequence's first step() call under torch.profiler, CPU activity with the CUDA
    runtime's calls (cudaGraphLaunch, cudaMemcpyAsync, synchronizations): their own time summed
    over `repeats` first calls, so that the C part of the launch is named. A profiler per call
    (started before it, stopped after): with one profiler's collection toggled around each call,
    the runtime's events did not show on the GPU machine (torch 2.11)."""
    from collections import defaultdict

    from torch.profiler import ProfilerActivity, profile

    rng = random.Random(11)
    vocab = engine.model_config.vocab_size
    activities = [ProfilerActivity.CPU]
    if engine.runner.device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    walls, own_ms, counts = [], defaultdict(float), defaultdict(int)
    for r in range(repeats):
        rid = f"trace-{r}"
        options = SamplingOptions(max_tokens=4, ignore_eos=True)
        engine.add_remote_kv_request(rid, _prompt(rng, prompt_len, vocab), [5], options)
        engine.remote_kv_arrived(rid)
        with profile(activities=activities) as prof:
            started = time.perf_counter()
            engine.step()
            walls.append((time.perf_counter() - started) * 1e3)
        for event in prof.key_averages():
            own_ms[event.key] += event.self_cpu_time_total / 1e3
            counts[event.key] += event.count
        while engine.num_unfinished:
            engine.step()
    print(
        f"\n# the imported sequence's first step() call under torch.profiler, {repeats} times: "
        f"{statistics.median(walls):.3f} ms a call (median, profiled); own CPU time by op and "
        f"runtime call, per call:"
    )
    for key, ms in sorted(own_ms.items(), key=lambda kv: -kv[1])[:top]:
        print(f"  {ms / repeats:8.3f} ms  {counts[key] / repeats:6.1f} calls  {key[:80]}")


# On the CPU, where they run as they are called, the forward and the draws are the device's part
# of a step: its time outside them is host work.
_DEVICE_PARTS = (("device", "runner", "_forward"), ("device", "runner.sampler", "sample"))
_PARTS = (  # (label, owner path from the engine, attribute): each wrapped in a wall-clock timer
    ("schedule", "scheduler", "schedule"),
    ("pack", "runner.inputs", "pack"),
    ("upload", "runner.inputs", "upload"),
    ("replay", "runner.graphs", "run"),
    ("draws", "runner.sampler", "sample"),
    ("execute", "runner", "execute"),
    ("postprocess", "", "_postprocess"),
)


def _wrap_parts(engine: LLMEngine, parts=_PARTS) -> tuple[dict[str, float], callable]:
    """Wall-clock timers around parts (an instance attribute shadowing each method; parts with one
    label add up); returns the seconds by label and a function that removes the timers."""
    spent = dict.fromkeys([label for label, _, _ in parts], 0.0)
    owners = []
    for label, path, name in parts:
        owner = engine
        for attr in filter(None, path.split(".")):
            owner = getattr(owner, attr)
        if owner is None:
            continue
        fn = getattr(owner, name)

        def timed(*args, _fn=fn, _label=label, **kwargs):
            started = time.perf_counter()
            try:
                return _fn(*args, **kwargs)
            finally:
                spent[_label] += time.perf_counter() - started

        setattr(owner, name, timed)
        owners.append((owner, name))

    def undo() -> None:
        for owner, name in owners:
            delattr(owner, name)

    return spent, undo


def _idle(how: str, ms: float) -> None:
    """Waits ms: asleep (the core may go idle, as an engine thread blocked on its queue does) or
    spinning (the core kept busy)."""
    if how == "asleep":
        time.sleep(ms / 1e3)
    else:
        end = time.perf_counter() + ms / 1e3
        while time.perf_counter() < end:
            pass


def first_step_parts(engine: LLMEngine, prompt_len: int, repeats: int, idle_ms: float) -> None:
    """The imported sequence's first step() call by part (wall clock, median over repeats): back
    to back with the sequence before it, after idle_ms asleep and after idle_ms spinning (whether
    an idle core's wake-up is what the first launch pays), beside its third call (a step in the
    stream: it waits for the one before, so its 'rest' holds that wait)."""
    rng = random.Random(13)
    vocab = engine.model_config.vocab_size
    spent, undo = _wrap_parts(engine)
    variants = {"back to back": None, "asleep": "asleep", "spinning": "spinning"}
    rows: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    stream: list[dict[str, float]] = []
    try:
        for r in range(len(variants) * repeats):
            name = list(variants)[r % len(variants)]
            rid = f"parts-{r}"
            options = SamplingOptions(max_tokens=4, ignore_eos=True)
            engine.add_remote_kv_request(rid, _prompt(rng, prompt_len, vocab), [5], options)
            engine.remote_kv_arrived(rid)
            if variants[name]:
                _idle(variants[name], idle_ms)
            call = 0
            while engine.num_unfinished:
                for label in spent:
                    spent[label] = 0.0
                started = time.perf_counter()
                engine.step()
                wall = time.perf_counter() - started
                if call in (0, 2):
                    row = {k: v * 1e3 for k, v in spent.items()} | {"wall": wall * 1e3}
                    (rows[name] if call == 0 else stream).append(row)
                call += 1
    finally:
        undo()
    labels = [label for label, _, _ in _PARTS]
    print(
        f"\n# the imported sequence's first step() call by part, ms (median of {repeats}; "
        f"asleep / spinning: for {idle_ms:g} ms before it; 'execute' holds pack, upload, replay "
        "and draws; 'rest' = wall - schedule - execute - postprocess)"
    )
    print(f"{'':>22}" + "".join(f"{label:>12}" for label in labels + ["rest", "wall"]))
    for name, samples in list(rows.items()) + [("a step in the stream", stream)]:
        med = {k: statistics.median(s[k] for s in samples) for k in labels + ["wall"]}
        rest = med["wall"] - med["schedule"] - med["execute"] - med["postprocess"]
        print(
            f"{name:>22}"
            + "".join(f"{med[k]:>12.3f}" for k in labels)
            + f"{rest:>12.3f}{med['wall']:>12.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="HF checkpoint (default: the tiny model)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--import-len", type=int, default=1024)
    parser.add_argument("--num-blocks", type=int, default=8192)
    parser.add_argument("--top", type=int, default=25)
    parser.add_argument(
        "--trace-first",
        action="store_true",
        help="also trace the imported sequence's first step() calls with torch.profiler",
    )
    parser.add_argument(
        "--parts",
        action="store_true",
        help="also time the imported sequence's first step() call part by part (wall clock)",
    )
    parser.add_argument(
        "--idle-ms",
        type=float,
        default=50.0,
        help="--parts: the idle time before the asleep and spinning variants",
    )
    parser.add_argument(
        "--tables",
        default="new",
        help="new: the device's block table gets a row's new entries only (the default); "
        "whole: every entry every step (before); both: each batch size twice, whole first",
    )
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    engine = LLMEngine(
        EngineConfig(
            args.model or str(tiny_model_dir()),
            device=args.device,
            max_num_seqs=max(batches),
            num_blocks=args.num_blocks,
            max_num_batched_tokens=8192,
        )
    )
    engine.warm_up()
    print(f"# host work per decode step: {args.model or 'tiny model'} on {args.device}")
    first_steps(engine, args.import_len, 12, args.top)
    if args.parts:
        first_step_parts(engine, args.import_len, 12, args.idle_ms)
    if args.trace_first:
        trace_first_step(engine, args.import_len, 8, args.top)
    modes = {"new": [True], "whole": [False], "both": [False, True]}[args.tables]
    for batch in batches:
        for incremental in modes:
            engine.runner.inputs.incremental_tables = incremental
            print(f"\n# block tables: {'new entries only' if incremental else 'every entry'}")
            profile_batch(engine, batch, args.steps, args.prompt_len, args.top)
    engine.close()


if __name__ == "__main__":
    main()
