"""Mixture-of-experts: top-k routing and the experts' SwiGLU MLPs, the torch reference (the CPU
path and the oracle of `moe_triton.py`, same signature).

Expert weights are stacked: w_gate_up [E, 2I, H] (each expert's gate rows, then its up rows, as
transformers 5 holds them) and w_down [E, H, I]. The reference walks the experts in ascending
order and adds each one's weighted output into its tokens' rows, in the dtype, as
transformers' experts module does.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from tandem.kernels.fused import silu_and_mul


def route(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits [T, E] -> (weights [T, k] float32, expert ids [T, k] int64): softmax in float32,
    the k largest (torch.topk's order and ties, as transformers), renormalised to sum to 1 if asked."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    linear: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] = F.linear,
) -> torch.Tensor:
    """x [T, H] through the experts topk_ids [T, k] picks, each output scaled by its weight
    (topk_weights [T, k], float32 or x's dtype: the product is rounded to x's dtype once) and
    summed per token -> [T, H] in x's dtype. linear: the GEMM (batch_invariant.linear under
    --deterministic: a token's rows then do not depend on who else chose its experts)."""
    out = torch.zeros_like(x)
    num_experts = w_gate_up.shape[0]
    # Which (token, slot) pairs each expert serves, from one sort rather than E comparisons.
    flat = topk_ids.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    top_k = topk_ids.shape[1]
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        pairs = order[start : start + count]
        start += count
        tokens = pairs // top_k
        act = silu_and_mul(linear(x.index_select(0, tokens), w_gate_up[expert]))
        y = linear(act, w_down[expert])
        scale = topk_weights.reshape(-1).index_select(0, pairs)
        out.index_add_(0, tokens, (y.float() * scale.float()[:, None]).to(x.dtype))
    return out
