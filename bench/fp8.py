"""FP8 GEMMs and FP8 KV attention against their bf16 counterparts, the torch references and the roofline.

    python bench/fp8.py                          # CPU: SmolLM2-135M's projection shapes
    python bench/fp8.py --device cuda --shape llama-3.1-8b

1. Per projection shape and token count: bf16 F.linear; tandem's FP8 GEMM (kernels/fp8.py:
   per-token activation quantization + torch._scaled_mm with per-channel weight scales); the
   block-scaled variant (128-column groups, one _scaled_mm per group); and the torch reference
   (dequantized operands, float32 matmul). Each against its roofline: max(FLOPs / peak, bytes /
   copy rate), the peak being a large bf16 GEMM and the rate a large copy, both measured here.
2. Decode attention (batch x context) over a bf16 pool and an FP8 pool, as KV bytes read per
   second against the copy rate: the torch reference, and on CUDA the Triton kernel too.
3. The activations' quantizers per token count, against the bytes each must move at the copy
   rate: a row's quantization (the o projection's input), and on CUDA the kernels that fold it
   into the op before (add + RMSNorm for q/k/v and gate/up, SwiGLU for down) against that op and
   the quantizer run apart.

On the CPU the numbers say where the torch path spends its time (the activation quantization and
the float8 -> float conversions inside _scaled_mm are plain CPU loops; there is no FP8 arithmetic),
not what FP8 buys. On an H100/H200 (not run yet: the GPU run issue) it would show: batch-1 GEMMs
memory-bound, FP8 reading half the weight bytes of bf16 (~2x at the copy rate, the 8B decode floor
from ~3.5 to ~1.8 ms/step); large token counts compute-bound with _scaled_mm at about twice bf16's
TFLOP/s; the block-scaled loop far behind both (G launches per GEMM: a fused Triton kernel is the
path); the per-token quantization a kernel of its own before o, folded into the norm before
q/k/v and gate/up and into SwiGLU before down (table 3). On CUDA
the attention table adds the Triton kernel over both pools: an FP8 pool should read at about
the bf16 pool's GB/s, so take about half its time at long contexts.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402 - the copy rate lives there

from tandem.kernels import paged_attention as attention  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from tandem.kernels.fp8 import fp8_linear, fp8_linear_reference, quantize_rows  # noqa: E402

SHAPES = {  # name -> {projection: (N, K)}
    "smollm2-135m": {
        "qkv": (960, 576),
        "o": (576, 576),
        "gate_up": (3072, 576),
        "down": (576, 1536),
    },
    "llama-3.1-8b": {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
    },
}
BLOCK = 128


def _timed_ms(device: torch.device, fn, repeats: int) -> float:
    """ms of fn, after two warm-up calls: the median of repeats calls on CUDA, the fastest on the
    CPU (shared cores: the slow calls measure the neighbours, not the kernel)."""
    for _ in range(2):
        fn()
    times = []
    for _ in range(repeats):
        serve._sync(device)
        start = time.perf_counter()
        fn()
        serve._sync(device)
        times.append(time.perf_counter() - start)
    return (statistics.median(times) if device.type == "cuda" else min(times)) * 1e3


def bf16_peak_tflops(device: torch.device) -> float:
    n = 8192 if device.type == "cuda" else 1024
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = _timed_ms(device, lambda: a @ a, 5)
    return 2 * n**3 / ms / 1e9


def gemm_table(device, shapes, token_counts, peak_tflops, copy_gbs, repeats) -> None:
    gen = torch.Generator(device).manual_seed(serve.SEED)
    print(
        f"GEMMs (ms; roofline = max(FLOPs / {peak_tflops:.2f} TFLOP/s bf16 peak, bytes / "
        f"{copy_gbs:.0f} GB/s copy rate); x = ms / roofline):"
    )
    print(
        f"  {'gemm':<8}{'T':>5}{'N x K':>13}  {'bf16':>16}{'fp8 row':>16}{'fp8 block':>16}{'reference':>11}"
    )
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, generator=gen, device=device) * k**-0.5
        w16 = weight.to(torch.bfloat16)
        w8, s8 = quantize_rows(weight)
        wb, sb = quantize_rows(weight, k // BLOCK)
        for tokens in token_counts:
            x = torch.randn(tokens, k, generator=gen, device=device).to(torch.bfloat16)
            flops = 2 * tokens * n * k
            cells = []
            for fn, weight_bytes in (
                (lambda: F.linear(x, w16), 2 * n * k),
                (lambda: fp8_linear(x, w8, s8), n * k + 4 * n),
                (lambda: fp8_linear(x, wb, sb), n * k + 4 * n * (k // BLOCK)),
            ):
                ms = _timed_ms(device, fn, repeats)
                nbytes = weight_bytes + 2 * tokens * (k + n)
                roof = max(flops / peak_tflops / 1e9, nbytes / copy_gbs / 1e6)
                cells.append(f"{ms:8.3f} x{ms / roof:5.1f}")
            ref_ms = _timed_ms(
                device, lambda: fp8_linear_reference(x, w8, s8), max(3, repeats // 4)
            )
            print(
                f"  {name:<8}{tokens:>5}{f'{n}x{k}':>13}  "
                + "".join(f"{c:>16}" for c in cells)
                + f"{ref_ms:11.3f}"
            )


def attention_table(device, batch, context, copy_gbs, repeats) -> None:
    heads, kv_heads, head_dim, block_size = 32, 8, 128, 16
    if device.type != "cuda":
        heads, kv_heads, head_dim = 9, 3, 64  # SmolLM2's attention
    num_blocks = batch * context // block_size
    tables = torch.arange(num_blocks).view(batch, -1).tolist()
    meta = AttentionMetadata.build([1] * batch, [context] * batch, tables, block_size, device)
    query = torch.randn(batch, heads, head_dim, device=device, dtype=torch.bfloat16)
    print(f"decode attention, batch {batch} x context {context}, {kv_heads} KV heads x {head_dim}:")
    kernels = {"torch reference": attention.paged_attention}
    if device.type == "cuda":
        from tandem.kernels.paged_attention_triton import paged_attention_triton

        kernels["triton"] = paged_attention_triton
    for name, kernel in kernels.items():
        for dtype in (torch.bfloat16, torch.float8_e4m3fn):
            pool = torch.randn(num_blocks, 2, block_size, kv_heads, head_dim, device=device)
            pool = pool.to(dtype)
            ms = _timed_ms(device, lambda: kernel(query, pool, meta, head_dim**-0.5), repeats)
            nbytes = pool.numel() * pool.element_size()
            print(
                f"  {name:<16}{str(dtype).removeprefix('torch.'):<16}{ms:9.3f} ms  KV "
                f"{nbytes / 1e6:7.1f} MB  {nbytes / ms / 1e6:7.2f} GB/s  (floor at the copy "
                f"rate {nbytes / copy_gbs / 1e6:.3f} ms)"
            )


def quantizer_table(device, hidden: int, inter: int, token_counts, copy_gbs, repeats) -> None:
    """ms of each quantizer (x = ms / the bytes it must read and write at the copy rate); on CUDA
    the one-kernel versions beside the two kernels they replace."""
    from tandem.kernels import dispatch
    from tandem.kernels import fp8 as fp8_reference

    gen = torch.Generator(device).manual_seed(serve.SEED)
    print(f"activation quantizers (ms; x = ms / (bytes read + written) at {copy_gbs:.0f} GB/s):")
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, generator=gen, device=device).to(torch.bfloat16)
        residual = torch.randn_like(x)
        weight = torch.rand(hidden, generator=gen, device=device).to(torch.bfloat16) + 0.5
        gate_up = torch.randn(tokens, 2 * inter, generator=gen, device=device).to(torch.bfloat16)
        row_bytes = 3 * tokens * hidden  # bf16 in, float8 out
        norm_bytes = 3 * 2 * tokens * hidden + tokens * hidden  # x, residual in, total out; fp8
        silu_bytes = 2 * 2 * tokens * inter + tokens * inter  # gate/up in, fp8 out
        if device.type != "cuda":
            runs = {"rows (o's input)": (lambda: fp8_reference.quantize_rows(x, 1), row_bytes)}
        else:
            fp8 = dispatch._triton_module("fp8_triton")
            fused = dispatch._triton_module("fused_triton")
            runs = {
                "rows (o's input)": (lambda: fp8.quantize_rows(x, 1), row_bytes),
                "add+norm, then quantize": (
                    lambda: fp8.quantize_rows(fused.add_rms_norm(x, residual, weight, 1e-5)[0], 1),
                    norm_bytes + 4 * tokens * hidden,  # the bf16 rows written and read again
                ),
                "add+norm quantizing": (
                    lambda: fused.add_rms_norm_quantize(x, residual, weight, 1e-5),
                    norm_bytes,
                ),
                "swiglu, then quantize": (
                    lambda: fp8.quantize_rows(fused.silu_and_mul(gate_up), 1),
                    silu_bytes + 4 * tokens * inter,
                ),
                "swiglu in the quantizer": (
                    lambda: fp8.silu_mul_quantize_rows(gate_up, 1),
                    silu_bytes,
                ),
            }
        cells = []
        for name, (fn, nbytes) in runs.items():
            ms = _timed_ms(device, fn, repeats)
            cells.append(f"{name} {ms:.4f} x{ms / (nbytes / copy_gbs / 1e6):.1f}")
        print(f"  T={tokens:<5} " + "; ".join(cells))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument(
        "--repeats", type=int, default=0, help="timed calls per cell (0: 50 on CUDA, 10 on CPU)"
    )
    args = parser.parse_args()
    device = torch.device(args.device)
    torch.manual_seed(serve.SEED)
    on_gpu = device.type == "cuda"
    shapes = SHAPES[args.shape or ("llama-3.1-8b" if on_gpu else "smollm2-135m")]
    repeats = args.repeats or (50 if on_gpu else 10)
    copy_gbs = serve.copy_bandwidth(device)
    peak = bf16_peak_tflops(device)
    print(
        f"device {device}: copy {copy_gbs:.1f} GB/s (read + write), bf16 GEMM {peak:.3f} TFLOP/s\n"
    )
    gemm_table(
        device, shapes, (1, 16, 256) if not on_gpu else (1, 64, 2048), peak, copy_gbs, repeats
    )
    print()
    attention_table(device, 8, 512 if not on_gpu else 4096, copy_gbs, repeats)
    print()
    hidden, inter = shapes["o"][1], shapes["down"][1]
    quantizer_table(
        device, hidden, inter, (16, 256) if not on_gpu else (256, 2048, 8192), copy_gbs, repeats
    )


if __name__ == "__main__":
    main()
