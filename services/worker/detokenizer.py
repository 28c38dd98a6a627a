"""Incremental detokenization with stop strings, run per request on the asyncio side."""
from __future__ import annotations

from tandem.worker.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns a growing list of token ids into text deltas.

    Decoding the last few tokens with some left context (prefix_offset..read_offset)
    keeps each step O(1) while letting multi-token characters settle: a delta is
    held back while it ends in U+FFFD (an incomplete UTF-8 sequence).
    """

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool, stop: tuple[str, ...] = (),
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self.token_ids: list[int] = []
        self.text = ""
        self._prefix_offset = 0
        self._read_offset = 0
        self._emitted = 0
        self.stop_string: str | None = None

    def add(self, new_ids: list[int], final: bool = False) -> str:
        """Appends tokens; returns the new text that is safe to emit. Sets
        stop_string (and trims the text) when a stop string appears."""
        self.token_ids.extend(new_ids)
        ids = self.token_ids
        prefix = self.tokenizer.decode(ids[self._prefix_offset:self._read_offset], self.skip_special_tokens)
        full = self.tokenizer.decode(ids[self._prefix_offset:], self.skip_special_tokens)
        if len(full) > len(prefix) and (final or not full.endswith("\ufffd")):
            self.text += full[len(prefix):]
            self._prefix_offset = self._read_offset
            self._read_offset = len(ids)
        if self.stop and self.stop_string is None:
            self._check_stop()
        # Hold back a tail that could be the start of a stop string.
        hold = 0 if final or self.stop_string is not None else max((len(s) - 1 for s in self.stop), default=0)
        end = max(self._emitted, len(self.text) - hold)
        delta = self.text[self._emitted:end]
        self._emitted = end
        return delta

    def _check_stop(self) -> None:
        longest = max(len(s) for s in self.stop)
        window_start = max(0, self._emitted - longest)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            self.stop_string = s
            self.text = self.text[: at + len(s) if self.include_stop else at]
            self._emitted = min(self._emitted, len(self.text))
