"""The MoE experts as two grouped GEMMs in Triton: same signature as `moe.py`'s `fused_moe`.

The (token, slot) pairs are sorted by expert (one stable argsort), and each expert's run of
pairs is cut into tiles of BLOCK_M rows; a program takes one tile and one BLOCK_N slice of the
output columns, so a tile of an expert's weights is read once for all the tokens that chose it,
and experts no token chose read nothing. One launch covers every expert:

1. gate/up: x's rows of the tile (gathered by token id) @ the expert's gate and up rows, SwiGLU
   in the epilogue (rounded where the torch reference rounds), written to an activation buffer
   [pairs, I] in sorted order;
2. down: the activation tile @ the expert's down rows, scaled by the pair's routing weight and
   written to the pair's own row of [tokens * k, H]; the k rows of a token are summed after, in
   a fixed order: no atomics, the same sums whatever the batch's mix.

The grid is a bound fixed by the number of pairs (ceil(pairs / BLOCK_M) + min(experts, pairs)
tiles), never by the routing: the tile table is built on the device by torch ops
(searchsorted over the experts' cumulative tile counts), nothing is read back to the host, so a
captured CUDA graph serves every routing; tiles past the last expert's return at once.
"""

from __future__ import annotations

import contextlib

import torch
import triton
import triton.language as tl

from tandem.kernels.launch_checks import FLOAT_DTYPES, require


@triton.jit
def _dot(a, b, UPCAST: tl.constexpr):
    # Triton 3.9's interpreter multiplies bf16 operands as their raw bits: upcast there only.
    if UPCAST:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision="ieee")  # fp32 stays fp32 (the default would be tf32)


@triton.jit
def _gate_up_kernel(
    x_ptr,
    w_ptr,
    act_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    hidden,
    inter,
    stride_x,
    stride_we,
    stride_wn,
    stride_act,
    TOP_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0)
    tokens = (pairs // TOP_K).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < inter
    ks = tl.arange(0, BLOCK_K)
    w_gate = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    w_up = w_gate + inter * stride_wn
    acc_gate = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_mask = k0 + ks < hidden
        a = tl.load(
            x_ptr + tokens[:, None] * stride_x + (k0 + ks)[None, :],
            mask=row_mask[:, None] & k_mask[None, :],
            other=0.0,
        )
        w_mask = k_mask[:, None] & col_mask[None, :]
        gate = tl.load(w_gate + (k0 + ks)[:, None], mask=w_mask, other=0.0)
        up = tl.load(w_up + (k0 + ks)[:, None], mask=w_mask, other=0.0)
        acc_gate += _dot(a, gate, UPCAST)
        acc_up += _dot(a, up, UPCAST)
    dtype = act_ptr.dtype.element_ty
    # The reference rounds the projection, silu(gate) and the product to the dtype.
    gate = acc_gate.to(dtype).to(tl.float32)
    up = acc_up.to(dtype).to(tl.float32)
    silu = (gate / (1.0 + tl.exp(-gate))).to(dtype).to(tl.float32)
    tl.store(
        act_ptr + rows[:, None].to(tl.int64) * stride_act + cols[None, :],
        (silu * up).to(dtype),
        mask=row_mask[:, None] & col_mask[None, :],
    )


@triton.jit
def _down_kernel(
    act_ptr,
    w_ptr,
    weights_ptr,
    out_ptr,
    sorted_pairs_ptr,
    tile_expert_ptr,
    tile_start_ptr,
    tile_end_ptr,
    hidden,
    inter,
    stride_act,
    stride_we,
    stride_wn,
    stride_out,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    start = tl.load(tile_start_ptr + tile)
    end = tl.load(tile_end_ptr + tile)
    if start >= end:
        return
    expert = tl.load(tile_expert_ptr + tile).to(tl.int64)
    rows = start + tl.arange(0, BLOCK_M)
    row_mask = rows < end
    pairs = tl.load(sorted_pairs_ptr + rows, mask=row_mask, other=0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    col_mask = cols < hidden
    ks = tl.arange(0, BLOCK_K)
    w_down = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * stride_wn
    act_rows = act_ptr + rows[:, None].to(tl.int64) * stride_act
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for k0 in range(0, inter, BLOCK_K):
        k_mask = k0 + ks < inter
        a = tl.load(
            act_rows + (k0 + ks)[None, :], mask=row_mask[:, None] & k_mask[None, :], other=0.0
        )
        w = tl.load(
            w_down + (k0 + ks)[:, None], mask=k_mask[:, None] & col_mask[None, :], other=0.0
        )
        acc += _dot(a, w, UPCAST)
    dtype = out_ptr.dtype.element_ty
    scale = tl.load(weights_ptr + pairs, mask=row_mask, other=0.0).to(tl.float32)
    y = acc.to(dtype).to(tl.float32) * scale[:, None]
    tl.store(
        out_ptr + pairs[:, None] * stride_out + cols[None, :],
        y.to(dtype),
        mask=row_mask[:, None] & col_mask[None, :],
    )


# Decided when the kernels were decorated (TRITON_INTERPRET=1 then), not at launch.
_IS_INTERPRETED = type(_gate_up_kernel).__name__ == "InterpretedFunction"


def tile_config(num_pairs: int, num_experts: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps): the row tile follows the pairs an expert gets on
    average (a decode step's few tokens waste less of a 16-row tile than of a 64-row one). Not
    tuned on a GPU yet (bench/moe.py measures it)."""
    per_expert = num_pairs / num_experts
    block_m = 16 if per_expert <= 16 else 32 if per_expert <= 32 else 64
    return block_m, 64, 64, 4


def precompile_variants(
    w_gate_up: torch.Tensor, w_down: torch.Tensor, top_k: int, weights_dtype: torch.dtype
) -> None:
    """Launches fused_moe once per row tile tile_config can pick (1, 17 and 33 pairs an expert),
    with the layer's weights, top-k and routing-weight dtype, so that serving compiles no variant
    (a compile mid-serving stalls every request for about a second)."""
    num_experts, hidden, device = w_gate_up.shape[0], w_gate_up.shape[2], w_gate_up.device
    for pairs_per_expert in (1, 17, 33):
        num_tokens = -(-pairs_per_expert * num_experts // top_k)
        # Row r takes experts r*k .. r*k+k-1 (mod E): distinct within a row, as top-k's are.
        ids = torch.arange(num_tokens * top_k, device=device).remainder(num_experts)
        fused_moe(
            torch.zeros(num_tokens, hidden, dtype=w_gate_up.dtype, device=device),
            w_gate_up,
            w_down,
            torch.ones(num_tokens, top_k, dtype=weights_dtype, device=device),
            ids.view(num_tokens, top_k),
        )


def align_tiles(
    topk_ids: torch.Tensor, num_experts: int, block_m: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(pairs sorted by expert [P] int32, then per tile: its expert, its first and end row in the
    sorted pairs [num_tiles] int32); a tile with start >= end is empty. Device ops only."""
    flat = topk_ids.reshape(-1).long()
    num_pairs = flat.numel()
    device = flat.device
    sorted_pairs = torch.argsort(flat, stable=True).to(torch.int32)
    counts = torch.zeros(num_experts, dtype=torch.int64, device=device)
    counts.scatter_add_(0, flat, torch.ones_like(flat))
    ends = counts.cumsum(0)
    tiles = (counts + block_m - 1) // block_m
    tile_ends = tiles.cumsum(0)
    num_tiles = triton.cdiv(num_pairs, block_m) + min(num_experts, num_pairs)
    tile_ids = torch.arange(num_tiles, device=device)
    expert = torch.searchsorted(tile_ends, tile_ids, right=True)
    valid = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    first_tile = tile_ends[expert] - tiles[expert]
    start = ends[expert] - counts[expert] + (tile_ids - first_tile) * block_m
    end = torch.where(valid, ends[expert], 0)
    return (
        sorted_pairs,
        expert.to(torch.int32),
        start.to(torch.int32),
        end.to(torch.int32),
    )


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """x [T, H] through the experts topk_ids [T, k] picks, each output scaled by its weight and
    summed per token -> [T, H] (moe.fused_moe)."""
    require(x.dim() == 2 and x.dtype in FLOAT_DTYPES, f"x must be [T, H] float, got {x.dtype}")
    num_tokens, hidden = x.shape
    require(
        w_gate_up.dim() == 3 and w_gate_up.shape[2] == hidden and w_gate_up.shape[1] % 2 == 0,
        f"w_gate_up must be [E, 2I, {hidden}], got {tuple(w_gate_up.shape)}",
    )
    num_experts, inter = w_gate_up.shape[0], w_gate_up.shape[1] // 2
    require(
        w_down.shape == (num_experts, hidden, inter),
        f"w_down must be [{num_experts}, {hidden}, {inter}], got {tuple(w_down.shape)}",
    )
    require(
        w_gate_up.dtype == w_down.dtype == x.dtype,
        f"x {x.dtype}, w_gate_up {w_gate_up.dtype} and w_down {w_down.dtype} must share a dtype",
    )
    require(
        topk_ids.dim() == 2
        and topk_ids.shape[0] == num_tokens
        and topk_weights.shape == topk_ids.shape
        and not topk_ids.is_floating_point()
        and topk_weights.is_floating_point(),
        f"topk_ids (integer) and topk_weights (float) must be [{num_tokens}, k], got "
        f"{tuple(topk_ids.shape)} {topk_ids.dtype} and {tuple(topk_weights.shape)}",
    )
    require(
        all(t.device == x.device for t in (w_gate_up, w_down, topk_weights, topk_ids)),
        "x, the expert weights and the routing must be on one device",
    )
    require(
        x.stride(1) == 1 and w_gate_up.stride(2) == 1 and w_down.stride(2) == 1,
        "x rows and the expert weights' rows must be contiguous",
    )
    top_k = topk_ids.shape[1]
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m, block_n, block_k, num_warps = tile or tile_config(num_pairs, num_experts)
    sorted_pairs, tile_expert, tile_start, tile_end = align_tiles(topk_ids, num_experts, block_m)
    num_tiles = tile_expert.numel()
    weights = topk_weights.reshape(-1).contiguous()
    act = torch.empty(num_pairs, inter, dtype=x.dtype, device=x.device)
    out = torch.empty(num_pairs, hidden, dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device) if x.is_cuda else contextlib.nullcontext():
        _gate_up_kernel[(num_tiles, triton.cdiv(inter, block_n))](
            x,
            w_gate_up,
            act,
            sorted_pairs,
            tile_expert,
            tile_start,
            tile_end,
            hidden,
            inter,
            x.stride(0),
            w_gate_up.stride(0),
            w_gate_up.stride(1),
            act.stride(0),
            TOP_K=top_k,
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            UPCAST=_IS_INTERPRETED,
            num_warps=num_warps,
        )
        _down_kernel[(num_tiles, triton.cdiv(hidden, block_n))](
            act,
            w_down,
            weights,
            out,
            sorted_pairs,
            tile_expert,
            tile_start,
            tile_end,
            hidden,
            inter,
            act.stride(0),
            w_down.stride(0),
            w_down.stride(1),
            out.stride(0),
            BLOCK_M=block_m,
            BLOCK_N=block_n,
            BLOCK_K=block_k,
            UPCAST=_IS_INTERPRETED,
            num_warps=num_warps,
        )
    return out.view(num_tokens, top_k, hidden).sum(dim=1)
