"""Progress of a long load (weights read, a GGUF file converted) as log lines: one each tenth of
the work and one at its end, with the bytes and the rate, so that an operator watching a pod's
log (text or JSON) sees a 16 GB load move instead of minutes of silence."""

from __future__ import annotations

import logging
import time

log = logging.getLogger("tandem.load")


class Progress:
    def __init__(self, what: str, total_items: int, total_bytes: int = 0):
        self.what = what
        self.total_items = max(1, total_items)
        self.total_bytes = total_bytes
        self.items = 0
        self.bytes = 0
        self.started = time.monotonic()
        self._next_tenth = 1

    def step(self, num_bytes: int = 0) -> None:
        """One item done (num_bytes of it)."""
        self.items += 1
        self.bytes += num_bytes
        tenth = self.items * 10 // self.total_items
        if tenth < self._next_tenth and self.items < self.total_items:
            return
        self._next_tenth = tenth + 1
        seconds = time.monotonic() - self.started
        size = (
            f", {self.bytes / 1e9:.2f} of {self.total_bytes / 1e9:.2f} GB"
            if self.total_bytes
            else ""
        )
        rate = f", {self.bytes / 1e9 / seconds:.2f} GB/s" if self.bytes and seconds > 0 else ""
        log.info(
            "%s: %d%% (%d of %d%s) after %.1f s%s",
            self.what,
            self.items * 100 // self.total_items,
            self.items,
            self.total_items,
            size,
            seconds,
            rate,
        )
