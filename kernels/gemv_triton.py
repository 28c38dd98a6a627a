"""One-row linear layers (a batch-1 decode step) as Triton GEMVs: same signatures as `gemv.py`.

At batch 1 a linear layer is a pass over its weight, and its time is bytes over bandwidth;
inside a decode graph cuBLAS's one-row kernels reach 0.63x (o_proj, 4096 x 4096) to 1.00x
(lm_head) of the H200's copy rate, these 0.80x to 1.05x (bench/gemv.py, run 20; bench/RESULTS.md),
which took the 8B batch-1 step from 4.64 to 4.21 ms of GPU time. Here each program owns BLOCK_N whole
rows of the weight and walks K in BLOCK_K steps of wide loads, multiplying in float32 and
summing once at the end: no tensor cores (nothing to share a tile with), no split-K merge,
and enough programs (N / BLOCK_N) to have every SM's loads in flight from the first cycle.
`silu_mul_gemv` also folds SwiGLU into down_proj's activation loads, one kernel fewer a layer.

`fp8_gemv` / `fp8_silu_mul_gemv` walk an FP8 (e4m3) weight the same way, scaling in the loop (a
block-scaled weight: each column by its group's scale) or once per row at the end (one scale a
row): half the bytes of a bf16 pass. The row stays in the model dtype (weight-only
dequantization, as FP8 Marlin): quantizing one row would cost launches and save no bytes.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import FLOAT_DTYPES, require

FP8 = torch.float8_e4m3fn


@triton.jit
def _activation(x_ptr, k0, ks, K, half, SILU: tl.constexpr, EVEN_K: tl.constexpr):
    """The activation chunk [BLOCK_K] at k0, float32; with SILU, silu(gate) * up of a [gate | up]
    row of width 2 * half, rounded to the dtype where the torch reference rounds."""
    offs = k0 + ks
    mask = offs < K
    dtype = x_ptr.dtype.element_ty
    if SILU:
        if EVEN_K:
            gate = tl.load(x_ptr + offs).to(tl.float32)
            up = tl.load(x_ptr + half + offs).to(tl.float32)
        else:
            gate = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            up = tl.load(x_ptr + half + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
        return (silu * up).to(dtype).to(tl.float32)
    if EVEN_K:
        return tl.load(x_ptr + offs).to(tl.float32)
    return tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _gemv_kernel(
    x_ptr,
    w_ptr,
    scale_ptr,
    bias_ptr,
    y_ptr,
    N,
    K,
    stride_wn,
    stride_sn,
    half,
    HAS_BIAS: tl.constexpr,
    SILU: tl.constexpr,
    EVEN_K: tl.constexpr,
    SCALED: tl.constexpr,
    GROUP: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    # The last program's rows past N repeat row N-1: its loads need no mask, its stores have one.
    rows = tl.minimum(cols, N - 1).to(tl.int64)
    ks = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows[:, None] * stride_wn
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        x = _activation(x_ptr, k0, ks, K, half, SILU, EVEN_K)
        if EVEN_K:
            w = tl.load(w_rows + (k0 + ks)[None, :])
        else:
            w = tl.load(w_rows + (k0 + ks)[None, :], mask=(k0 + ks < K)[None, :], other=0.0)
        w = w.to(tl.float32)
        if SCALED and GROUP > 0:  # block-scaled FP8: each column by its group's scale
            s_offs = rows[:, None] * stride_sn + ((k0 + ks) // GROUP)[None, :]
            if EVEN_K:
                w = w * tl.load(scale_ptr + s_offs)
            else:
                w = w * tl.load(scale_ptr + s_offs, mask=(k0 + ks < K)[None, :], other=0.0)
        acc += w * x[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED and GROUP == 0:  # one FP8 scale a row
        y = y * tl.load(scale_ptr + rows * stride_sn)
    if HAS_BIAS:
        y += tl.load(bias_ptr + rows).to(tl.float32)
    tl.store(y_ptr + cols, y.to(y_ptr.dtype.element_ty), mask=cols < N)


def tile_for(N: int, K: int, silu: bool = False, fp8: bool = False) -> tuple[int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps) for an [N, K] weight, from the H200 sweep (bench/gemv.py, run 20):
    one row per program and 2048-wide steps won or came within 1% on every 8B shape (down_proj's
    best, 1024-wide with 4 warps, by 0.1 us); with SwiGLU folded in, four rows share each recomputed
    activation chunk (one row a program spends its time in exp). Tuned on the 8B shapes only.
    fp8: an e4m3 weight, from the H100 sweep (`bench/gemv.py --fp8`, 2026-12-06): 1024-wide
    steps with 4 warps won on every 8B shape (one row a program; four with SwiGLU), 1.13-1.25x
    faster than the bf16 tiles on the same bytes (the 8B FP8 decode step 4.19 -> 3.66 ms)."""
    if fp8:
        block_k = min(1024, triton.next_power_of_2(K))
        return (4, block_k, 4) if silu else (1, block_k, 4)
    block_k = min(2048, triton.next_power_of_2(K))
    return (4, block_k, 4) if silu else (1, block_k, 8)


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    K: int,
    silu: bool,
    tile: tuple[int, int, int] | None,
    weight_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    N = weight.shape[0]
    require(
        weight.dim() == 2 and weight.shape[1] == K,
        f"weight must be [N, {K}], got {tuple(weight.shape)}",
    )
    if weight_scale is None:
        require(
            x.dtype == weight.dtype and x.dtype in FLOAT_DTYPES,
            f"x {x.dtype} and weight {weight.dtype} must share a float dtype",
        )
        group = 0
    else:
        require(
            weight.dtype == FP8 and x.dtype in FLOAT_DTYPES,
            f"an FP8 GEMV takes a float8_e4m3fn weight and a float row, got {weight.dtype} and {x.dtype}",
        )
        num_groups = weight_scale.shape[-1] if weight_scale.dim() == 2 else 0
        require(
            weight_scale.dim() == 2
            and weight_scale.shape[0] == N
            and num_groups >= 1
            and K % num_groups == 0
            and weight_scale.dtype == torch.float32
            and weight_scale.stride(1) == 1
            and weight_scale.device == x.device,
            f"weight_scale must be float32 [{N}, G] with G dividing {K}, on {x.device}, "
            f"got {weight_scale.dtype} {tuple(weight_scale.shape)}",
        )
        group = 0 if num_groups == 1 else K // num_groups
    require(x.device == weight.device, f"x is on {x.device}, weight on {weight.device}")
    require(
        x.is_contiguous() and weight.stride(1) == 1,
        "x must be contiguous and weight rows K-contiguous",
    )
    require(K > 0, "the GEMV needs K >= 1 (an empty product is F.linear's case)")
    require(
        bias is None
        or (
            bias.shape == (N,)
            and bias.is_contiguous()
            and bias.dtype == x.dtype
            and bias.device == x.device
        ),
        f"bias must be a contiguous [{N}] {x.dtype} tensor on {x.device}",
    )
    block_n, block_k, num_warps = tile or tile_for(N, K, silu, fp8=weight_scale is not None)
    require(
        all(v > 0 and v & (v - 1) == 0 for v in (block_n, block_k, num_warps)),
        f"tile sizes must be powers of two, got {(block_n, block_k, num_warps)}",
    )
    y = torch.empty(1, N, dtype=x.dtype, device=x.device)
    if N:
        with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
            _gemv_kernel[(triton.cdiv(N, block_n),)](
                x,
                weight,
                weight_scale if weight_scale is not None else y,
                bias if bias is not None else y,
                y,
                N,
                K,
                weight.stride(0),
                weight_scale.stride(0) if weight_scale is not None else 0,
                K,
                HAS_BIAS=bias is not None,
                SILU=silu,
                EVEN_K=K % block_k == 0,
                SCALED=weight_scale is not None,
                GROUP=group,
                BLOCK_N=block_n,
                BLOCK_K=block_k,
                num_warps=num_warps,
            )
    return y


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight [N, K]^T (+ bias) -> [1, N]."""
    require(x.dim() == 2 and x.shape[0] == 1, f"gemv takes one row [1, K], got {tuple(x.shape)}")
    return _launch(x, weight, bias, x.shape[1], silu=False, tile=tile)


def silu_mul_gemv(
    gate_up: torch.Tensor, weight: torch.Tensor, tile: tuple[int, int, int] | None = None
) -> torch.Tensor:
    """SwiGLU of gate_up [1, 2K] @ weight [N, K]^T -> [1, N], in one kernel."""
    require(
        gate_up.dim() == 2 and gate_up.shape[0] == 1 and gate_up.shape[1] % 2 == 0,
        f"silu_mul_gemv takes one [gate | up] row [1, 2K], got {tuple(gate_up.shape)}",
    )
    return _launch(gate_up, weight, None, gate_up.shape[1] // 2, silu=True, tile=tile)


def fp8_gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """x [1, K] @ an FP8 weight [N, K] with float32 scales [N, G] (kernels/fp8.py) (+ bias) -> [1, N]."""
    require(x.dim() == 2 and x.shape[0] == 1, f"gemv takes one row [1, K], got {tuple(x.shape)}")
    return _launch(x, weight, bias, x.shape[1], silu=False, tile=tile, weight_scale=weight_scale)


def fp8_silu_mul_gemv(
    gate_up: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """SwiGLU of gate_up [1, 2K] @ an FP8 weight [N, K] with scales [N, G] -> [1, N], in one kernel."""
    require(
        gate_up.dim() == 2 and gate_up.shape[0] == 1 and gate_up.shape[1] % 2 == 0,
        f"silu_mul_gemv takes one [gate | up] row [1, 2K], got {tuple(gate_up.shape)}",
    )
    return _launch(
        gate_up, weight, None, gate_up.shape[1] // 2, True, tile, weight_scale=weight_scale
    )
