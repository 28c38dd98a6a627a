"""Per-sequence performance metrics (TensorRT-LLM's RequestPerfMetrics), recorded on the engine
thread only for sequences whose options ask for them (return_perf_metrics): the others carry
None and nothing is timed or counted for them.

Times are wall-clock seconds since the Unix epoch (time.time()), where TensorRT-LLM reads its
steady clock: a split request's times come from the router, the prefill and the decode, and only
a wall clock compares across processes. Iterations are the engine's step counter (the step that
launched the work, EngineCounters.iteration).
"""

from __future__ import annotations

import dataclasses
import time


@dataclasses.dataclass
class SequencePerf:
    first_scheduled_time: float = 0.0
    first_token_time: float = 0.0
    last_token_time: float = 0.0
    # The step that first scheduled the sequence, and the step that drew its latest token.
    first_iter: int = 0
    last_iter: int = 0
    # The block manager's answer at admission (the first one: a preempted sequence's later
    # admissions are not counted again), over the prompt's blocks (its tokens so far on a resumed
    # sequence); missed: those the prefix cache did not hold.
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    is_admitted: bool = False
    # Speculative decoding: draft tokens verified for the sequence, and those accepted.
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0

    def scheduled(self, iteration: int) -> None:
        if not self.first_scheduled_time:
            self.first_scheduled_time = time.time()
            self.first_iter = iteration

    def admitted(self, num_reused_blocks: int, num_prompt_blocks: int) -> None:
        """The prompt's blocks: num_reused_blocks of them found in the prefix cache, the rest
        allocated new (computed, or pulled from a prefill worker)."""
        if self.is_admitted:
            return
        self.is_admitted = True
        self.num_total_allocated_blocks = num_prompt_blocks
        self.num_reused_blocks = num_reused_blocks
        self.num_new_allocated_blocks = self.num_missed_blocks = (
            num_prompt_blocks - num_reused_blocks
        )

    def token_drawn(self, iteration: int) -> None:
        now = time.time()
        if not self.first_token_time:
            self.first_token_time = now
        self.last_token_time = now
        self.last_iter = iteration

    @property
    def kv_cache_hit_rate(self) -> float:
        """Reused over looked-up blocks, as TensorRT-LLM's kvCacheHitRate."""
        looked_up = self.num_reused_blocks + self.num_missed_blocks
        return self.num_reused_blocks / looked_up if looked_up else 0.0
