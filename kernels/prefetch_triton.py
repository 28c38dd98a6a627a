"""Pulls a weight matrix's bytes into the GPU's L2 cache without reading them into registers.

A small-batch decode step is a chain of GEMMs that stream weights from HBM, separated by
kernels that move almost nothing (rotary, attention over a short context, norms, SwiGLU).
During those the memory bus idles; a prefetch issued then on a side stream lets the next
GEMM find its first bytes (or all of them) in L2 (weight_prefetch.py decides what and when).
The kernel only issues prefetch instructions: it has no result, so its torch reference is
doing nothing (dispatch.prefetch_l2 off CUDA), and the interpreter cannot run its PTX.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import require

LINE_BYTES = 128  # an L2 line
MODES = ("line", "bulk")


@triton.jit
def _prefetch_lines_kernel(base_ptr, row_stride, lines_per_row, num_lines, LINE: tl.constexpr, BLOCK: tl.constexpr):
    """One `prefetch.global.L2` per 128-byte line of the first `lines_per_row` lines of each row."""
    index = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    index = tl.minimum(index, num_lines - 1)  # the last program's spare lanes repeat the last line
    row, line = index // lines_per_row, index % lines_per_row
    ptrs = base_ptr + row * row_stride + line * LINE
    tl.inline_asm_elementwise("prefetch.global.L2 [$1]; // $0", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def _prefetch_rows_kernel(base_ptr, row_stride, row_bytes, num_rows, BLOCK: tl.constexpr):
    """One Hopper bulk prefetch (cp.async.bulk.prefetch.L2, run by the TMA unit) of `row_bytes` per row."""
    row = tl.minimum(tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK), num_rows - 1)
    ptrs = base_ptr + row * row_stride
    sizes = tl.full([BLOCK], 0, tl.int32) + row_bytes
    tl.inline_asm_elementwise("cp.async.bulk.prefetch.L2.global [$1], $2; // $0", "=r,l,r", [ptrs, sizes],
                              dtype=tl.int32, is_pure=False, pack=1)


def prefetch_l2(weight: torch.Tensor, fraction: float = 1.0, mode: str = "line") -> None:
    """Prefetches the first `fraction` of every row of a 2-D weight [N, K] (rows K-contiguous) into L2.

    A GEMM at small batch streams all rows along K at once, so a leading slice of every row,
    not the leading rows, is what starts it early. Returns at once; nothing waits for the lines.
    """
    require(weight.is_cuda and weight.dim() == 2, f"prefetch_l2 needs a 2-D CUDA tensor, got {tuple(weight.shape)} "
                                                  f"on {weight.device}")
    require(weight.stride(1) == 1, f"prefetch_l2 needs rows contiguous along K, got strides {weight.stride()}")
    require(0.0 < fraction <= 1.0, f"prefetch fraction must be in (0, 1], got {fraction}")
    require(mode in MODES, f"prefetch mode {mode!r} is not one of {MODES}")
    num_rows, item = weight.shape[0], weight.element_size()
    row_bytes = weight.shape[1] * item
    # Whole lines, rounded up (pointer steps are in elements: a line is 128 / item of them).
    lines_per_row = max(1, -(-int(row_bytes * fraction) // LINE_BYTES))
    with torch.cuda.device(weight.device):
        if mode == "line":
            num_lines = num_rows * lines_per_row
            block = 1024
            _prefetch_lines_kernel[(triton.cdiv(num_lines, block),)](
                weight, weight.stride(0), lines_per_row, num_lines, LINE=LINE_BYTES // item, BLOCK=block,
                num_warps=4)
        else:
            require(weight.stride(0) * item % 16 == 0 and weight.data_ptr() % 16 == 0,
                    "bulk prefetch needs 16-byte aligned rows")
            size = min(lines_per_row * LINE_BYTES, row_bytes - row_bytes % 16)
            block = 128
            _prefetch_rows_kernel[(triton.cdiv(num_rows, block),)](
                weight, weight.stride(0), size, num_rows, BLOCK=block, num_warps=4)
