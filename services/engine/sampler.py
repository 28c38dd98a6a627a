"""Batched sampling with per-request parameters.

Every row gets its own temperature, top-k, top-p, min-p and penalties in one
pass. Random rows draw their noise from a per-step generator derived from the
request's seed, so a seeded request gives the same tokens whatever else shares
the batch and wherever each step runs.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from tandem.engine.sampling_options import SamplingOptions


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the model
    top_logprobs: list[dict[int, float] | None]


def _apply_penalties(logits: torch.Tensor, options: list[SamplingOptions], histories: list[list[int]],
                     outputs: list[list[int]]) -> torch.Tensor:
    for row, (opt, history, output) in enumerate(zip(options, histories, outputs)):
        if not opt.has_penalties:
            continue
        if opt.repetition_penalty != 1.0 and history:
            seen = torch.tensor(sorted(set(history)), dtype=torch.long)
            vals = logits[row, seen]
            logits[row, seen] = torch.where(vals > 0, vals / opt.repetition_penalty, vals * opt.repetition_penalty)
        if output and (opt.presence_penalty or opt.frequency_penalty):
            ids, counts = torch.tensor(output, dtype=torch.long).unique(return_counts=True)
            logits[row, ids] -= opt.presence_penalty + opt.frequency_penalty * counts.to(logits.dtype)
    return logits


def _truncation_mask(probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """True where a token is cut by top-k, top-p or min-p (each row its own values)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1]).expand_as(probs)
    cut = (top_k.unsqueeze(1) > 0) & (ranks >= top_k.unsqueeze(1))
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut |= mass_before >= top_p.unsqueeze(1)
    cut |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
    cut[:, 0] = False  # the most likely token always survives
    return torch.zeros_like(cut).scatter(1, order, cut)


class Sampler:
    def __init__(self, seed: int = 0):
        self._default_generator = torch.Generator().manual_seed(seed)

    @staticmethod
    def step_generator(seed: int | None, step: int) -> torch.Generator | None:
        """The generator of a seeded request's step-th token. Derived from (seed, step) rather
        than carried along, so a request continued on another worker (KV handoff, migration)
        draws exactly what it would have drawn in one place."""
        if seed is None:
            return None
        return torch.Generator().manual_seed((seed * 0x9E3779B1 + step * 0x85EBCA77) % (1 << 63))

    def sample(self, logits: torch.Tensor, options: list[SamplingOptions], generators: list[torch.Generator | None],
               histories: list[list[int]], outputs: list[list[int]], min_tokens_block: list[frozenset[int]]) -> SampleResult:
        logits = logits.float()
        raw_logprobs = torch.log_softmax(logits, dim=-1)
        logits = _apply_penalties(logits.clone(), options, histories, outputs)
        for row, blocked in enumerate(min_tokens_block):
            if blocked:
                logits[row, list(blocked)] = float("-inf")
        greedy = torch.tensor([o.is_greedy for o in options])
        chosen = logits.argmax(dim=-1)
        if not bool(greedy.all()):
            temps = torch.tensor([o.temperature if not o.is_greedy else 1.0 for o in options])
            probs = torch.softmax(logits / temps.unsqueeze(1), dim=-1)
            cut = _truncation_mask(probs,
                                   torch.tensor([o.top_k for o in options]),
                                   torch.tensor([o.top_p for o in options]),
                                   torch.tensor([o.min_p for o in options]))
            probs = probs.masked_fill(cut, 0.0)
            # Exponential race: argmax(p / E) with E ~ Exp(1) is a draw from p.
            noise = torch.stack([
                torch.empty(probs.shape[-1]).exponential_(generator=g or self._default_generator) for g in generators
            ])
            sampled = (probs / noise).argmax(dim=-1)
            chosen = torch.where(greedy, chosen, sampled)
        token_logprobs = raw_logprobs.gather(1, chosen.unsqueeze(1)).squeeze(1)
        top: list[dict[int, float] | None] = []
        for row, opt in enumerate(options):
            if opt.logprobs is None:
                top.append(None)
                continue
            entry = {int(chosen[row]): float(token_logprobs[row])}
            if opt.logprobs > 0:
                vals, ids = raw_logprobs[row].topk(opt.logprobs)
                entry.update({int(i): float(v) for i, v in zip(ids, vals)})
            top.append(entry)
        return SampleResult(chosen.tolist(), token_logprobs.tolist(), top)
