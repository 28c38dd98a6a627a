"""Host time per output on the worker's serving path, the part of a large decode step that runs
in Python (issue 7: the served step at batch 256 took 2x the in-process one, host-bound).

    python bench/host_path.py              # batch 256, 100 steps, on whatever CPU this is

1. The worker's event loop, per engine output of a streamed request on an output stream (the
   router's calls, worker/output_sink.py): the output becomes its entry in the stream's next
   EngineOutputs, which is then built and serialized. Measured with the real request, metrics
   tracker, text passthrough and output stream (no gRPC: what the write costs is the same
   either way), once with every output made a full message first (the path of a step whose
   output holds more than new tokens) and once as a decode step's usual output goes (its new
   tokens straight into an EngineOutput entry).
2. The engine thread, per sequence of a decode step: schedule, build the inputs, postprocess
   (the forward itself subtracted), on the tiny model on the CPU.

Both run on the host's CPU only; the GPU changes neither (the GPU engine's step adds its graph
replay and a synchronize, which release the GIL).
"""

from __future__ import annotations

import argparse
import asyncio
import time

from tandem.common.metrics import ProcessMetrics, RequestMetrics
from tandem.engine.messages import StepOutput
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.sequence import Phase
from tandem.text.front import TextRequest
from tandem.text.processor import TextOptions, TextProcessor
from tandem.v1 import llm_pb2
from tandem.worker.output_processor import WorkerRequest
from tandem.worker.output_sink import OutputSink
from tandem.worker.output_streams import OutputStream


class _Core:
    """What a WorkerRequest asks of the engine core here: nothing runs."""

    engine = None

    def add_request(self, command, stream) -> None:
        pass

    def abort(self, request_id: str) -> bool:
        return True


async def loop_per_output(
    metrics: RequestMetrics, batch: int, steps: int, bare_tokens: bool
) -> dict:
    stream = OutputStream()
    batches = stream.batches()
    await batches.__anext__()  # the stream id
    sinks = []
    for i in range(batch):
        request = WorkerRequest(
            _Core(),
            f"r{i}",
            list(range(512)),
            SamplingOptions(max_tokens=steps + 1),
            Phase.CONTEXT_AND_GENERATION,
            0.5,
            None,
        )
        text = TextRequest(
            llm_pb2.GenerateRequest(), TextProcessor(None, TextOptions(detokenize=False)), True
        )
        sink = OutputSink(text, metrics.track(), stream, i)
        sink.bind(request)
        sink._bare_tokens = sink._bare_tokens and bare_tokens
        sinks.append(sink)
    put_s = build_s = 0.0
    num_bytes = 0
    for step in range(steps + 1):
        last = step == steps
        outputs = [
            StepOutput(f"r{i}", [step + 3], [None], -0.5 * step, last, num_prompt_tokens=512)
            for i in range(batch)
        ]
        started = time.perf_counter()
        for sink, output in zip(sinks, outputs):
            sink.put_nowait(output)
        put_done = time.perf_counter()
        message = await batches.__anext__()
        data = message.SerializeToString()
        done = time.perf_counter()
        if 0 < step < steps:  # a decode step's outputs: neither a request's first nor its last
            put_s += put_done - started
            build_s += done - put_done
            num_bytes += len(data)
    writer = asyncio.ensure_future(batches.__anext__())  # runs the last batch's written callbacks
    await asyncio.sleep(0)
    assert all(sink.done.done() and sink.done.exception() is None for sink in sinks)
    writer.cancel()
    n = batch * (steps - 1)
    return dict(put_us=put_s / n * 1e6, batch_us=build_s / n * 1e6, bytes=num_bytes / n)


def engine_per_sequence(batch: int, steps: int) -> dict:
    import torch

    from tandem.engine.checkpoints import tiny_model_dir
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine

    torch.set_num_threads(1)
    engine = LLMEngine(
        EngineConfig(
            str(tiny_model_dir()),
            block_size=16,
            num_blocks=batch * 32,
            max_num_seqs=batch,
            max_num_batched_tokens=batch * 32,
        )
    )
    for i in range(batch):
        engine.add_request(
            f"r{i}",
            list(range(1, 33)),
            SamplingOptions(max_tokens=steps + 8, ignore_eos=True),
            Phase.CONTEXT_AND_GENERATION,
            0.5,
            None,
            [],
            None,
        )
    for _ in range(3):  # the prefill and the first decode steps
        engine.step()
    forward_s = [0.0]
    forward = engine.runner._forward

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return forward(*args, **kwargs)
        finally:
            forward_s[0] += time.perf_counter() - started

    engine.runner._forward = timed
    started = time.perf_counter()
    for _ in range(steps):
        engine.step()
    wall = time.perf_counter() - started
    host = wall - forward_s[0]
    return dict(
        step_ms=wall / steps * 1e3,
        forward_ms=forward_s[0] / steps * 1e3,
        host_ms=host / steps * 1e3,
        host_us_per_seq=host / steps / batch * 1e6,
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args()
    print(
        f"# bench/host_path.py --batch {args.batch} --steps {args.steps}; {time.strftime('%Y-%m-%d %H:%M:%S')}"
    )
    metrics = ProcessMetrics("both").requests
    full = asyncio.run(loop_per_output(metrics, args.batch, args.steps, bare_tokens=False))
    bare = asyncio.run(loop_per_output(metrics, args.batch, args.steps, bare_tokens=True))
    engine = engine_per_sequence(args.batch, min(args.steps, 60))
    print(
        f"{'worker loop, per decode output':44s} {'sink us':>8s} {'batch+serialize us':>19s} {'bytes':>6s} "
        f"{'ms per step of ' + str(args.batch):>18s}"
    )
    for name, row in (("full message each", full), ("token entries", bare)):
        per_step = (row["put_us"] + row["batch_us"]) * args.batch / 1e3
        print(
            f"{name:44s} {row['put_us']:8.1f} {row['batch_us']:19.1f} {row['bytes']:6.1f} {per_step:18.2f}"
        )
    print(
        f"speed-up of the loop's part: {(full['put_us'] + full['batch_us']) / (bare['put_us'] + bare['batch_us']):.1f}x"
    )
    print(
        f"engine thread, decode step of {args.batch} (tiny model, CPU): step {engine['step_ms']:.2f} ms = forward "
        f"{engine['forward_ms']:.2f} + host {engine['host_ms']:.2f} ms ({engine['host_us_per_seq']:.1f} us per sequence)"
    )


if __name__ == "__main__":
    main()
