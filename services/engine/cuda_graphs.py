"""Decode steps replayed as CUDA graphs, one per padded batch size of a ladder.

A decode step launches ~10 kernels per layer, and launched one by one from Python
they cost more CPU time than the GPU spends running them (21-32 ms of CPU for 8 ms
of GPU work at batch 32, measured on an H200 before graphs). The forward and the
logits of a decode step, and each row's greedy draw (its argmax, log-probability and
log-sum-exp: such a step's sampler starts from them), are captured once per batch size
over the persistent input buffers (step_inputs.py); a step then fills the buffers and
replays one graph.
Prefill and mixed steps stay eager. On the CPU there is nothing to capture: the same
function runs directly, so CI runs the padded decode path the GPU replays.
"""

from __future__ import annotations

import bisect
import logging
import time
from collections.abc import Callable

import torch

from tandem.kernels import dispatch as kernels
from tandem.kernels.dispatch import GreedyDraws

log = logging.getLogger("tandem.cuda_graphs")


def capture_sizes(max_batch_size: int, dense_until: int | None = None) -> list[int]:
    """1, 2, 4, 8, then every 16 up to dense_until (default max_batch_size, which is always one),
    then every 64 (the rows past the sequences a step holds: speculative decoding's draft rows)."""
    dense_until = min(dense_until or max_batch_size, max_batch_size)
    sizes = [s for s in (1, 2, 4, 8) if s < dense_until] + list(range(16, dense_until, 16))
    sizes += [dense_until] + list(range(dense_until + 64, max_batch_size, 64))
    return sizes + [max_batch_size] if sizes[-1] != max_batch_size else sizes


class DecodeGraphs:
    """forward(batch_size) -> logits [batch_size, vocab], computed from the persistent buffers.
    prepare_dummy(batch_size) fills those buffers with inputs that are safe to run (no KV stored).
    A replay also draws each row greedily (kernels.dispatch.greedy_draw), so a step's launch leaves
    the sampler no kernel to launch when every row is greedy and nothing changes the logits."""

    def __init__(
        self,
        forward: Callable[[int], torch.Tensor],
        prepare_dummy: Callable[[int], None],
        max_batch_size: int,
        device: torch.device,
        dense_until: int | None = None,
    ):
        self.forward = forward
        self.prepare_dummy = prepare_dummy
        self.sizes = capture_sizes(max_batch_size, dense_until)
        self.device = device
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # Every graph writes its logits into the rows of one buffer (the largest size's): a
        # tensor per size kept alive would hold the sum over the ladder (GiBs for a 128k
        # vocabulary and a long ladder), where the pool reuses everything else.
        self._logits: torch.Tensor | None = None
        # The rows' greedy draws, one set of buffers for every size like the logits: allocated
        # outside the graphs' shared pool, where a replay of another size may reuse the memory.
        self._draws: GreedyDraws | None = None
        self._draw_rows: dict[int, GreedyDraws] = {}  # each size's rows of them
        self.capture_seconds = 0.0

    @property
    def is_captured(self) -> bool:
        return bool(self._graphs)

    def size_for(self, num_seqs: int) -> int | None:
        """The smallest batch size of the ladder that holds num_seqs rows; None if none does."""
        index = bisect.bisect_left(self.sizes, num_seqs)
        return self.sizes[index] if index < len(self.sizes) else None

    def capture(self) -> None:
        """Captures every size, largest first so the smaller ones reuse its memory pool."""
        if self.device.type != "cuda" or self._graphs:
            return
        started = time.perf_counter()
        pool = None
        # A stream of our own device: torch's default capture stream belongs to whichever device the
        # process first captured on, and capturing on it moves the current device there.
        stream = torch.cuda.Stream(device=self.device)
        for size in reversed(self.sizes):
            self.prepare_dummy(size)
            logits = self.forward(size)  # outside the capture: Triton compiles, cuBLAS picks
            kernels.greedy_draw(logits)
            if self._logits is None:
                self._logits = torch.empty_like(logits)
                rows = logits.shape[0]
                self._draws = (
                    torch.empty(rows, dtype=torch.int64, device=self.device),
                    torch.empty(rows, dtype=torch.float32, device=self.device),
                    torch.empty(rows, dtype=torch.float32, device=self.device),
                )
            del logits
            self._draw_rows[size] = tuple(t[:size] for t in self._draws)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: the worker's other threads may touch CUDA (NIXL, the gRPC loop) meanwhile.
            with torch.cuda.graph(
                graph, pool=pool, stream=stream, capture_error_mode="thread_local"
            ):
                logits = self.forward(size)
                self._logits[:size].copy_(logits)
                kernels.greedy_draw(logits, out=self._draw_rows[size])
                del logits
            pool = graph.pool() if pool is None else pool
            self._graphs[size] = graph
        torch.cuda.synchronize(self.device)
        self.capture_seconds = time.perf_counter() - started
        log.info(
            "captured %d decode CUDA graphs (batch sizes %s) in %.1f s",
            len(self.sizes),
            self.sizes,
            self.capture_seconds,
        )

    def run(self, size: int) -> tuple[torch.Tensor, GreedyDraws]:
        """Logits [size, vocab] of the step in the buffers and their rows' greedy draws. On CUDA both
        are the graphs' buffers, shared by every size: the next replay overwrites them, in stream
        order, so whatever reads them is queued before it."""
        if self.device.type != "cuda":
            logits = self.forward(size)
            return logits, kernels.greedy_draw(logits)
        self._graphs[size].replay()
        return self._logits[:size], self._draw_rows[size]

    def clear(self) -> None:
        """Forgets the graphs (their weights or KV pool are gone); the next capture() makes new ones."""
        self._graphs.clear()
        self._draw_rows.clear()
        self._logits = self._draws = None
