"""The skinny linear kernel (kernels/skinny_linear_triton.py) against cuBLAS on Llama-3.1-8B's
decode GEMMs, beside the copy bandwidth measured in the same run (issue 7, bs1).

    python bench/skinny_linear.py            # CUDA only: M in 1, 2, 4, 8, 16; a tile sweep at M=1

Each row: time (median of CUDA-event-timed repeats over 4 rotating weight copies, so the L2
holds none of them), the weight bytes over that time in GB/s, and that over the copy rate
(read + write counted, as bench/serve.py's floor): 1.0 is the floor of a decode step.
"""
from __future__ import annotations

import argparse
import statistics

import torch
import torch.nn.functional as F

from tandem.kernels import skinny_linear_triton as kernel
from tandem.kernels.skinny_linear_triton import TileConfig

SHAPES = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336),
          "lm_head": (128256, 4096)}
SWEEP = [(16, 512, 4, 3), (16, 256, 4, 4), (32, 128, 4, 5), (32, 256, 4, 4), (32, 512, 4, 3), (64, 128, 4, 4),
         (64, 256, 8, 3), (128, 128, 8, 3)]


def copy_gbs() -> float:
    src = torch.empty(4 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    times = [timed(lambda: dst.copy_(src), reps=5) for _ in range(5)]
    return 2 * src.numel() / statistics.median(times) / 1e6


def timed(fn, reps: int = 50) -> float:
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / reps


def rotating(fn_of_weight, weights) -> float:
    """ms per call, cycling through weight copies (none stays in the 60 MB L2 between its calls)."""
    state = {"i": 0}

    def call():
        fn_of_weight(weights[state["i"] % len(weights)])
        state["i"] += 1
    return statistics.median(timed(call, reps=len(weights) * 10) for _ in range(5))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", default="1,2,4,8,16")
    args = parser.parse_args()
    torch.manual_seed(0)
    device = torch.device("cuda")
    copy = copy_gbs()
    print(f"# bench/skinny_linear.py on {torch.cuda.get_device_name()}; copy {copy:.0f} GB/s (read + write)")
    weights = {name: [torch.randn(n, k, device=device, dtype=torch.bfloat16) * k ** -0.5 for _ in range(4)]
               for name, (n, k) in SHAPES.items()}
    print("\ntile sweep at M=1 (ms; GB/s; x copy rate):")
    x1 = torch.randn(1, 4096, device=device, dtype=torch.bfloat16)
    for name, (n, k) in SHAPES.items():
        x = x1 if k == 4096 else torch.randn(1, k, device=device, dtype=torch.bfloat16)
        nbytes = n * k * 2
        cublas = rotating(lambda w: F.linear(x, w), weights[name])
        print(f"  {name:8} cuBLAS {cublas:.4f} ms {nbytes / cublas / 1e6:7.0f} GB/s {nbytes / cublas / 1e6 / copy:.3f}")
        for bn, bk, warps, stages in SWEEP:
            base = kernel.default_config(n, k, device, bn, bk)
            for split in sorted({base.split_k, 1}):
                config = TileConfig(bn, bk, split, warps, stages)
                ms = rotating(lambda w, c=config: kernel.skinny_linear_triton(x, w, None, c), weights[name])
                print(f"  {name:8} {str((bn, bk, split, warps, stages)):22} {ms:.4f} ms {nbytes / ms / 1e6:7.0f} GB/s "
                      f"{nbytes / ms / 1e6 / copy:.3f}{'  *' if ms < cublas else ''}")
    print("\nlinear()'s pick per rows (cuBLAS vs the candidates), whole decode GEMM set (ms):")
    print(f"{'rows':>5}{'cuBLAS':>10}{'picked':>10}{'x copy (picked)':>17}  picks")
    total_bytes = sum(n * k * 2 for n, k in SHAPES.values())
    for rows in map(int, args.rows.split(",")):
        cublas_ms = picked_ms = 0.0
        picks = []
        for name, (n, k) in SHAPES.items():
            x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
            cublas_ms += rotating(lambda w: F.linear(x, w), weights[name])
            picked_ms += rotating(lambda w: kernel.linear(x, w), weights[name])
            config = kernel.choose(x, weights[name][0], None)
            picks.append(f"{name}:{'cuBLAS' if config is None else (config.block_n, config.block_k, config.split_k)}")
        print(f"{rows:5d}{cublas_ms:10.3f}{picked_ms:10.3f}{total_bytes / picked_ms / 1e6 / copy:17.3f}  {' '.join(picks)}")


if __name__ == "__main__":
    main()
