"""The greedy draw as two small kernels: each row's argmax, its log-probability and the row's
log-sum-exp, same signature as `greedy.py`.

torch spends 5-7 launches on it (logsumexp's max and sum passes, argmax, a gather, a subtract),
and at batch 1 each of its reductions over a 128k vocabulary runs on a handful of blocks: 0.13 ms
of a 4.3 ms decode step of the 8B shape (bench/serve.py, run 28). Here every program reads one
CHUNK of a row once and keeps (max, first index of the max, sum of exp(x - max)); a second kernel
merges a row's chunks. Ties go to the smallest index, as torch.argmax's do, so the greedy tokens
are the torch path's for finite (and -inf) logits. A NaN or +inf logit is not torch's case here:
the id stays in the vocabulary but is not the one torch.argmax names (NaN counts as the max
there), and a +inf makes the lse NaN (torch: inf).
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import require

CHUNK = 2048  # 63 programs a row at a 128k vocabulary: enough to spread batch 1 over the SMs


@triton.jit
def _chunk_kernel(
    logits_ptr,
    part_max_ptr,
    part_idx_ptr,
    part_sum_ptr,
    V,
    stride_row,
    num_chunks,
    CHUNK: tl.constexpr,
):
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    offs = chunk * CHUNK + tl.arange(0, CHUNK)
    x = tl.load(
        logits_ptr + row.to(tl.int64) * stride_row + offs, mask=offs < V, other=float("-inf")
    )
    m = tl.max(x, 0)
    # Lanes past V are -inf and sit after every real lane: a chunk of -inf alone still names a real index.
    idx = tl.min(tl.where(x == m, offs, 2147483647), 0)
    total = tl.where(m == float("-inf"), 0.0, tl.sum(tl.exp(x - m), 0))
    part = row * num_chunks + chunk
    tl.store(part_max_ptr + part, m)
    tl.store(part_idx_ptr + part, idx)
    tl.store(part_sum_ptr + part, total)


@triton.jit
def _merge_kernel(
    part_max_ptr,
    part_idx_ptr,
    part_sum_ptr,
    ids_ptr,
    logprobs_ptr,
    lse_ptr,
    V,
    num_chunks,
    BLOCK_C: tl.constexpr,
):
    row = tl.program_id(0)
    c = tl.arange(0, BLOCK_C)
    valid = c < num_chunks
    part = row * num_chunks + c
    m = tl.load(part_max_ptr + part, mask=valid, other=float("-inf"))
    idx = tl.load(part_idx_ptr + part, mask=valid, other=2147483647)
    total = tl.load(part_sum_ptr + part, mask=valid, other=0.0)
    best = tl.max(m, 0)
    # The first chunk holding the row's max holds its first index: the smallest index among them.
    first = tl.min(tl.where(valid & (m == best), idx, 2147483647), 0)
    scale = tl.where(m == float("-inf"), 0.0, tl.exp(m - best))
    lse = best + tl.log(tl.sum(total * scale, 0))
    # Never an id past the vocabulary, whatever the logits hold (a NaN row compares equal to nothing).
    tl.store(ids_ptr + row, tl.minimum(first, V - 1).to(tl.int64))
    tl.store(logprobs_ptr + row, best - lse)
    tl.store(lse_ptr + row, lse)


def greedy_draw(
    logits: torch.Tensor,
    chunk: int = CHUNK,
    out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits float32 [R, V] -> (ids int64 [R]: each row's argmax, the first on ties as torch.argmax;
    logprobs float32 [R]: the id's log-probability; lse float32 [R]: the row's log-sum-exp),
    written into out's three tensors when given (contiguous, [R] each, those dtypes)."""
    require(
        logits.dim() == 2 and logits.dtype == torch.float32,
        f"greedy_draw takes float32 logits [R, V], got {logits.dtype} {tuple(logits.shape)}",
    )
    require(logits.stride(1) == 1, "greedy_draw needs each row of the logits contiguous")
    require(chunk > 0 and chunk & (chunk - 1) == 0, f"chunk must be a power of two, got {chunk}")
    num_rows, vocab = logits.shape
    require(
        0 < vocab <= 2**31 - chunk, f"greedy_draw needs 1 <= V <= 2**31 - chunk, got V = {vocab}"
    )
    require(
        triton.cdiv(vocab, chunk) <= 65535,
        f"V = {vocab} needs more than 65535 chunks of {chunk}: a larger chunk",
    )
    device = logits.device
    if out is None:
        ids = torch.empty(num_rows, dtype=torch.int64, device=device)
        logprobs = torch.empty(num_rows, dtype=torch.float32, device=device)
        lse = torch.empty(num_rows, dtype=torch.float32, device=device)
    else:
        ids, logprobs, lse = out
        require(
            all(
                t.shape == (num_rows,) and t.is_contiguous() and t.device == device
                for t in (ids, logprobs, lse)
            )
            and (ids.dtype, logprobs.dtype, lse.dtype)
            == (torch.int64, torch.float32, torch.float32),
            f"greedy_draw's out must be three contiguous [{num_rows}] tensors (int64, float32, "
            f"float32) on {device}",
        )
    if num_rows == 0:
        return ids, logprobs, lse
    num_chunks = triton.cdiv(vocab, chunk)
    part_max = torch.empty(num_rows * num_chunks, dtype=torch.float32, device=device)
    part_sum = torch.empty_like(part_max)
    part_idx = torch.empty(num_rows * num_chunks, dtype=torch.int32, device=device)
    with torch.cuda.device(device) if logits.is_cuda else contextlib.nullcontext():
        _chunk_kernel[(num_rows, num_chunks)](
            logits,
            part_max,
            part_idx,
            part_sum,
            vocab,
            logits.stride(0),
            num_chunks,
            CHUNK=chunk,
            num_warps=4,
        )
        _merge_kernel[(num_rows,)](
            part_max,
            part_idx,
            part_sum,
            ids,
            logprobs,
            lse,
            vocab,
            num_chunks,
            BLOCK_C=triton.next_power_of_2(num_chunks),
            num_warps=1,
        )
    return ids, logprobs, lse
