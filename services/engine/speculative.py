"""Speculative decoding: draft tokens proposed on the host, verified by the target model in one
forward over k + 1 query tokens per sequence (engine/llm_engine.py).

Verification draws the target's own token at every drafted position, with the sequence's
sampling options and the noise of that position's token index (sampler.py): a draft is accepted
while it equals the target's draw, and the first draw that differs ends the step (it is the
step's last token). Greedy requests therefore get exactly the tokens of plain greedy decoding,
and sampled ones exactly the tokens plain decoding would draw with the same seed: the output
distribution is the target's. For drafts that are single tokens (n-gram and suffix lookups
propose one continuation, not a distribution) this is rejection sampling with a point-mass
draft: a draft x is accepted with probability p(x), and a rejected position draws from p
without x.

`--speculative-config` takes vLLM's JSON shape:

    {"method": "ngram", "num_speculative_tokens": 4,
     "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "suffix", "num_speculative_tokens": 4}
    {"method": "draft_model", "model": "/path/to/small-model", "num_speculative_tokens": 4}
    {"method": "eagle3", "model": "/path/to/eagle3-head", "num_speculative_tokens": 4}

and, with any method, "disable_by_batch_size": N (no drafts while more than N sequences run).

ngram (prompt lookup): the longest n-gram, n from prompt_lookup_max down to prompt_lookup_min,
that ends the sequence and occurred earlier in it (prompt and output) proposes the tokens that
followed its latest earlier occurrence. suffix: the same lookup, then, when the sequence has
none, over the outputs of the requests this engine finished before it (a bounded table of their
n-grams): agentic and repeated workloads reuse what earlier answers wrote. draft_model: a
smaller checkpoint with the target's vocabulary drafts greedily (engine/draft_model.py). eagle3:
an EAGLE-3 head in its published format drafts over three of the target's layers' states
(engine/eagle3.py). eagle (1/2), medusa and mtp are refused.
"""

from __future__ import annotations

import dataclasses
import json
from collections import OrderedDict

import numpy as np

from tandem.engine.draft_model import check_draft_model
from tandem.engine.eagle3_head import read_head_config

METHODS = ("ngram", "suffix", "draft_model", "eagle3")
# Methods of vLLM's shape this engine does not run, and why (the error says so).
_UNSUPPORTED = {
    "eagle": "an EAGLE (1/2) head, which this engine does not load (EAGLE-3 heads: 'eagle3')",
    "medusa": "Medusa heads, which this engine does not load",
    "mtp": "the checkpoint's multi-token-prediction layers, which this engine does not load",
}
MAX_SPECULATIVE_TOKENS = 16
# A sequence's n-gram index covers its last this many tokens.
INDEX_WINDOW = 4096
# The suffix method's table of earlier requests' n-grams: at most this many keys (oldest out).
SUFFIX_TABLE_KEYS = 1 << 18
_KEYS = {
    "method",
    "num_speculative_tokens",
    "prompt_lookup_min",
    "prompt_lookup_max",
    "model",
    "disable_by_batch_size",
}


@dataclasses.dataclass(frozen=True)
class SpeculativeConfig:
    method: str
    num_speculative_tokens: int
    prompt_lookup_min: int = 2
    prompt_lookup_max: int = 5
    # draft_model: the draft checkpoint's directory.
    model: str = ""
    # No drafts in a step whose running batch holds more sequences than this (vLLM's key): a
    # large batch's step is compute-bound, where a verify step's extra rows cost more than the
    # accepted drafts save, and its steps keep overlap scheduling. None: always draft.
    disable_by_batch_size: int | None = None

    @classmethod
    def parse(cls, text: str) -> SpeculativeConfig | None:
        """The --speculative-config JSON ("" or "null": none), checked, with errors that say what
        to give."""
        text = text.strip()
        if not text or text == "null":
            return None
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(
                f"--speculative-config is not JSON ({exc}): give e.g. "
                '\'{"method": "ngram", "num_speculative_tokens": 4}\''
            ) from None
        if not isinstance(raw, dict):
            raise ValueError("--speculative-config must be a JSON object")
        unknown = sorted(set(raw) - _KEYS)
        if unknown:
            raise ValueError(
                f"--speculative-config: unknown keys {unknown}; it takes {sorted(_KEYS)}"
            )
        method = raw.get("method")
        if method in _UNSUPPORTED:
            raise ValueError(
                f"--speculative-config: method {method!r} needs {_UNSUPPORTED[method]}; "
                f"give one of {list(METHODS)}"
            )
        if method not in METHODS:
            raise ValueError(
                f"--speculative-config: method must be one of {list(METHODS)}, got {method!r}"
            )
        values = {}
        for key, default in (
            ("num_speculative_tokens", None),
            ("prompt_lookup_min", cls.prompt_lookup_min),
            ("prompt_lookup_max", cls.prompt_lookup_max),
        ):
            value = raw.get(key, default)
            if value is None:
                raise ValueError(
                    f"--speculative-config needs {key} (1 to {MAX_SPECULATIVE_TOKENS})"
                )
            if isinstance(value, bool) or not isinstance(value, int):
                raise ValueError(
                    f"--speculative-config: {key} must be a whole number, got {value!r}"
                )
            values[key] = value
        k = values["num_speculative_tokens"]
        if not 1 <= k <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"--speculative-config: num_speculative_tokens must be in [1, "
                f"{MAX_SPECULATIVE_TOKENS}], got {k}"
            )
        low, high = values["prompt_lookup_min"], values["prompt_lookup_max"]
        if not 1 <= low <= high <= 32:
            raise ValueError(
                f"--speculative-config: need 1 <= prompt_lookup_min <= prompt_lookup_max <= 32, "
                f"got {low} and {high}"
            )
        disable = raw.get("disable_by_batch_size")
        if disable is not None and (
            isinstance(disable, bool) or not isinstance(disable, int) or disable < 1
        ):
            raise ValueError(
                "--speculative-config: disable_by_batch_size must be a whole number >= 1 (or "
                f"null: always draft), got {disable!r}"
            )
        model = raw.get("model", "")
        if method == "draft_model":
            check_draft_model(model)
        elif method == "eagle3":
            read_head_config(model)
        elif "model" in raw:
            raise ValueError(
                f'--speculative-config: method {method!r} takes no "model" (only draft_model and '
                "eagle3 do)"
            )
        return cls(method, k, low, high, model, disable)


class NgramIndex:
    """One sequence's n-grams (n in [low, high]) by where their latest occurrence ends, built as
    its tokens come: a lookup costs a dict probe per n, not a scan of the sequence. Only the last
    INDEX_WINDOW tokens are indexed (older entries are pruned as the sequence grows): a long
    prompt costs the engine thread a bounded first lookup and the index a bounded memory."""

    __slots__ = ("low", "high", "_ends", "_num_indexed", "_pruned_at")

    def __init__(self, low: int, high: int):
        self.low, self.high = low, high
        self._ends: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in range(low, high + 1)}
        # N-grams ending before this position are in the index (those in the window).
        self._num_indexed = 0
        self._pruned_at = 0

    def propose(self, seq, k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence (in the window) of the
        longest n-gram ending seq's tokens; [] when none occurred."""
        num = seq.num_tokens
        # Index the n-grams that end before the last position (the last one is the query itself).
        start = max(self._num_indexed, self.low, num - INDEX_WINDOW)
        if start < num:
            offset = max(0, start - self.high)
            chunk = seq.token_slice(offset, num)
            for end in range(start, num):
                at = end - offset
                for n, ends in self._ends.items():
                    if n <= end:
                        ends[tuple(chunk[at - n : at])] = end
        self._num_indexed = num
        if num - self._pruned_at >= INDEX_WINDOW:
            oldest = num - INDEX_WINDOW
            for n, ends in self._ends.items():
                self._ends[n] = {key: end for key, end in ends.items() if end >= oldest}
            self._pruned_at = num
        tail = seq.token_slice(max(0, num - self.high), num)
        for n in range(min(self.high, num - 1), self.low - 1, -1):
            end = self._ends[n].get(tuple(tail[len(tail) - n :]))
            if end is not None:
                return seq.token_slice(end, min(end + k, num))
        return []


def lookup_once(tokens: list[int], low: int, high: int, k: int) -> list[int]:
    """NgramIndex.propose over tokens without building an index: what a sequence drafts once (a
    context phase's handoff drafts) costs a vectorised scan of its last INDEX_WINDOW tokens, not
    a dict insert per token and n-gram size (~15 ms for a 4k prompt)."""
    num = len(tokens)
    first_end = max(0, num - INDEX_WINDOW)  # n-grams must end in the window, as the index's
    base = max(0, first_end - high)
    window = np.asarray(tokens[base:], dtype=np.int64)
    for n in range(min(high, num - 1), low - 1, -1):
        # Every n-gram ending before the last position (the last one is the query itself).
        grams = np.lib.stride_tricks.sliding_window_view(window[:-1], n)
        hits = np.flatnonzero((grams == window[-n:]).all(axis=1))
        hits = hits[base + hits + n >= first_end]
        if hits.size:
            end = base + int(hits[-1]) + n
            return list(tokens[end : min(end + k, num)])
    return []


class SuffixTable:
    """The n-grams of the outputs of finished requests (suffix decoding's cross-request part):
    (namespace, n-gram) -> the tokens that followed it, oldest out of a bounded table. The
    namespace is the request's cache_salt and LoRA adapter: one tenant's drafts (whose
    acceptance its perf metrics show) never come from another tenant's answers, as its prefix
    cache never does."""

    def __init__(self, low: int, high: int, max_keys: int = SUFFIX_TABLE_KEYS, span: int = 16):
        self.low, self.high = low, high
        self.max_keys = max_keys
        self.span = span
        self._next: OrderedDict[tuple, tuple[int, ...]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._next)

    def clear(self) -> None:
        self._next.clear()

    def add(self, namespace: tuple, tokens: list[int]) -> None:
        """A finished request's tokens (its prompt's tail and its output)."""
        for end in range(self.low, len(tokens)):
            follow = tuple(tokens[end : end + self.span])
            for n in range(self.low, min(self.high, end) + 1):
                key = (namespace, *tokens[end - n : end])
                self._next[key] = follow
                self._next.move_to_end(key)
        while len(self._next) > self.max_keys:
            self._next.popitem(last=False)

    def propose(self, namespace: tuple, tail: list[int], k: int) -> list[int]:
        """tail: the sequence's last tokens (at least `high` of them where it has them)."""
        for n in range(min(self.high, len(tail)), self.low - 1, -1):
            follow = self._next.get((namespace, *tail[len(tail) - n :]))
            if follow:
                return list(follow[:k])
        return []


class Proposer:
    """Drafts for a sequence: its own n-grams, then (suffix) the table of earlier requests'."""

    def __init__(self, config: SpeculativeConfig):
        self.config = config
        self.suffixes = (
            SuffixTable(config.prompt_lookup_min, config.prompt_lookup_max)
            if config.method == "suffix"
            else None
        )

    def propose_all(self, wants: list[tuple]) -> dict:
        """wants: (sequence, k) pairs; each sequence's drafts (at most k tokens, maybe none)."""
        return {seq: self.propose(seq, k) for seq, k in wants}

    def propose_once(self, wants: list[tuple]) -> dict:
        """propose_all for sequences that draft once (handed-off context phases): the same
        drafts, looked up without building their n-gram indexes."""
        low, high = self.config.prompt_lookup_min, self.config.prompt_lookup_max
        found = {}
        for seq, k in wants:
            tokens = seq.token_slice(max(0, seq.num_tokens - INDEX_WINDOW - high), seq.num_tokens)
            drafts = lookup_once(tokens, low, high, k)
            if not drafts and self.suffixes is not None:
                drafts = self.suffixes.propose(_namespace(seq), tokens[-high:], k)
            found[seq] = drafts
        return found

    def propose(self, seq, k: int) -> list[int]:
        """Up to k draft tokens to follow seq's tokens (seq.spec_index is its n-gram index)."""
        if seq.spec_index is None:
            seq.spec_index = NgramIndex(
                self.config.prompt_lookup_min, self.config.prompt_lookup_max
            )
        drafts = seq.spec_index.propose(seq, k)
        if not drafts and self.suffixes is not None:
            num = seq.num_tokens
            tail = seq.token_slice(max(0, num - self.config.prompt_lookup_max), num)
            drafts = self.suffixes.propose(_namespace(seq), tail, k)
        return drafts

    def finished(self, seq) -> None:
        """A sequence ended: its output (and the prompt's tail before it) join the suffix table."""
        if self.suffixes is not None and seq.output_token_ids:
            tail = seq.prompt_token_ids[-self.config.prompt_lookup_max :]
            self.suffixes.add(_namespace(seq), tail + seq.output_token_ids)

    def reset(self) -> None:
        """Forgets earlier requests (the worker's warm-up is none of its clients')."""
        if self.suffixes is not None:
            self.suffixes.clear()

    # Lookups hold no device memory: nothing to release, resume or close.
    def release_memory(self, tags: list[str]) -> None:
        pass

    def resume_memory(self, tags: list[str]) -> None:
        pass

    def close(self) -> None:
        pass


def _namespace(seq) -> tuple:
    return (seq.cache_salt, seq.lora_fingerprint)
