"""The router's part in a sequence's PerfMetrics (TensorRT-LLM's RequestPerfMetrics, asked for with
SamplingParams.return_perf_metrics): the workers record them, the router gives them its own
arrival time and makes one record of a split's two halves (types.proto, PerfMetrics)."""

from __future__ import annotations

from tandem.v1 import types_pb2


def stamp_arrival(msg: types_pb2.RequestOutput, arrival_time: float) -> None:
    """The request arrived when it reached the router, not when a worker got it."""
    for out in msg.outputs:
        if out.HasField("perf_metrics"):
            out.perf_metrics.timing_metrics.arrival_time = arrival_time


def combine_split(context: types_pb2.PerfMetrics, generation: types_pb2.PerfMetrics) -> None:
    """Makes generation (the decode's record) the whole sequence's: the prefill scheduled the
    request and drew its first token, the decode drew the rest and pulled the KV; both allocated
    the prompt's blocks, and the prefill's lookup is the one that decided what was computed."""
    timing, context_timing = generation.timing_metrics, context.timing_metrics
    timing.first_scheduled_time = context_timing.first_scheduled_time
    timing.first_token_time = context_timing.first_token_time
    kv, context_kv = generation.kv_cache_metrics, context.kv_cache_metrics
    kv.num_total_allocated_blocks += context_kv.num_total_allocated_blocks
    kv.num_new_allocated_blocks += context_kv.num_new_allocated_blocks
    kv.num_reused_blocks = context_kv.num_reused_blocks
    kv.num_missed_blocks = context_kv.num_missed_blocks
    kv.kv_cache_hit_rate = context_kv.kv_cache_hit_rate
    if context.HasField("prefix_pull"):  # the prefill ran the prompt, and pulled its prefix
        generation.prefix_pull.CopyFrom(context.prefix_pull)


def start_from_router(
    msg: types_pb2.RequestOutput, sent_time: float, first_token_time: float
) -> None:
    """A stream a migration moved after its first token: the worker that finished it recomputed the
    tokens so far, and the record of the start went down with the worker that had it; the router's
    own view stands in (when it sent the request, when the first token reached it)."""
    for out in msg.outputs:
        if out.HasField("perf_metrics"):
            timing = out.perf_metrics.timing_metrics
            timing.first_scheduled_time = sent_time
            timing.first_token_time = first_token_time
