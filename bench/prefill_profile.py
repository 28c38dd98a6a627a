"""Where a prefill step's time goes on the GPU (issue 7's TTFT row), and the GEMM rates behind it.

    python3 bench/prefill_profile.py [--model-dir DIR] [--quantization fp8 [--kv-cache-dtype fp8]]
    # CUDA; writes bench/serve.py's 8B checkpoint if missing

1. The 8B layer's GEMMs at 256, 2048 and 8192 rows under each BLAS library PyTorch can pick
   (cuBLAS, cuBLASLt), in TFLOP/s against the H200's dense bf16 peak (L2 flushed before each);
   with --quantization fp8 also the FP8 product the engine runs (torch._scaled_mm with per-token
   and per-channel scales) alone and with its activations' quantization, against the FP8 peak,
   and the same product with one scale per tensor, with and without fast accumulation.
2. One fresh 2048-token prompt in the engine (the TTFT row, in-process): its wall time from
   add_request to the first token, and the GPU time of its kernels by kind (torch profiler), so
   that the wall is held against the kernels' sum (what is not kernel time is host time the GPU
   waits for).
3. The same breakdown for an eager decode step of 256 sequences over 512-token prompts (the
   offline row's late steps; a replayed graph runs these kernels but hides them from the profiler).
4. Those sequences' graph decode steps as the engine runs them, timed by CUDA events at each
   step's input upload and after its graph (decode_timeline): whether the GPU waits for the host
   between graphs, and the host's time from a step's draws on the host to the next upload.
"""

from __future__ import annotations

import argparse
import functools
import random
import time
from collections import defaultdict
from pathlib import Path

import torch
import torch.nn.functional as F
from serve import SHAPES, _sync, write_checkpoint

BF16_DENSE_TFLOPS = 989.0
KINDS = (
    ("attention", ("_attention_kernel", "_merge_splits")),
    ("add+rmsnorm", ("_rms_norm",)),
    ("rope+kv store", ("_rope_store_kv", "_store_kv")),
    ("swiglu", ("_silu",)),
    # In an FP8 engine SwiGLU rides in the down projection's quantizer: its time is counted here.
    ("fp8 quantize(+swiglu)", ("_quantize_rows",)),
    ("gemv", ("_gemv",)),
    ("sampler", ("sort", "topk", "softmax", "argmax", "exponential", "_sample", "reduce")),
)
# The 8B layer's projections, (N, K) of each weight.
LAYER_GEMMS = {
    "qkv": (6144, 4096),
    "o": (4096, 4096),
    "gate_up": (28672, 4096),
    "down": (4096, 14336),
}
GEMM_MARKS = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "sm90")


def kind_of(name: str) -> str:
    lowered = name.lower()
    for kind, marks in KINDS:
        if any(m.lower() in lowered for m in marks):
            return kind
    return "gemm" if any(m in lowered for m in GEMM_MARKS) else "other"


def gemm_rates(device: torch.device) -> None:
    import triton.testing

    print("the 8B layer's GEMMs, TFLOP/s (dense bf16 peak 989):")
    print(
        f"  {'rows':>5} {'gemm':<8}"
        + "".join(f"{lib + ' ms':>14}{'TFLOP/s':>9}" for lib in ("cublas", "cublaslt"))
    )
    gen = torch.Generator(device).manual_seed(0)
    weights = {
        name: torch.randn(*shape, generator=gen, device=device).bfloat16() * 0.02
        for name, shape in LAYER_GEMMS.items()
    }
    for rows in (256, 2048, 8192):
        total = {"cublas": 0.0, "cublaslt": 0.0}
        for name, weight in weights.items():
            x = torch.randn(rows, weight.shape[1], generator=gen, device=device).bfloat16()
            flops = 2 * rows * weight.numel()
            line = f"  {rows:5d} {name:<8}"
            for lib in total:
                torch.backends.cuda.preferred_blas_library(lib)
                ms = triton.testing.do_bench(
                    lambda: F.linear(x, weight), warmup=10, rep=50, return_mode="median"
                )
                total[lib] += ms
                line += f"{ms:14.4f}{flops / ms / 1e9:9.0f}"
            print(line)
        layer_flops = 2 * rows * sum(w.numel() for w in weights.values())
        print(
            f"  {rows:5d} {'layer':<8}"
            + "".join(f"{ms:14.4f}{layer_flops / ms / 1e9:9.0f}" for ms in total.values())
            + f"   x32 layers: {total['cublas'] * 32:.1f} / {total['cublaslt'] * 32:.1f} ms"
        )
    torch.backends.cuda.preferred_blas_library("cublas")


def fp8_gemm_rates(device: torch.device) -> None:
    """The engine's FP8 product at the 8B layer's shapes: torch._scaled_mm with per-token and
    per-channel scales (kernels/fp8.py), alone and after the Triton quantization of its
    activations (what each projection of a prefill step runs), against the dense FP8 peak."""
    import triton.testing

    from tandem.kernels import dispatch
    from tandem.kernels.fp8 import fp8_linear_quantized, quantize_rows

    gen = torch.Generator(device).manual_seed(0)
    weights = {}
    for name, shape in LAYER_GEMMS.items():
        weights[name] = quantize_rows(
            torch.randn(*shape, generator=gen, device=device).bfloat16() * 0.02
        )
    quantize = dispatch._triton_module("fp8_triton").quantize_rows
    print(f"the 8B layer's FP8 products, TFLOP/s (dense FP8 peak {2 * BF16_DENSE_TFLOPS:.0f}):")
    print(
        f"  {'rows':>5} {'gemm':<8}{'scaled_mm ms':>14}{'TFLOP/s':>9}{'+quantize ms':>14}{'TFLOP/s':>9}"
    )
    for rows in (256, 2048, 8192):
        total = [0.0, 0.0]
        for name, (weight, scale) in weights.items():
            x = torch.randn(rows, weight.shape[1], generator=gen, device=device).bfloat16()
            xq, x_scale = quantize(x, 1)

            def product():
                return fp8_linear_quantized(xq, x_scale, weight, scale, torch.bfloat16)

            flops = 2 * rows * weight.numel()
            alone = triton.testing.do_bench(product, warmup=10, rep=50, return_mode="median")
            whole = triton.testing.do_bench(
                lambda: dispatch.fp8_linear(x, weight, scale),
                warmup=10,
                rep=50,
                return_mode="median",
            )
            total[0] += alone
            total[1] += whole
            print(
                f"  {rows:5d} {name:<8}{alone:14.4f}{flops / alone / 1e9:9.0f}"
                f"{whole:14.4f}{flops / whole / 1e9:9.0f}"
            )
        weight, scale = weights["down"]
        gate_up = torch.randn(rows, 2 * weight.shape[1], generator=gen, device=device).bfloat16()
        apart = triton.testing.do_bench(
            lambda: dispatch.fp8_linear(dispatch.silu_and_mul(gate_up), weight, scale),
            warmup=10,
            rep=50,
            return_mode="median",
        )
        fused = triton.testing.do_bench(
            lambda: dispatch.fp8_silu_mul_linear(gate_up, weight, scale),
            warmup=10,
            rep=50,
            return_mode="median",
        )
        print(
            f"  {rows:5d} swiglu+down: silu_and_mul then quantize + product {apart:.4f} ms, "
            f"SwiGLU in the quantizer {fused:.4f} ms"
        )
        layer_flops = 2 * rows * sum(w.numel() for w, _ in weights.values())
        print(
            f"  {rows:5d} {'layer':<8}{total[0]:14.4f}{layer_flops / total[0] / 1e9:9.0f}"
            f"{total[1]:14.4f}{layer_flops / total[1] / 1e9:9.0f}"
            f"   x32 layers: {total[0] * 32:.1f} / {total[1] * 32:.1f} ms"
        )


def fp8_scale_modes(device: torch.device) -> None:
    """torch._scaled_mm's scale granularities at the 8B layer's shapes: per-token x per-channel
    (what the engine runs: kernels/fp8.py) against one scale per tensor (what a static-scale
    checkpoint could run), each with and without fast accumulation, and the bf16 product beside
    them: whether the row-wise scales cost the prefill's GEMMs their FP8 rate."""
    import triton.testing

    from tandem.kernels.fp8 import FP8

    gen = torch.Generator(device).manual_seed(0)
    modes = ("row", "row+fast", "tensor", "tensor+fast")
    print(
        f"FP8 _scaled_mm by scale granularity, ms (TFLOP/s; dense FP8 peak {2 * BF16_DENSE_TFLOPS:.0f}):"
    )
    print(f"  {'rows':>5} {'gemm':<8}{'bf16':>16}" + "".join(f"{m:>16}" for m in modes))
    errors: dict[str, float] = {}  # the largest relative error (Frobenius) of any product
    for rows in (2048, 8192):
        total = dict.fromkeys(("bf16",) + modes, 0.0)
        for name, (n, k) in LAYER_GEMMS.items():
            weight = torch.randn(n, k, generator=gen, device=device).bfloat16() * 0.02
            x = torch.randn(rows, k, generator=gen, device=device).bfloat16()
            wq, xq = weight.to(FP8), x.to(FP8)
            scales = {
                "row": (
                    torch.rand(rows, 1, generator=gen, device=device) + 0.5,
                    torch.rand(1, n, generator=gen, device=device) + 0.5,
                ),
                "tensor": (torch.ones((), device=device), torch.ones((), device=device)),
            }
            flops = 2 * rows * n * k
            line = f"  {rows:5d} {name:<8}"
            products = {"bf16": lambda: F.linear(x, weight)}
            for mode in modes:
                granularity, _, fast = mode.partition("+")
                sa, sb = scales[granularity]
                products[mode] = functools.partial(
                    torch._scaled_mm,
                    xq,
                    wq.t(),
                    scale_a=sa,
                    scale_b=sb,
                    out_dtype=torch.bfloat16,
                    use_fast_accum=bool(fast),
                )
            for mode, fn in products.items():
                try:
                    ms = triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median")
                except RuntimeError as exc:  # a granularity this build's CUDA path refuses
                    print(f"  {mode}: {str(exc).splitlines()[0][:100]}")
                    ms = float("nan")
                else:
                    if mode != "bf16":  # the product against float32 arithmetic on its operands
                        sa, sb = fn.keywords["scale_a"], fn.keywords["scale_b"]
                        want = (xq.float() * sa) @ (wq.float() * sb.view(-1, 1)).t()
                        diff = (fn().float() - want).norm() / want.norm()
                        errors[mode] = max(errors.get(mode, 0.0), diff.item())
                total[mode] += ms
                line += f"{ms:9.4f}{flops / ms / 1e9:6.0f} "
            print(line)
        layer_flops = 2 * rows * sum(n * k for n, k in LAYER_GEMMS.values())
        print(
            f"  {rows:5d} {'layer':<8}"
            + "".join(f"{ms:9.4f}{layer_flops / ms / 1e9:6.0f} " for ms in total.values())
        )
        print(
            f"  {rows:5d} x32 layers ms: "
            + ", ".join(f"{m} {v * 32:.1f}" for m, v in total.items())
        )
    print(
        "  largest relative error against float32 arithmetic on the same FP8 operands: "
        + ", ".join(f"{m} {e:.2e}" for m, e in errors.items())
    )


def idle_gaps(prof, window: str) -> None:
    """The GPU's idle time inside the profiled window: before its first kernel, between kernels
    (the largest gaps, with the kernels around them) and after its last kernel."""
    events = prof.events()
    # The window's CPU range (record_function also puts a same-named range on the GPU's timeline).
    (span,) = [
        e for e in events if e.name == window and e.device_type == torch.autograd.DeviceType.CPU
    ]
    kernels = sorted(
        (
            e
            for e in events
            if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.end > 0
        ),
        key=lambda e: e.time_range.start,
    )
    if not kernels:
        return
    gaps, reach, idle = [], kernels[0].time_range.end, 0.0
    for before, kernel in zip(kernels, kernels[1:]):
        if kernel.time_range.start > reach:
            gap = kernel.time_range.start - reach
            idle += gap
            gaps.append((gap, before.name[:40], kernel.name[:40]))
        reach = max(reach, kernel.time_range.end)
    lead = kernels[0].time_range.start - span.time_range.start
    tail = span.time_range.end - reach
    print(
        f"  GPU idle (profiler on, CPU ops recorded): {lead / 1e3:.2f} ms before the first kernel, "
        f"{idle / 1e3:.2f} ms between kernels ({len(gaps)} gaps), {tail / 1e3:.2f} ms after the last"
    )
    for gap, before, after in sorted(gaps, reverse=True)[:6]:
        print(f"    {gap / 1e3:7.3f} ms  after {before}  before {after}")


def kernel_breakdown(title: str, run) -> None:
    """Runs `run` twice: profiled on the GPU only (the kernel times by kind), then with CPU ops
    recorded too (the window idle_gaps needs; that recording slows the host, so not for times)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    _sync(torch.device("cuda"))
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        start = time.perf_counter()
        run()
        torch.cuda.synchronize()
        wall = (time.perf_counter() - start) * 1e3
    by_kind: dict[str, list] = defaultdict(lambda: [0.0, 0])
    top: dict[str, float] = defaultdict(float)
    for event in prof.key_averages():
        total = (
            getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        ) / 1e3
        if total <= 0:
            continue
        kind = kind_of(event.key)
        by_kind[kind][0] += total
        by_kind[kind][1] += event.count
        top[event.key[:70]] += total
    busy = sum(ms for ms, _ in by_kind.values())
    print(f"{title}: wall {wall:.2f} ms, kernels {busy:.2f} ms ({busy / wall:.0%} of the wall)")
    for kind, (ms, count) in sorted(by_kind.items(), key=lambda kv: -kv[1][0]):
        print(f"  {kind:<21} {ms:8.3f} ms {count:6d} launches")
    print("  top kernels:")
    for name, ms in sorted(top.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {ms:8.3f} ms  {name}")
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        with record_function("window"):
            run()
            torch.cuda.synchronize()
    idle_gaps(prof, "window")


def decode_timeline(engine, num_steps: int = 12) -> None:
    """Runs num_steps engine steps with a CUDA event (and the host's clock) at each step's input
    upload and after its graph replay, and one when the host has a step's draws: per step, the GPU
    time from upload to upload, the part in the upload and graph, the gap after the graph (the
    sampler's kernels, then idle if the host had not queued the next step yet), and the host's
    time from a step's draws to the next upload."""
    from tandem.engine import sampler as sampler_module

    runner = engine.runner
    marks: list[tuple[str, torch.cuda.Event, float]] = []

    def mark(kind: str) -> None:
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        marks.append((kind, event, time.perf_counter()))

    upload, run, to_host = (
        runner.inputs.upload,
        runner.graphs.run,
        sampler_module.SampledBatch.to_host,
    )

    def timed_upload(step):
        mark("upload")
        return upload(step)

    def timed_run(size):
        logits = run(size)
        mark("graph")
        return logits

    def timed_to_host(batch):
        result = to_host(batch)
        marks.append(("draws", None, time.perf_counter()))
        return result

    runner.inputs.upload, runner.graphs.run = timed_upload, timed_run
    sampler_module.SampledBatch.to_host = timed_to_host
    try:
        for _ in range(num_steps):
            engine.step()
        torch.cuda.synchronize()
    finally:
        del runner.inputs.upload, runner.graphs.run
        sampler_module.SampledBatch.to_host = to_host
    uploads = [(e, t) for kind, e, t in marks if kind == "upload"]
    graphs = [(e, t) for kind, e, t in marks if kind == "graph"]
    if len(uploads) != len(graphs):  # an eager step uploads too: the rows would pair wrong steps
        raise RuntimeError(
            f"{len(uploads)} uploads for {len(graphs)} graph replays: not every step was a graph"
        )
    draws = [t for kind, _, t in marks if kind == "draws"]
    print(f"graph decode steps as the engine runs them ({len(graphs)} steps; ms):")
    print("   gpu step  upload+graph  gap after graph  host: draws -> next upload")
    rows = []
    for i in range(len(graphs) - 1):
        step = uploads[i][0].elapsed_time(uploads[i + 1][0])
        body = uploads[i][0].elapsed_time(graphs[i][0])
        gap = graphs[i][0].elapsed_time(uploads[i + 1][0])
        # The draws read back just before upload i+1 was queued (the host's last wait before it).
        before = [t for t in draws if t <= uploads[i + 1][1]]
        host = (uploads[i + 1][1] - before[-1]) * 1e3 if before else float("nan")
        rows.append((step, body, gap, host))
        print(f"  {step:9.3f} {body:13.3f} {gap:16.3f} {host:27.3f}")
    if rows:
        med = [sorted(col)[len(col) // 2] for col in zip(*rows)]
        print(
            f"  median: step {med[0]:.3f}, upload+graph {med[1]:.3f}, gap {med[2]:.3f}, host {med[3]:.3f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-dir", default="/dev/shm/tandem-llama-3.1-8b-bf16")
    parser.add_argument("--skip-gemms", action="store_true", help="leave out part 1")
    parser.add_argument("--quantization", choices=("auto", "fp8"), default="auto")
    parser.add_argument("--kv-cache-dtype", choices=("auto", "fp8"), default="auto")
    parser.add_argument(
        "--skip-decode", action="store_true", help="leave out parts 3 and 4 (the decode steps)"
    )
    args = parser.parse_args()
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    device = torch.device("cuda")
    print(
        f"# bench/prefill_profile.py; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{torch.cuda.get_device_name(device)}; torch {torch.__version__}"
    )
    if not args.skip_gemms:
        gemm_rates(device)
        if args.quantization == "fp8":
            fp8_gemm_rates(device)
            fp8_scale_modes(device)
    shape = SHAPES["llama-3.1-8b"]
    write_checkpoint(Path(args.model_dir), shape, device)
    engine = LLMEngine(
        EngineConfig(
            args.model_dir,
            device="cuda",
            dtype="bfloat16",
            kv_cache_memory_gb=30,
            max_num_seqs=256,
            max_num_batched_tokens=8192,
            max_model_len=4096,
            quantization=args.quantization,
            kv_cache_dtype=args.kv_cache_dtype,
        )
    )
    print(f"engine: quantization {args.quantization}, KV cache dtype {args.kv_cache_dtype}")
    rng = random.Random(0)
    vocab = shape["vocab_size"]
    prompt = [rng.randrange(3, vocab) for _ in range(2048)]
    first = iter(range(3, vocab))

    def one_prompt():
        engine.add_request(
            f"ttft-{time.perf_counter_ns()}",
            [next(first)] + prompt[1:],
            SamplingOptions(max_tokens=1),
        )
        while engine.num_unfinished:
            engine.step()

    walls = []
    for _ in range(6):
        _sync(device)
        start = time.perf_counter()
        one_prompt()
        walls.append((time.perf_counter() - start) * 1e3)
    print(f"one fresh 2048-token prompt, no profiler: TTFT in-process {sorted(walls[1:])} ms")
    kernel_breakdown("one fresh 2048-token prompt (TTFT in-process)", one_prompt)
    if args.skip_decode:
        return

    opts = SamplingOptions(max_tokens=64, ignore_eos=True)
    for i in range(256):
        engine.add_request(f"d{i}", [rng.randrange(3, vocab) for _ in range(512)], opts)
    while any(
        s.num_output_tokens == 0 for s in engine.scheduler.running + engine.scheduler.waiting
    ):
        engine.step()
    for _ in range(3):
        engine.step()
    graphs, engine.runner.graphs = engine.runner.graphs, None
    engine.step()
    kernel_breakdown("an eager decode step of 256 sequences at ~520 tokens", engine.step)
    engine.runner.graphs = graphs
    for _ in range(2):
        engine.step()
    decode_timeline(engine)


if __name__ == "__main__":
    main()
