"""Torch reference of the greedy draw (greedy_triton.py), same signature: the CPU path and the oracle."""

from __future__ import annotations

import torch


def greedy_draw(
    logits: torch.Tensor, out: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """logits float32 [R, V] -> (ids int64 [R]: each row's argmax, the first on ties as torch.argmax;
    logprobs float32 [R]: the id's log-probability; lse float32 [R]: the row's log-sum-exp),
    copied into out's three tensors when given."""
    lse = torch.logsumexp(logits, dim=-1)
    ids = logits.argmax(dim=-1)
    draws = (ids, logits.gather(1, ids[:, None]).squeeze(1) - lse, lse)
    if out is None:
        return draws
    for target, values in zip(out, draws):
        target.copy_(values)
    return out
