"""Batch-1 decode GEMMs: the Triton GEMV (kernels/gemv_triton.py) against cuBLAS, and the engine with each.

    python bench/gemv.py               # CUDA: the 8B shapes; the engine on serve.py's 8B checkpoint
    python bench/gemv.py --shape tiny  # CPU smoke run (interpreter, tiny shapes; numbers mean nothing)

1. Per weight shape of the 8B decoder, one CUDA graph replaying the GEMM over 8 distinct copies
   of the weight (nothing stays in L2 between them, as in a decode step): cuBLAS and each tile
   (BLOCK_N, BLOCK_K, warps) of the GEMV, as weight bytes per second against the copy rate.
   down_proj also with SwiGLU folded in (silu_mul_gemv) against SwiGLU kernel + cuBLAS.
2. The engine at batch 1: the decode graph's replay (GPU ms) and the step (wall ms) with
   TANDEM_GEMV=off (cuBLAS) and on (the GEMV with gemv_triton.tile_for's tiles), against the floor
   (weights / copy rate), and the greedy tokens of the two.
"""

from __future__ import annotations

import argparse
import itertools
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402 - the checkpoint writer, copy rate and timers live there

SHAPES_8B = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
    "lm_head": (128256, 4096),
}
SHAPES_TINY = {"qkv": (256, 128), "o": (128, 128), "down": (128, 256)}
TILES = [(bn, bk, w) for bn, bk, w in itertools.product((1, 2, 4, 8), (512, 1024, 2048), (4, 8))]
# An FP8 row is half the bytes of a bf16 one: the same bytes a load take twice the columns.
TILES_FP8 = [
    (bn, bk, w)
    for bn, bk, w in itertools.product((1, 2, 4, 8), (1024, 2048, 4096, 8192), (4, 8, 16))
]
TILES_TINY = [(2, 128, 4), (4, 64, 4)]


def _graph_ms(fn, device, copies) -> float:
    """ms per call of fn(i) for i in range(copies), replayed as one graph (CPU: timed directly)."""

    def run_all():
        for i in range(copies):
            fn(i)

    if device.type != "cuda":
        start = time.perf_counter()
        run_all()
        return (time.perf_counter() - start) * 1e3 / copies
    run_all()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        run_all()
    return serve.gpu_ms(device, graph.replay, num=30) / copies


def sweep(device, shapes, tiles, copy_gbs, fp8: bool = False) -> dict:
    """Best tile per shape name (and 'down+silu'), printing every row. fp8: the FP8 GEMV over
    e4m3 weights with one scale a row (--quantization fp8's), against cuBLAS on the bf16 weight
    (what the FP8 pass is to beat) and its own bytes at the copy rate."""
    from tandem.kernels import dispatch, gemv_triton
    from tandem.kernels.fp8 import quantize_rows

    gen = torch.Generator(device).manual_seed(serve.SEED)
    copies = 8 if device.type == "cuda" else 2
    best = {}
    print(
        f"one-row {'FP8 (e4m3, a scale a row) ' if fp8 else ''}GEMMs, {copies} distinct weight copies "
        f"per graph (ms per GEMM; x copy rate {copy_gbs:.0f} GB/s; cuBLAS on the bf16 weight):"
    )
    print(
        f"  {'gemm':<10}{'N x K':>14}{'cuBLAS':>9}{'x copy':>7}{'best tile':>18}{'GEMV':>9}{'x copy':>7}{'default':>9}"
        f"  all tiles (ms)"
    )
    for name, (N, K) in list(shapes.items()) + [("down+silu", shapes["down"])]:
        silu = name == "down+silu"
        weights = [
            torch.randn(N, K, generator=gen, device=device, dtype=torch.bfloat16) * K**-0.5
            for _ in range(copies)
        ]
        x = torch.randn(1, 2 * K if silu else K, generator=gen, device=device, dtype=torch.bfloat16)
        if silu:
            cublas = _graph_ms(
                lambda i: F.linear(dispatch.silu_and_mul(x), weights[i]), device, copies
            )
        else:
            cublas = _graph_ms(lambda i: F.linear(x, weights[i]), device, copies)
        if fp8:
            quantized = [quantize_rows(w) for w in weights]
            del weights
            weights = quantized
            kernel = gemv_triton.fp8_silu_mul_gemv if silu else gemv_triton.fp8_gemv
            ours = lambda tile: lambda i: kernel(x, *weights[i], tile=tile)  # noqa: E731
        else:
            kernel = gemv_triton.silu_mul_gemv if silu else gemv_triton.gemv
            ours = lambda tile: lambda i: kernel(x, weights[i], tile=tile)  # noqa: E731
        times = {}
        for tile in tiles:
            try:
                times[tile] = _graph_ms(ours(tile), device, copies)
            except Exception as error:  # noqa: BLE001 - a tile that does not compile is just not a candidate
                print(f"    tile {tile} failed: {type(error).__name__}: {str(error)[:80]}")
        default = _graph_ms(ours(None), device, copies)
        tile, ms = min(times.items(), key=lambda item: item[1])
        best[name] = (tile, ms, cublas)
        nbytes = N * K * (1 if fp8 else 2)
        rate = lambda t, n=nbytes: n / t / 1e6 / copy_gbs  # noqa: E731
        print(
            f"  {name:<10}{f'{N}x{K}':>14}{cublas:9.4f}{rate(cublas, N * K * 2):7.2f}{str(tile):>18}{ms:9.4f}{rate(ms):7.2f}"
            f"{default:9.4f}  "
            + " ".join(f"{t[0]}/{t[1]}/{t[2]}:{v:.4f}" for t, v in sorted(times.items()))
        )
        del weights
    return best


def engine_rows(
    model_dir: Path, device, vocab: int, floor_ms: float, quantization: str = "auto", tuned=None
) -> None:
    """The decode graph's replay and the step at batch 1 with cuBLAS (TANDEM_GEMV=off), the shipped
    GEMV tiles (on) and, given tuned (the sweep's best tile per shape), those tiles; then the
    replay's kernels by GPU time (torch.profiler) with the last setting."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions
    from tandem.kernels import gemv_triton

    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype="bfloat16",
            kv_cache_memory_gb=8 if device.type == "cuda" else 0.5,
            max_num_seqs=8,
            max_num_batched_tokens=4096,
            max_model_len=4096,
            enable_prefix_caching=False,
            quantization=quantization,
        )
    )
    runner = engine.runner
    rng = random.Random(serve.SEED)
    prompt = [rng.randrange(3, vocab) for _ in range(128)]
    print(
        f"engine at batch 1{', ' + quantization + ' weights' if quantization != 'auto' else ''}, 128-token "
        f"prompt (floor {floor_ms:.2f} ms/step = weights / copy rate):"
    )
    print(
        f"  {'TANDEM_GEMV':<12}{'replay ms':>10}{'x floor':>8}{'step ms':>9}{'tok/s':>8}{'eager ms':>9}  greedy (64 tokens)"
    )
    shipped = gemv_triton.tile_for
    settings = [("off", shipped), ("on", shipped)]
    if tuned:
        settings.append(
            (
                "tuned",
                lambda N, K, silu=False, **kw: tuned.get((N, K, silu)) or shipped(N, K, silu, **kw),
            )
        )
    first = None
    for label, tiles in settings * 2:
        os.environ["TANDEM_GEMV"] = "off" if label == "off" else "on"
        gemv_triton.tile_for = tiles
        if runner.graphs is not None:
            runner.graphs.clear()
            runner.graphs.capture()
        engine.add_request(
            f"greedy-{label}", prompt, SamplingOptions(max_tokens=64, ignore_eos=True)
        )
        seq = engine.scheduler.waiting[-1]
        while engine.num_unfinished:
            engine.step()
        tokens = list(seq.output_token_ids)
        first = first or tokens
        agree = next((i for i, (a, b) in enumerate(zip(tokens, first)) if a != b), len(tokens))
        engine.add_request(
            f"timed-{label}", prompt, SamplingOptions(max_tokens=4000, ignore_eos=True)
        )
        for _ in range(3):
            engine.step()
        step_ms = _step_ms(engine, device, 30)
        replay = (
            serve.gpu_ms(device, lambda: runner.graphs.run(1), num=50)
            if runner.graphs
            else float("nan")
        )
        graphs, runner.graphs = runner.graphs, None
        eager_ms = _step_ms(engine, device, 3)
        runner.graphs = graphs
        for seq in list(engine.scheduler.running):
            engine.abort_request(seq.request_id)
        print(
            f"  {label:<12}{replay:10.3f}{replay / floor_ms:8.2f}{step_ms:9.2f}{1e3 / step_ms:8.1f}{eager_ms:9.2f}"
            f"  {'same as the first' if agree == len(tokens) else f'first differs at token {agree}'}"
        )
    if device.type == "cuda" and runner.graphs is not None:
        _kernel_table(device, lambda: runner.graphs.run(1), floor_ms)
    gemv_triton.tile_for = shipped


def _kernel_table(device, replay, floor_ms: float, num: int = 20) -> None:
    """The replay's kernels by GPU time per step (torch.profiler), largest first."""
    from torch.profiler import ProfilerActivity, profile

    replay()
    torch.cuda.synchronize(device)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(num):
            replay()
        torch.cuda.synchronize(device)
    rows = sorted(
        (e for e in prof.key_averages() if e.device_time_total > 0),
        key=lambda e: -e.device_time_total,
    )
    total = sum(e.device_time_total for e in rows) / num / 1e3
    print(
        f"  kernels of one replay (profiler): {total:.3f} ms of GPU time a step (floor {floor_ms:.2f})"
    )
    for e in rows[:14]:
        print(f"    {e.device_time_total / num / 1e3:8.3f} ms  {e.count // num:4d}x  {e.key[:90]}")


def _step_ms(engine, device, num: int) -> float:
    serve._sync(device)
    start = time.perf_counter()
    for _ in range(num):
        engine.step()
    serve._sync(device)
    return (time.perf_counter() - start) / num * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--shape", choices=sorted(serve.SHAPES), default=None)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--skip-engine", action="store_true")
    parser.add_argument(
        "--skip-sweep", action="store_true", help="only the engine rows (the shipped tiles)"
    )
    parser.add_argument(
        "--fp8",
        action="store_true",
        help="the FP8 GEMV (e4m3 weights, a scale a row) and the engine with --quantization fp8; "
        "the engine rows add the sweep's best tiles ('tuned')",
    )
    args = parser.parse_args()
    on_cuda = torch.cuda.is_available()
    if not on_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at import
    device = torch.device("cuda:0" if on_cuda else "cpu")
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    shape = serve.SHAPES[shape_name]
    copy_gbs = serve.copy_bandwidth(device)
    print(
        f"# bench/gemv.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu'}; copy {copy_gbs:.0f} GB/s (read + write)"
    )
    tiny = shape_name == "tiny"
    shapes = SHAPES_TINY if tiny else SHAPES_8B
    if args.fp8:  # the lm_head stays in the model dtype under --quantization fp8
        shapes = {name: nk for name, nk in shapes.items() if name != "lm_head"}
    best = {}
    if not args.skip_sweep:
        tiles = TILES_TINY if tiny else (TILES_FP8 if args.fp8 else TILES)
        best = sweep(device, shapes, tiles, copy_gbs, fp8=args.fp8)
    # The tuned map tile_for is swapped for: (N, K, silu) -> the best tile of that shape.
    tuned = {
        (*shapes["down" if name == "down+silu" else name], name == "down+silu"): tile
        for name, (tile, _, _) in best.items()
    }
    if args.skip_engine:
        return
    base = Path("/dev/shm") if on_cuda else Path(os.environ.get("TANDEM_HOME", "/tmp"))
    model_dir = serve.write_checkpoint(
        Path(args.model_dir or base / f"tandem-{shape_name}-bf16"), shape, device
    )
    floor_ms = serve.decode_bytes(shape) / 1e9 / copy_gbs * 1e3
    if args.fp8:  # the decoder's projections at one byte a weight; the lm_head at two
        lm_head = 2 * shape["vocab_size"] * shape["hidden_size"]
        floor_ms = ((serve.decode_bytes(shape) - lm_head) / 2 + lm_head) / 1e9 / copy_gbs * 1e3
    engine_rows(
        model_dir,
        device,
        shape["vocab_size"],
        floor_ms,
        quantization="fp8" if args.fp8 else "auto",
        tuned=tuned if args.fp8 else None,
    )


if __name__ == "__main__":
    main()
