"""Batched sampling with per-request parameters, on the logits' device.

Every row gets its own temperature, top-k, top-p, min-p, penalties and min_tokens
blocking in one pass of tensor ops; the same code runs on the CPU and the GPU. Only
the sampled ids and log-probabilities (and the top-k log-probabilities of the rows
that asked) cross to the host, into reused (pinned, on CUDA) buffers.

Random rows draw by an exponential race: argmax(p / E) with E ~ Exp(1) is a draw
from p. A seeded row's E comes from a counter-based hash of (seed, token index,
vocab id) computed with integer tensor ops, so its draw depends on nothing else: not
on the batch, not on the device, not on where the request's earlier tokens were
drawn (a KV handoff or a migration continues the same stream).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from tandem.engine.guided import unpack_bitmask
from tandem.engine.sampling_options import SamplingOptions
from tandem.kernels import dispatch as kernels
from tandem.kernels.dispatch import GreedyDraws

_MASK32 = 0xFFFFFFFF
_MASK64 = 0xFFFFFFFFFFFFFFFF


@dataclass
class SampleResult:
    token_ids: list[int]
    logprobs: list[float]  # log-probability of each sampled token under the model
    top_logprobs: list[dict[int, float] | None]
    # Rank in the vocabulary (1 = most likely) of every entry of top_logprobs: the top k by their
    # order, the sampled token by a count on the device (executor/result.py, compute_logprobs).
    ranks: list[dict[int, int] | None] = field(default_factory=list)
    # The raw logits row of each row that asked for generation logits (a host tensor), else None.
    logits_rows: list = field(default_factory=list)
    # Beam rows: the top K processed log-probabilities of the next token, (values, ids).
    beam_candidates: list[tuple[list[float], list[int]] | None] = field(default_factory=list)


def row_key(seed: int, token_index: int) -> int:
    """32-bit key of a seeded row's token_index-th draw (splitmix64 of the pair)."""
    x = (seed * 0x9E3779B97F4A7C15 + (token_index + 1) * 0xD1B54A32D192ED03) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return (x ^ (x >> 31)) >> 32


def _mul32(x: torch.Tensor, constant: int) -> torch.Tensor:
    """(x * constant) mod 2**32 for int64 x in [0, 2**32), in two 16-bit halves: no int64 overflow."""
    low = x * (constant & 0xFFFF)
    high = ((x * (constant >> 16)) & 0xFFFF) << 16
    return (low + high) & _MASK32


def hashed_exponential(keys: torch.Tensor, weyl: torch.Tensor) -> torch.Tensor:
    """Exp(1) noise [rows, vocab]: murmur3's finalizer over key + vocab id * golden ratio (mod 2**32).
    keys int64 [rows], weyl int64 [vocab] = (id * 0x9E3779B9) mod 2**32. Integer-exact everywhere."""
    h = (keys[:, None] + weyl[None, :]) & _MASK32
    h = _mul32(h ^ (h >> 16), 0x85EBCA6B)
    h = _mul32(h ^ (h >> 13), 0xC2B2AE35)
    h = h ^ (h >> 16)
    uniform = ((h >> 8).float() + 0.5) * 2.0**-24  # 24 bits, strictly inside (0, 1)
    return -torch.log(uniform)


def _truncation_mask(
    probs: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor, min_p: torch.Tensor
) -> torch.Tensor:
    """True where a token is cut by top-k, top-p or min-p (each row its own values)."""
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    ranks = torch.arange(probs.shape[-1], device=probs.device).expand_as(probs)
    cut = (top_k.unsqueeze(1) > 0) & (ranks >= top_k.unsqueeze(1))
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    cut |= mass_before >= top_p.unsqueeze(1)
    cut |= sorted_probs < min_p.unsqueeze(1) * sorted_probs[:, :1]
    cut[:, 0] = False  # the most likely token always survives
    return torch.zeros_like(cut).scatter(1, order, cut)


# One position's top log-probabilities and their vocabulary ranks: ({token: logprob}, {token: rank}).
PositionLogprobs = tuple[dict[int, float], dict[int, int]]


def top_logprobs(logits: torch.Tensor, k: int) -> list[PositionLogprobs]:
    """The k most likely tokens of each row's distribution, ranked 1..k (read back to the host)."""
    values, ids = torch.log_softmax(logits.float(), dim=-1).topk(k, dim=-1)
    return [
        (dict(zip(i, v)), {t: r + 1 for r, t in enumerate(i)})
        for i, v in zip(ids.tolist(), values.tolist())
    ]


def _padded(rows: list[list[int]], pad: int, device: torch.device) -> torch.Tensor:
    width = max(1, max(len(r) for r in rows))
    return torch.tensor([r + [pad] * (width - len(r)) for r in rows], dtype=torch.long).to(
        device, non_blocking=True
    )


@dataclass
class SampledBatch:
    """One step's draws, still on the device; to_host() waits for them."""

    token_ids: torch.Tensor  # int64 [R]
    logprobs: torch.Tensor  # float32 [R]
    options: list[SamplingOptions]
    num_top: int  # columns of the top-logprob block (0: no row asked)
    host: _HostBuffers
    ready: torch.cuda.Event | None = None
    has_ranks: bool = False  # some row asked for logprobs: the sampled tokens' ranks came back
    beam_block: tuple[torch.Tensor, torch.Tensor] | None = (
        None  # [R, K] values and ids of beam rows
    )
    logits_block: torch.Tensor | None = (
        None  # raw rows of the rows with return_generation_logits (host)
    )

    def to_host(self) -> SampleResult:
        if self.ready is not None:
            self.ready.synchronize()
        num_rows = len(self.options)
        token_ids = self.host.token_ids[:num_rows].tolist()
        logprobs = self.host.logprobs[:num_rows].tolist()
        top: list[dict[int, float] | None] = [None] * num_rows
        ranks: list[dict[int, int] | None] = [None] * num_rows
        if self.has_ranks:  # some row asked for logprobs
            values = ids = None
            if self.num_top:
                values = (
                    self.host.top_values[: num_rows * self.num_top]
                    .view(num_rows, self.num_top)
                    .tolist()
                )
                ids = (
                    self.host.top_ids[: num_rows * self.num_top]
                    .view(num_rows, self.num_top)
                    .tolist()
                )
            sampled_ranks = self.host.ranks[:num_rows].tolist()
            for row, opt in enumerate(self.options):
                if opt.logprobs is None:
                    continue
                entry = {token_ids[row]: logprobs[row]}
                rank = {token_ids[row]: sampled_ranks[row]}
                if opt.logprobs:
                    entry.update(zip(ids[row][: opt.logprobs], values[row][: opt.logprobs]))
                    rank.update((t, i + 1) for i, t in enumerate(ids[row][: opt.logprobs]))
                top[row] = entry
                ranks[row] = rank
        candidates: list = []
        if self.beam_block is not None:
            values, ids = (t.tolist() for t in self.beam_block)
            candidates = [
                (values[row][: opt.num_beam_candidates], ids[row][: opt.num_beam_candidates])
                if opt.beam_width > 1
                else None
                for row, opt in enumerate(self.options)
            ]
        rows: list = []
        if self.logits_block is not None:
            wanted = iter(self.logits_block)
            rows = [next(wanted) if opt.return_generation_logits else None for opt in self.options]
        return SampleResult(token_ids, logprobs, top, ranks, rows, candidates)


class _HostBuffers:
    """One step's host side: the per-row parameters going down and the draws coming back,
    reused from step to step (pinned on CUDA, so both copies are asynchronous)."""

    PARAMS = ("temperature", "top_k", "top_p", "min_p", "is_seeded")

    def __init__(self, max_rows: int, max_top: int, pin: bool):
        def empty(*shape, dtype):
            return torch.zeros(*shape, dtype=dtype, pin_memory=pin)

        self.params = empty(len(self.PARAMS), max_rows, dtype=torch.float32)
        self.keys = empty(max_rows, dtype=torch.long)
        self.token_ids = empty(max_rows, dtype=torch.long)
        self.logprobs = empty(max_rows, dtype=torch.float32)
        self.ranks = empty(max_rows, dtype=torch.long)
        # Flat: a step's [rows, k] block lands contiguously, so its copy stays asynchronous.
        self.top_ids = empty(max_rows * max_top, dtype=torch.long)
        self.top_values = empty(max_rows * max_top, dtype=torch.float32)


class Sampler:
    MAX_TOP_LOGPROBS = 20  # SamplingOptions bounds logprobs to [0, 20]

    def __init__(
        self, vocab_size: int, max_rows: int, device: torch.device | str = "cpu", seed: int = 0
    ):
        self.device = torch.device(device)
        self.vocab_size = vocab_size
        self.max_rows = max_rows
        self._generator = torch.Generator(self.device).manual_seed(seed)
        self._weyl = (
            torch.arange(vocab_size, dtype=torch.long, device=self.device) * 0x9E3779B9
        ) & _MASK32
        pin = self.device.type == "cuda"
        # Two sets used in turn: a step's copies may still be queued while the next one is filled.
        self._host = [_HostBuffers(max_rows, self.MAX_TOP_LOGPROBS, pin) for _ in range(2)]
        self._turn = 0
        self._params = torch.zeros(len(_HostBuffers.PARAMS), max_rows, device=self.device)
        self._keys = torch.zeros(max_rows, dtype=torch.long, device=self.device)
        # id(options.embedding_bias) -> (the values, kept alive so the id stays theirs; on the device)
        self._biases: dict[int, tuple[tuple[float, ...], torch.Tensor]] = {}

    def sample(
        self,
        logits: torch.Tensor,
        options: list[SamplingOptions],
        token_indices: list[int],
        histories: list[list[int]],
        outputs: list[list[int]],
        blocked: list[frozenset[int]],
        allowed: torch.Tensor | None = None,
        greedy: GreedyDraws | None = None,
    ) -> SampledBatch:
        """logits [R, V] of R sequences. token_indices: which output token each row draws (its
        seeded noise); histories: prompt + output ids of rows with a repetition penalty (else []);
        outputs: output ids (presence/frequency penalties); blocked: ids a row may not draw yet;
        allowed: an int32 token bitmask [R, ceil(V/32)] of what each row may draw (a guide);
        greedy: the logits' greedy draws when the step already made them (a decode graph's replay:
        kernels.dispatch.greedy_draw's (ids, log-probabilities, lse) of these rows)."""
        num_rows = logits.shape[0]
        if num_rows > self.max_rows:
            raise ValueError(f"{num_rows} rows to sample; the sampler holds {self.max_rows}")
        if greedy is not None and greedy[0].shape[0] != num_rows:
            raise ValueError(
                f"greedy draws of {greedy[0].shape[0]} rows for {num_rows} rows of logits"
            )
        host = self._host[self._turn]
        self._turn ^= 1
        raw = logits.float()
        # Penalties and min_tokens are rare: their small index tensors are built per step. The rows
        # that ask for anything beyond a draw are found in one pass; only they are looked at again.
        extras = [row for row, o in enumerate(options) if not o.wants_only_draws]
        penalized = [row for row in extras if options[row].has_penalties]
        blocked_pairs = (
            [(row, t) for row, ids in enumerate(blocked) for t in ids] if any(blocked) else []
        )
        biased = [row for row in extras if options[row].embedding_bias]
        logits = raw.clone() if penalized or blocked_pairs or biased else raw
        if allowed is not None:
            logits = logits.masked_fill(
                ~unpack_bitmask(allowed.to(self.device, non_blocking=True), self.vocab_size),
                float("-inf"),
            )
        if biased:
            logits[biased] += torch.stack(
                [self._bias(options[row].embedding_bias) for row in biased]
            )
        if penalized:
            self._apply_penalties(logits, penalized, options, histories, outputs)
        if blocked_pairs:
            rows, ids = zip(*blocked_pairs)
            logits[
                torch.tensor(rows, device=self.device), torch.tensor(ids, device=self.device)
            ] = float("-inf")
        # Reported log-probabilities are the raw model's (before penalties, blocking and guides).
        # One pass finds the raw argmax and the lse; the lse always comes from that kernel (one
        # program per row on a GPU, where torch's logsumexp splits a row differently with the
        # number of rows: --deterministic).
        chosen, token_logprobs, lse = greedy if greedy is not None else kernels.greedy_draw(raw)
        if logits is not raw:  # penalties, blocking, a bias or a guide: the argmax of what is left
            chosen = logits.argmax(dim=-1)
        is_greedy = all(o.is_greedy for o in options)
        if not is_greedy:
            chosen = self._draw(logits, chosen, options, token_indices, host)
        if (
            logits is not raw or not is_greedy
        ):  # chosen is not raw's argmax: its logprob is gathered
            token_logprobs = raw.gather(1, chosen[:, None]).squeeze(1) - lse
        host.token_ids[:num_rows].copy_(chosen, non_blocking=True)
        host.logprobs[:num_rows].copy_(token_logprobs, non_blocking=True)
        num_top = max((options[row].logprobs or 0 for row in extras), default=0)
        if num_top:
            values, ids = (raw - lse[:, None]).topk(num_top, dim=-1)
            host.top_values[: values.numel()].view_as(values).copy_(values, non_blocking=True)
            host.top_ids[: ids.numel()].view_as(ids).copy_(ids, non_blocking=True)
        has_ranks = any(options[row].logprobs is not None for row in extras)
        if has_ranks:  # 1 + the tokens the model finds strictly more likely, counted on the device
            sampled_raw = raw.gather(1, chosen[:, None])
            host.ranks[:num_rows].copy_((raw > sampled_raw).sum(dim=-1) + 1, non_blocking=True)
        beam_block = None
        num_candidates = max(
            (options[row].num_beam_candidates for row in extras if options[row].beam_width > 1),
            default=0,
        )
        if (
            num_candidates
        ):  # log_softmax, then the processors' masks and bias (transformers' beam search)
            values, ids = (logits - lse[:, None]).topk(num_candidates, dim=-1)
            beam_block = (values.to("cpu", non_blocking=True), ids.to("cpu", non_blocking=True))
        logits_block = None
        wanted = [row for row in extras if options[row].return_generation_logits]
        if wanted:
            logits_block = raw[wanted].to("cpu", non_blocking=True)
        ready = None
        if self.device.type == "cuda":
            ready = torch.cuda.Event()
            ready.record()
        return SampledBatch(
            chosen,
            token_logprobs,
            list(options),
            num_top,
            host,
            ready,
            has_ranks,
            beam_block,
            logits_block,
        )

    def _bias(self, values: tuple[float, ...]) -> torch.Tensor:
        """A request's embedding bias on the device, built once per request (its options object
        lives as long as the request; a few are kept)."""
        key = id(values)
        if key not in self._biases:
            if len(self._biases) >= 64:
                self._biases.clear()
            self._biases[key] = (values, torch.tensor(values, dtype=torch.float32).to(self.device))
        return self._biases[key][1]

    def _apply_penalties(
        self,
        logits: torch.Tensor,
        rows: list[int],
        options: list[SamplingOptions],
        histories: list[list[int]],
        outputs: list[list[int]],
    ) -> None:
        vocab = self.vocab_size
        index = torch.tensor(rows, device=self.device)
        sub = logits[index]
        # One spare column takes the padding, so ragged rows scatter without masks.
        seen = torch.zeros(len(rows), vocab + 1, dtype=torch.bool, device=self.device)
        seen.scatter_(1, _padded([histories[r] for r in rows], vocab, self.device), True)
        repetition = torch.tensor(
            [options[r].repetition_penalty for r in rows], device=self.device
        )[:, None]
        penalized = torch.where(sub > 0, sub / repetition, sub * repetition)
        sub = torch.where(seen[:, :vocab], penalized, sub)
        counts = torch.zeros(len(rows), vocab + 1, device=self.device)
        out_ids = _padded([outputs[r] for r in rows], vocab, self.device)
        counts.scatter_add_(1, out_ids, torch.ones(out_ids.shape, device=self.device))
        counts = counts[:, :vocab]
        presence = torch.tensor([options[r].presence_penalty for r in rows], device=self.device)[
            :, None
        ]
        frequency = torch.tensor([options[r].frequency_penalty for r in rows], device=self.device)[
            :, None
        ]
        logits[index] = sub - presence * (counts > 0) - frequency * counts

    def _draw(
        self,
        logits: torch.Tensor,
        greedy_choice: torch.Tensor,
        options: list[SamplingOptions],
        token_indices: list[int],
        host: _HostBuffers,
    ) -> torch.Tensor:
        """Random rows draw by the exponential race; greedy rows keep greedy_choice. All rows go
        through the same ops (greedy ones at temperature 1, then discarded): no per-step index tensors."""
        num_rows = len(options)
        params = host.params.numpy()
        params[0, :num_rows] = [o.temperature for o in options]
        params[1, :num_rows] = [o.top_k for o in options]
        params[2, :num_rows] = [o.top_p for o in options]
        params[3, :num_rows] = [o.min_p for o in options]
        params[4, :num_rows] = [o.seed is not None for o in options]
        seeded = [row for row, o in enumerate(options) if o.seed is not None and not o.is_greedy]
        if seeded:
            keys = host.keys.numpy()
            keys[:num_rows] = 0
            for row in seeded:
                keys[row] = row_key(options[row].seed, token_indices[row])
            self._keys[:num_rows].copy_(host.keys[:num_rows], non_blocking=True)
        device_params = self._params[:, :num_rows]
        device_params.copy_(host.params[:, :num_rows], non_blocking=True)
        temperature, top_k, top_p, min_p, is_seeded = device_params
        is_greedy = temperature == 0
        probs = torch.softmax(logits / torch.where(is_greedy, 1.0, temperature)[:, None], dim=-1)
        if any(o.top_k or o.top_p < 1.0 for o in options):
            probs = probs.masked_fill(_truncation_mask(probs, top_k.long(), top_p, min_p), 0.0)
        elif any(o.min_p for o in options):
            probs = probs.masked_fill(
                probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0
            )
        if len(seeded) == sum(not o.is_greedy for o in options):
            noise = hashed_exponential(self._keys[:num_rows], self._weyl)
        else:
            noise = torch.empty_like(probs).exponential_(generator=self._generator)
            if seeded:
                noise = torch.where(
                    is_seeded[:, None] > 0,
                    hashed_exponential(self._keys[:num_rows], self._weyl),
                    noise,
                )
        return torch.where(is_greedy, greedy_choice, (probs / noise).argmax(dim=-1))
