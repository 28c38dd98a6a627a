"""Which weights a captured small-batch decode step pulls into L2 ahead of their GEMM, and when.

At batch 1 an 8B decode step is GEMMs that stream weights (126 us of a layer's ~140 on an
H200) between kernels that barely touch memory: rotary + KV store and attention between
qkv_proj and o_proj, a norm before gate_up_proj and qkv_proj, SwiGLU before down_proj. Each
small GEMM also loses its first microseconds ramping up (o_proj reaches 0.48x of the copy
rate alone, run 9). While those light kernels run, a second stream prefetches (a leading
slice of every row of) the next GEMM's weight into L2, so the GEMM starts on cached bytes.
Only decode graphs capture it: the side stream forks from the capture stream after the
previous GEMM and joins at the end of the forward, so a replay is still one graph. Prefetches
read nothing into registers and write nothing: outputs are bit-identical with it off.

`TANDEM_L2_PREFETCH` sets the plan: `off`, or `name=fraction,...` over o_proj, gate_up_proj,
down_proj and qkv_proj (the next layer's), with an optional `mode=line|bulk` (one
prefetch instruction per 128-byte line, or one TMA bulk prefetch per row);
`TANDEM_L2_PREFETCH_ROWS` the largest batch that uses it.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from tandem.kernels import dispatch as kernels

TARGETS = ("o_proj", "gate_up_proj", "down_proj", "qkv_proj")
DEFAULT_PLAN = "o_proj=1"
DEFAULT_MAX_ROWS = 8


@dataclass(frozen=True)
class PrefetchPlan:
    fractions: dict[str, float] = field(default_factory=dict)
    mode: str = "line"
    max_rows: int = DEFAULT_MAX_ROWS

    @classmethod
    def parse(cls, text: str, max_rows: int = DEFAULT_MAX_ROWS) -> "PrefetchPlan":
        text = text.strip()
        if text in ("", "off", "0", "none"):
            return cls(max_rows=max_rows)
        fractions, mode = {}, "line"
        for item in text.split(","):
            name, sep, value = item.partition("=")
            name = name.strip()
            if not sep:
                raise ValueError(f"TANDEM_L2_PREFETCH item {item!r} is not name=value")
            if name == "mode":
                mode = value.strip()
                if mode not in ("line", "bulk"):
                    raise ValueError(f"TANDEM_L2_PREFETCH mode={mode!r}; expected line or bulk")
                continue
            if name not in TARGETS:
                raise ValueError(f"TANDEM_L2_PREFETCH names {name!r}; expected one of {TARGETS}")
            try:
                fraction = float(value)
            except ValueError:
                raise ValueError(f"TANDEM_L2_PREFETCH {name}={value!r} is not a number") from None
            if not 0.0 <= fraction <= 1.0:
                raise ValueError(f"TANDEM_L2_PREFETCH {name}={fraction} must be in [0, 1]")
            if fraction > 0:
                fractions[name] = fraction
        if max_rows < 0:
            raise ValueError(f"TANDEM_L2_PREFETCH_ROWS={max_rows} must be >= 0")
        return cls(fractions, mode, max_rows)

    @classmethod
    def from_env(cls) -> "PrefetchPlan":
        rows = os.environ.get("TANDEM_L2_PREFETCH_ROWS", str(DEFAULT_MAX_ROWS))
        try:
            max_rows = int(rows)
        except ValueError:
            raise ValueError(f"TANDEM_L2_PREFETCH_ROWS={rows!r} is not an integer") from None
        return cls.parse(os.environ.get("TANDEM_L2_PREFETCH", DEFAULT_PLAN), max_rows)


class WeightPrefetcher:
    """Owned by the model; `fetch(name, weight)` right after the GEMM before `weight`'s is enqueued."""

    def __init__(self, plan: PrefetchPlan | None = None) -> None:
        self.plan = plan if plan is not None else PrefetchPlan()
        self._side: torch.cuda.Stream | None = None
        self._active = False
        self._forked = False
        self.num_fetches = 0  # prefetches captured into graphs so far

    def begin(self, num_tokens: int, device: torch.device) -> None:
        """Turns fetching on for this forward if it is being captured into a small decode graph."""
        self._active = (bool(self.plan.fractions) and device.type == "cuda" and num_tokens <= self.plan.max_rows
                        and torch.cuda.is_current_stream_capturing())
        if self._active and (self._side is None or self._side.device != device):
            self._side = torch.cuda.Stream(device=device)

    def fetch(self, name: str, weight: torch.Tensor) -> None:
        if not self._active:
            return
        fraction = self.plan.fractions.get(name)
        if fraction is None:
            return
        self._side.wait_stream(torch.cuda.current_stream(weight.device))
        with torch.cuda.stream(self._side):
            kernels.prefetch_l2(weight, fraction, self.plan.mode)
        self._forked = True
        self.num_fetches += 1

    def end(self) -> None:
        """Joins the side stream back (a capture must end on one stream)."""
        if self._forked:
            torch.cuda.current_stream(self._side.device).wait_stream(self._side)
        self._active = self._forked = False
