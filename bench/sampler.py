"""The greedy draw on the GPU: greedy_triton's two kernels against torch's ops for the same
answer (logsumexp, argmax, gather, subtract), each replayed as a CUDA graph (GPU time without
launch cost, as in a decode step whose host runs ahead), and Sampler.sample end to end on
all-greedy rows (wall per call: what the bench/serve.py profile calls the sampler), at the
Llama-3 vocabulary, beside the floor: one read of the float32 logits at the copy rate measured
in the same run; the logits rotate through copies twice the L2's size, so each call reads HBM.

    python bench/sampler.py                 # CUDA: batch 1, 32, 64, 256 x 128256
    python bench/sampler.py --vocab 49152   # SmolLM2's vocabulary

On a CPU only torch's path and the sampler are timed (the kernels and the floor need CUDA).
"""

from __future__ import annotations

import argparse
import time

import torch
from serve import copy_bandwidth

from tandem.engine.sampler import Sampler
from tandem.engine.sampling_options import SamplingOptions
from tandem.kernels import greedy


def graph_ms(fn, inputs: list, calls: int = 20, replays: int = 10) -> float:
    """GPU ms per call of fn, captured `calls` times in one CUDA graph (call i on inputs[i % len])
    and replayed: inputs larger than the L2 together make every call read from HBM."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn(inputs[0])
        fn(inputs[-1])
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(inputs[i % len(inputs)])
    graph.replay()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / (replays * calls)


def wall_ms(device: torch.device, fn, calls: int = 50) -> float:
    """Wall ms per call of fn back to back, the device synchronized at both ends."""
    fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return (time.perf_counter() - start) / calls * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--batches", default="1,32,64,256")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    on_gpu = device.type == "cuda"
    name = torch.cuda.get_device_name(device) if on_gpu else "cpu"
    print(
        f"# bench/sampler.py; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; {name}; "
        f"torch {torch.__version__}; vocab {args.vocab}"
    )
    copy_gbs = copy_bandwidth(device) if on_gpu else float("nan")
    if on_gpu:
        from tandem.kernels import greedy_triton

        print(f"device copy {copy_gbs:.0f} GB/s (read + write)")
    print(
        f"{'rows':>5} {'floor ms':>9} {'torch ops ms':>13} {'kernels ms':>11} {'x floor':>8} "
        f"{'sample(), torch ms':>19} {'sample(), kernels ms':>21}"
    )
    gen = torch.Generator(device).manual_seed(0)
    for rows in (int(b) for b in args.batches.split(",")):
        logits = torch.randn(rows, args.vocab, generator=gen, device=device) * 4
        # One read of the logits at the copy rate (which counts the bytes read and written).
        floor = rows * args.vocab * 4 / copy_gbs / 1e6
        # Copies of the logits that together are >= 2x the L2, so the graphs' calls read HBM.
        num_copies = 1
        if on_gpu:
            l2_bytes = getattr(torch.cuda.get_device_properties(device), "L2_cache_size", 64 << 20)
            num_copies = max(1, -(-2 * l2_bytes // logits.nbytes))
        copies = [logits] + [logits.clone() for _ in range(num_copies - 1)]
        sampler = Sampler(args.vocab, max_rows=rows, device=device)
        options = [SamplingOptions(max_tokens=16)] * rows
        empty = ([0] * rows, [[]] * rows, [[]] * rows, [frozenset()] * rows)

        def sample():
            sampler.sample(logits, options, *empty).to_host()

        torch_ops = (
            graph_ms(greedy.greedy_draw, copies)
            if on_gpu
            else wall_ms(device, lambda: greedy.greedy_draw(logits))
        )
        if on_gpu:
            fused = graph_ms(greedy_triton.greedy_draw, copies)
            sample_kernels = wall_ms(device, sample)
            import tandem.kernels.dispatch as dispatch

            original, dispatch.greedy_draw = dispatch.greedy_draw, greedy.greedy_draw
            try:
                sample_torch = wall_ms(device, sample)
            finally:
                dispatch.greedy_draw = original
        else:
            fused = sample_kernels = float("nan")
            sample_torch = wall_ms(device, sample)
        print(
            f"{rows:5d} {floor:9.4f} {torch_ops:13.4f} {fused:11.4f} {fused / floor:8.2f} "
            f"{sample_torch:19.4f} {sample_kernels:21.4f}"
        )


if __name__ == "__main__":
    main()
