"""Triton linear layer for skinny inputs (a decode step of a few sequences): same signature as
`skinny_linear.py` (skinny_linear_triton), plus `linear`, which picks it or cuBLAS per shape.

A decode step of batch 1-16 multiplies a few activation rows by every weight of the model:
it is a pass over the weights, and its time is their bytes over memory bandwidth. cuBLAS
reached ~0.89 of the H200's copy rate on these shapes (bench/RESULTS.md, issue 7); this
kernel streams the weight matrix in [BLOCK_N, BLOCK_K] tiles, one program per BLOCK_N output
columns (and per K segment when there are too few columns to fill the GPU: split-K, partial
sums merged by a second kernel), the activation rows padded to the 16 rows tl.dot needs.

Which of cuBLAS and a few tile shapes wins depends on the matrix and the batch: `linear`
times them once per (rows, N, K, dtype) on the device, outside any graph capture (the decode
graphs' warm-up runs first), and keeps the fastest.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from tandem.kernels.launch_checks import FLOAT_DTYPES, require

MAX_ROWS = 16  # tl.dot's smallest M: the rows of one program's activation tile
_L2_FLUSH_BYTES = 128 << 20  # written between timed calls: more than any GPU's L2 today


@triton.jit
def _skinny_linear_kernel(
    x_ptr, w_ptr, bias_ptr, y_ptr, part_ptr,
    num_rows, N, K, stride_xm, stride_wn, stride_ym,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr,
    EVEN_N: tl.constexpr, EVEN_K: tl.constexpr, UPCAST_DOT: tl.constexpr,
):
    col_block = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, 16)
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    k_per_split = tl.cdiv(tl.cdiv(K, SPLIT_K), BLOCK_K) * BLOCK_K
    k_lo = split * k_per_split
    k_hi = tl.minimum(K, k_lo + k_per_split)
    row_valid = rows < num_rows
    col_valid = cols < N
    w_rows = w_ptr + cols.to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
    acc = tl.zeros([16, BLOCK_N], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        if EVEN_K:
            x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None], other=0.0)
            if EVEN_N:
                w = tl.load(w_rows + ks[None, :])
            else:
                w = tl.load(w_rows + ks[None, :], mask=col_valid[:, None], other=0.0)
        else:
            k_valid = ks < k_hi
            x = tl.load(x_rows + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0)
            w = tl.load(w_rows + ks[None, :], mask=col_valid[:, None] & k_valid[None, :], other=0.0)
        if UPCAST_DOT:  # Triton's interpreter multiplies bf16 operands as their raw bits
            acc += tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
        else:
            acc += tl.dot(x, tl.trans(w))
    out_mask = row_valid[:, None] & col_valid[None, :]
    if SPLIT_K == 1:
        if HAS_BIAS:
            acc += tl.load(bias_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)[None, :]
        y = y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:
        # Partials [SPLIT_K, num_rows, N], float32.
        part = part_ptr + (split * num_rows + rows.to(tl.int64))[:, None] * N + cols[None, :]
        tl.store(part, acc, mask=out_mask)


@triton.jit
def _merge_splits_kernel(part_ptr, bias_ptr, y_ptr, num_rows, N, stride_ym,
                         HAS_BIAS: tl.constexpr, SPLIT_K: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    valid = cols < N
    acc = tl.zeros([BLOCK], tl.float32)
    for split in range(SPLIT_K):
        acc += tl.load(part_ptr + (split * num_rows + row).to(tl.int64) * N + cols, mask=valid, other=0.0)
    if HAS_BIAS:
        acc += tl.load(bias_ptr + cols, mask=valid, other=0.0).to(tl.float32)
    tl.store(y_ptr + row.to(tl.int64) * stride_ym + cols, acc.to(y_ptr.dtype.element_ty), mask=valid)


_IS_INTERPRETED = type(_skinny_linear_kernel).__name__ == "InterpretedFunction"


@dataclass(frozen=True)
class TileConfig:
    block_n: int
    block_k: int
    split_k: int
    num_warps: int = 4
    num_stages: int = 4


def skinny_linear_triton(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
                         config: TileConfig | None = None) -> torch.Tensor:
    """x [M <= 16, K] @ weight[N, K]^T (+ bias [N]) -> [M, N] in x's dtype."""
    require(x.dim() == 2 and weight.dim() == 2, f"x must be [M, K] and weight [N, K], got {tuple(x.shape)}, "
                                                 f"{tuple(weight.shape)}")
    num_rows, K = x.shape
    N = weight.shape[0]
    require(weight.shape[1] == K, f"x has {K} columns, weight {weight.shape[1]}")
    require(num_rows <= MAX_ROWS, f"skinny_linear_triton takes at most {MAX_ROWS} rows, got {num_rows}")
    require(x.dtype == weight.dtype and x.dtype in FLOAT_DTYPES, f"x {x.dtype} and weight {weight.dtype} must share a "
                                                                   f"float dtype")
    require(x.device == weight.device, f"x is on {x.device}, weight on {weight.device}")
    require(x.stride(1) == 1 and weight.stride(1) == 1, "x and weight need unit stride in K")
    require(bias is None or (bias.shape == (N,) and bias.is_contiguous()), f"bias must be [{N}] and contiguous")
    config = config or default_config(N, K, x.device)
    y = torch.empty(num_rows, N, dtype=x.dtype, device=x.device)
    if num_rows == 0:
        return y
    split_k = min(config.split_k, triton.cdiv(K, config.block_k))
    part = torch.empty(split_k, num_rows, N, dtype=torch.float32, device=x.device) if split_k > 1 else y
    has_bias = bias is not None
    _skinny_linear_kernel[(triton.cdiv(N, config.block_n), split_k)](
        x, weight, bias if has_bias else y, y, part, num_rows, N, K, x.stride(0), weight.stride(0), y.stride(0),
        HAS_BIAS=has_bias and split_k == 1, BLOCK_N=config.block_n, BLOCK_K=config.block_k, SPLIT_K=split_k,
        EVEN_N=N % config.block_n == 0, EVEN_K=K % (config.block_k * split_k) == 0,
        UPCAST_DOT=_IS_INTERPRETED and x.dtype != torch.float32,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        block = 1024
        _merge_splits_kernel[(num_rows, triton.cdiv(N, block))](
            part, bias if has_bias else y, y, num_rows, N, y.stride(0),
            HAS_BIAS=has_bias, SPLIT_K=split_k, BLOCK=block)
    return y


def _num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def default_config(N: int, K: int, device: torch.device, block_n: int = 32, block_k: int = 256) -> TileConfig:
    """Enough programs for about two per SM: K is split when N alone gives too few."""
    programs = triton.cdiv(N, block_n)
    wanted = triton.cdiv(2 * _num_sms(device), programs)
    split_k = max(1, min(wanted, K // (4 * block_k), 8))
    return TileConfig(block_n, block_k, triton.next_power_of_2(split_k) if split_k > 1 else 1)


def candidate_configs(N: int, K: int, device: torch.device) -> list[TileConfig]:
    """The tile shapes `linear` times against cuBLAS."""
    configs = {default_config(N, K, device, bn, bk) for bn, bk in ((32, 256), (64, 128), (16, 512))}
    configs.add(TileConfig(32, 256, 1))
    return sorted(configs, key=lambda c: (c.block_n, c.block_k, c.split_k))


# (rows, N, K, dtype, device) -> the fastest TileConfig, or None where cuBLAS won.
_choices: dict[tuple, TileConfig | None] = {}
_lock = threading.Lock()


def _time_ms(fn, flush: torch.Tensor, reps: int = 10) -> float:
    """ms of one cold call: the L2 (60 MB on an H200) is flushed before each, as a decode step's
    weights arrive from memory (each is read once per step)."""
    fn()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(reps)]
    for start, end in events:
        flush.zero_()
        start.record()
        fn()
        end.record()
    events[-1][1].synchronize()
    return sorted(start.elapsed_time(end) for start, end in events)[reps // 2]


def choose(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> TileConfig | None:
    """The kernel for this shape: timed once (cuBLAS and each candidate), None meaning cuBLAS."""
    key = (x.shape[0], weight.shape[0], weight.shape[1], x.dtype, x.device)
    if key in _choices:
        return _choices[key]
    if torch.cuda.is_current_stream_capturing():  # no timing inside a capture: cuBLAS until timed
        return None
    with _lock:
        if key not in _choices:
            flush = torch.empty(_L2_FLUSH_BYTES, dtype=torch.uint8, device=x.device)
            times = {None: _time_ms(lambda: F.linear(x, weight, bias), flush)}
            for config in candidate_configs(weight.shape[0], weight.shape[1], x.device):
                times[config] = _time_ms(lambda c=config: skinny_linear_triton(x, weight, bias, c), flush)
            del flush
            _choices[key] = min(times, key=times.get)
    return _choices[key]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, by this kernel where it measured faster on this device for this shape."""
    if x.dim() != 2 or x.shape[0] > MAX_ROWS or x.shape[0] == 0 or x.dtype == torch.float32:
        return F.linear(x, weight, bias)
    config = choose(x, weight, bias)
    return F.linear(x, weight, bias) if config is None else skinny_linear_triton(x, weight, bias, config)


def chosen() -> dict[tuple, TileConfig | None]:
    """What `linear` picked so far (for benchmarks): {(rows, N, K, dtype, device): config or None}."""
    return dict(_choices)
