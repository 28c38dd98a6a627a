"""A sequence's PerfMetrics message (TensorRT-LLM's RequestPerfMetrics) from what the engine
recorded (engine/sequence_perf.SequencePerf) and what the worker saw of the request: its arrival
and, on a decode worker, the KV pull."""

from __future__ import annotations

from tandem.engine.sequence_perf import SequencePerf
from tandem.v1 import types_pb2


def perf_metrics(
    perf: SequencePerf,
    arrival_time: float,
    kv_transfer_start: float,
    kv_transfer_end: float,
    kv_transfer_bytes: int,
) -> types_pb2.PerfMetrics:
    """Wall-clock seconds throughout; the transfer fields stay 0 when no KV was pulled, the
    speculative-decoding counters when the worker drafts nothing."""
    msg = types_pb2.PerfMetrics(
        first_iter=perf.first_iter, last_iter=perf.last_iter, iter=perf.last_iter
    )
    timing = msg.timing_metrics
    timing.arrival_time = arrival_time
    timing.first_scheduled_time = perf.first_scheduled_time
    timing.first_token_time = perf.first_token_time
    timing.last_token_time = perf.last_token_time
    if kv_transfer_bytes:
        timing.kv_cache_transfer_start = kv_transfer_start
        timing.kv_cache_transfer_end = kv_transfer_end
        timing.kv_cache_size = kv_transfer_bytes
    kv = msg.kv_cache_metrics
    kv.num_total_allocated_blocks = perf.num_total_allocated_blocks
    kv.num_new_allocated_blocks = perf.num_new_allocated_blocks
    kv.num_reused_blocks = perf.num_reused_blocks
    kv.num_missed_blocks = perf.num_missed_blocks
    kv.kv_cache_hit_rate = perf.kv_cache_hit_rate
    spec = msg.speculative_decoding
    spec.SetInParent()
    spec.total_draft_tokens = perf.num_draft_tokens
    spec.total_accepted_draft_tokens = perf.num_accepted_draft_tokens
    if perf.num_draft_tokens:
        spec.acceptance_rate = perf.num_accepted_draft_tokens / perf.num_draft_tokens
    return msg
