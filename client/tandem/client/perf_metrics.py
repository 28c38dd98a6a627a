"""CompletionOutput.request_perf_metrics: tensorrt_llm.bindings.executor.RequestPerfMetrics, its
attributes and their types, filled from the server's PerfMetrics (SamplingParams.return_perf_metrics).

TensorRT-LLM's times are datetime.timedelta since its steady clock's epoch; tandem's are
timedelta since the Unix epoch (a wall clock: a split request's times come from the router, the
prefill and the decode), so differences and total_seconds() read the same way."""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import timedelta

from tandem.v1 import types_pb2


@dataclass(slots=True)
class TimingMetrics:
    """A zero time (timedelta(0)) is one that did not happen: no KV pull, for the transfer's."""

    arrival_time: timedelta = timedelta(0)
    first_scheduled_time: timedelta = timedelta(0)
    first_token_time: timedelta = timedelta(0)
    last_token_time: timedelta = timedelta(0)
    kv_cache_transfer_start: timedelta = timedelta(0)
    kv_cache_transfer_end: timedelta = timedelta(0)
    kv_cache_size: int = 0  # bytes of KV pulled


@dataclass(slots=True)
class KvCacheMetrics:
    num_total_allocated_blocks: int = 0
    num_new_allocated_blocks: int = 0
    num_reused_blocks: int = 0
    num_missed_blocks: int = 0
    kv_cache_hit_rate: float = 0.0


@dataclass(slots=True)
class SpeculativeDecodingMetrics:
    """Draft tokens verified for the request and accepted (zeros on a worker that drafts none;
    --speculative-config)."""

    acceptance_rate: float = 0.0
    total_accepted_draft_tokens: int = 0
    total_draft_tokens: int = 0


@dataclass(slots=True)
class PrefixPull:
    """tandem's: how a cross-worker prefix pull the router asked for ended. outcome: pulled,
    partly_pulled, cancelled or computed (reason: nothing_leased, peer_unreachable, incompatible,
    weights_mismatch, no_room, pull_failed, unconfirmed, cached); source: the peer worker."""

    outcome: str = ""
    reason: str = ""
    source: str = ""
    num_pulled_blocks: int = 0
    num_cached_blocks: int = 0

    @classmethod
    def from_proto(cls, msg: types_pb2.PrefixPullMetrics) -> PrefixPull:
        return cls(
            msg.outcome, msg.reason, msg.source, msg.num_pulled_blocks, msg.num_cached_blocks
        )


@dataclass(slots=True)
class KvHandoff:
    """tandem's: how a split request's KV handoff ended on its decode worker. outcome: pulled,
    recomputed (reason: no_room, lease_expiring, pull_failed, peer_unreachable, unconfirmed),
    released, cancelled or failed."""

    outcome: str = ""
    reason: str = ""
    prefill: str = ""
    decode: str = ""
    num_pulled_blocks: int = 0
    num_cached_blocks: int = 0
    # Seconds the decode waited for room in its KV pool (--kv-room-wait-seconds).
    room_wait_s: float = 0.0
    # The decode reserved the prompt's blocks when the router announced the request.
    reserved_early: bool = False
    # The handoff came from the prefill itself, ahead of the router's (Worker/HandOff).
    from_prefill: bool = False

    @classmethod
    def from_proto(cls, msg: types_pb2.KvHandoffMetrics) -> KvHandoff:
        return cls(
            msg.outcome,
            msg.reason,
            msg.prefill,
            msg.decode,
            msg.num_pulled_blocks,
            msg.num_cached_blocks,
            msg.room_wait_s,
            msg.reserved_early,
            msg.from_prefill,
        )


@dataclass(slots=True)
class RequestPerfMetrics:
    timing_metrics: TimingMetrics = field(default_factory=TimingMetrics)
    kv_cache_metrics: KvCacheMetrics = field(default_factory=KvCacheMetrics)
    speculative_decoding: SpeculativeDecodingMetrics = field(
        default_factory=SpeculativeDecodingMetrics
    )
    # Engine steps (counted from 1); None where none was recorded, as TensorRT-LLM's Optional[int].
    first_iter: int | None = None
    last_iter: int | None = None
    iter: int | None = None
    # tandem's: a split request's KV handoff on its decode worker (None: not split).
    kv_handoff: KvHandoff | None = None
    # tandem's: the cross-worker prefix pull the router asked for (None: none asked).
    prefix_pull: PrefixPull | None = None

    @classmethod
    def from_proto(cls, msg: types_pb2.PerfMetrics) -> RequestPerfMetrics:
        t, kv, spec = msg.timing_metrics, msg.kv_cache_metrics, msg.speculative_decoding
        timing = TimingMetrics(
            arrival_time=timedelta(seconds=t.arrival_time),
            first_scheduled_time=timedelta(seconds=t.first_scheduled_time),
            first_token_time=timedelta(seconds=t.first_token_time),
            last_token_time=timedelta(seconds=t.last_token_time),
            kv_cache_transfer_start=timedelta(seconds=t.kv_cache_transfer_start),
            kv_cache_transfer_end=timedelta(seconds=t.kv_cache_transfer_end),
            kv_cache_size=t.kv_cache_size,
        )
        return cls(
            timing,
            KvCacheMetrics(
                kv.num_total_allocated_blocks,
                kv.num_new_allocated_blocks,
                kv.num_reused_blocks,
                kv.num_missed_blocks,
                kv.kv_cache_hit_rate,
            ),
            SpeculativeDecodingMetrics(
                spec.acceptance_rate, spec.total_accepted_draft_tokens, spec.total_draft_tokens
            ),
            msg.first_iter or None,
            msg.last_iter or None,
            msg.iter or None,
            KvHandoff.from_proto(msg.kv_handoff) if msg.HasField("kv_handoff") else None,
            PrefixPull.from_proto(msg.prefix_pull) if msg.HasField("prefix_pull") else None,
        )
