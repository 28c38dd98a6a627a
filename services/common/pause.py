"""pause_generation's modes, as vLLM's: what happens to the requests in flight when it pauses."""

from __future__ import annotations

import enum


class PauseMode(enum.Enum):
    ABORT = "abort"  # each ends now (finish_reason "cancelled", its tokens so far)
    KEEP = "keep"  # each is frozen with its KV and continues after resume_generation

    @classmethod
    def parse(cls, mode: str) -> PauseMode:
        """PauseGenerationRequest.mode ("" is abort), or ValueError naming the valid modes."""
        try:
            return cls(mode or cls.ABORT.value)
        except ValueError:
            raise ValueError(
                f"pause_generation mode must be one of {[m.value for m in cls]}, got {mode!r}"
            ) from None
