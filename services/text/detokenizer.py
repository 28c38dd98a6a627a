"""Incremental detokenization with stop strings, one per generated sequence."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream

from tandem.text.tokenizer import Tokenizer


class IncrementalDetokenizer:
    """Turns generated token ids, one at a time, into text deltas.

    tokenizers' DecodeStream decodes each new token against a little left context and says
    nothing while the text would end inside a multi-byte character; what it emits is always
    a prefix of decode(all ids), so the end of the sequence flushes whatever it still holds
    with one full decode. Stop strings are found in the text; the tail that could be the
    start of one is held back until it cannot.
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        skip_special_tokens: bool,
        stop: tuple[str, ...] = (),
        include_stop_str_in_output: bool = False,
    ):
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.include_stop = include_stop_str_in_output
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self._hold = max((len(s) - 1 for s in stop), default=0)
        self.token_ids: list[int] = []
        # Everything decoded so far; text[:_emitted] has been handed out.
        self.text = ""
        self._emitted = 0
        self.stop_string: str | None = None
        # Where each token's text ends in text (its start is the previous token's end).
        self._ends: list[int] = []
        # Tokens that keep their place in the output once a stop string is found: those whose text
        # starts before the stop string (unless it is kept), as TensorRT-LLM trims the stop's tokens.
        self.num_kept_tokens: int | None = None
        self._stop_from = 0  # stop strings are looked for from here on (after a prefix)

    def add_prefix(self, token_ids: list[int]) -> str:
        """Tokens shown before the generated ones (the prompt, exclude_input_from_output=False): their
        text goes out at once and no stop string is looked for in it."""
        for token_id in token_ids:
            self.token_ids.append(token_id)
            self.text += self._stream.step(self.tokenizer.backend, token_id) or ""
            self._ends.append(len(self.text))
        start, self._emitted = self._emitted, len(self.text)
        self._stop_from = len(self.text)
        return self.text[start:]

    def add(self, token_id: int | None, final: bool = False) -> str:
        """Appends one token; returns the new text that is safe to emit. Sets stop_string (and
        trims the text) when a stop string appears. final: no token will follow. None adds no
        token (the end came with none: a trimmed stop token): only the held-back text is flushed."""
        if token_id is not None:
            self.token_ids.append(token_id)
            piece = self._stream.step(self.tokenizer.backend, token_id)
            if piece:
                self.text += piece
            self._ends.append(len(self.text))
        if final:
            full = self.tokenizer.decode(self.token_ids, self.skip_special_tokens)
            if full.startswith(self.text):
                self.text = full
        if self.stop and self.stop_string is None:
            self._check_stop()
        hold = 0 if final or self.stop_string is not None else self._hold
        end = max(self._emitted, len(self.text) - hold)
        delta = self.text[self._emitted : end]
        self._emitted = end
        return delta

    def _check_stop(self) -> None:
        window_start = max(self._stop_from, self._emitted - self._hold - 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            at = self.text.find(s, window_start)
            if at != -1 and (best is None or at < best[0]):
                best = (at, s)
        if best is not None:
            at, s = best
            self.stop_string = s
            self.num_kept_tokens = (
                len(self.token_ids) if self.include_stop else self._num_tokens_before(at)
            )
            self.text = self.text[: at + len(s) if self.include_stop else at]
            self._emitted = min(self._emitted, len(self.text))

    def _num_tokens_before(self, at: int) -> int:
        """Tokens whose text starts before text[at] (by full decodes of prefixes: the stream may
        emit a token's text with the next one's)."""
        for k in range(len(self.token_ids) - 1, -1, -1):
            if len(self.tokenizer.decode(self.token_ids[:k], self.skip_special_tokens)) < at:
                return k + 1
        return 0

    @property
    def num_emitted_tokens(self) -> int:
        """Tokens whose whole text has been handed out (no stop string can take them any more)."""
        return sum(1 for end in self._ends if end <= self._emitted)
