"""Bounds on what one request may ask for, each checked before any work is done on it.

The router and every worker check a GenerateRequest with the same limits at their text front
(tandem.text.front), before tokenizing: a request over a limit is refused with
INVALID_ARGUMENT naming the flag that sets it. gRPC itself refuses a message over
max_request_bytes (RESOURCE_EXHAUSTED) before it is parsed. The lease bounds are the prefill
worker's (prefill/lease_keeper.py): unclaimed KV handoffs may pin only part of its pool, and
prefixes leased to peers another part (prefill/prefix_leases.py).
"""

from __future__ import annotations

import dataclasses
import math

from tandem.common.flag_fields import flag_field
from tandem.v1 import types_pb2

# The engine refuses more top log-probabilities than this (engine/sampling_options.py).
ENGINE_MAX_LOGPROBS = 20


# A field that is also a flag of `tandem serve` and `tandem up` (cli/flags.py builds them).
_flag = flag_field


@dataclasses.dataclass(frozen=True)
class RequestLimits:
    max_request_bytes: int = _flag(16 << 20, "largest gRPC request a server accepts, in bytes")
    max_prompt_bytes: int = _flag(
        1 << 20, "longest prompt text, in UTF-8 bytes (checked before tokenizing)"
    )
    max_prompt_tokens: int = _flag(
        0, "longest prompt in tokens (0: the model's context length less one)"
    )
    max_n: int = _flag(128, "most sequences one request may ask for (n and best_of)")
    max_stop_strings: int = _flag(64, "most stop strings per request")
    max_stop_string_bytes: int = _flag(1024, "longest stop string, in UTF-8 bytes")
    max_stop_token_ids: int = _flag(1024, "most stop_token_ids per request")
    max_logprobs: int = _flag(
        ENGINE_MAX_LOGPROBS, "most top log-probabilities per token (logprobs)"
    )
    max_unclaimed_kv_fraction: float = _flag(
        0.5,
        "prefill: share of the KV pool that context_only handoffs not yet pulled may pin, all clients together",
    )
    max_unclaimed_kv_fraction_per_client: float = _flag(
        0.25,
        "prefill: share of the KV pool that one client's unpulled context_only handoffs may pin",
    )
    max_prefix_lease_kv_fraction: float = _flag(
        0.25,
        "a worker with --kv-prefix-pulls: share of its KV pool that prefixes leased to peers "
        "(LeasePrefix) may pin, all peers together; a lease past it is cut short",
    )

    def __post_init__(self):
        for f in dataclasses.fields(self):
            if getattr(self, f.name) < 0:
                raise ValueError(f"{f.name} must be >= 0, got {getattr(self, f.name)}")
        for name in ("max_request_bytes", "max_prompt_bytes", "max_n"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_logprobs > ENGINE_MAX_LOGPROBS:
            raise ValueError(
                f"max_logprobs must be <= {ENGINE_MAX_LOGPROBS} (the engine's own bound), "
                f"got {self.max_logprobs}"
            )
        if not 0 < self.max_unclaimed_kv_fraction_per_client <= self.max_unclaimed_kv_fraction <= 1:
            raise ValueError(
                "need 0 < max_unclaimed_kv_fraction_per_client <= max_unclaimed_kv_fraction <= 1"
            )
        if not 0 < self.max_prefix_lease_kv_fraction <= 1:
            raise ValueError(
                f"need 0 < max_prefix_lease_kv_fraction <= 1, got {self.max_prefix_lease_kv_fraction}"
            )


class LimitError(ValueError):
    """A request over one of the limits (INVALID_ARGUMENT)."""


def _over(what: str, value, limit, flag: str) -> LimitError:
    return LimitError(f"{what} is {value}; the limit is {limit} (--{flag.replace('_', '-')})")


def check_request(request, limits: RequestLimits) -> None:
    """Refuses a GenerateRequest over a limit; runs before the prompt is tokenized. (max_tokens
    needs no bound of its own: a sequence ends at the context's end, finish_reason length, as
    TensorRT-LLM's PyTorch backend clips it; check_prompt_tokens refuses a prompt that leaves
    no room to generate.)"""
    params = request.sampling_params
    check_request_type(request.disaggregated_params.request_type)
    check_finite(params)
    if request.HasField("priority") and not math.isfinite(request.priority):
        raise LimitError(f"priority must be a finite number, got {request.priority}")
    for name in ("n", "best_of"):
        if params.HasField(name) and getattr(params, name) > limits.max_n:
            raise _over(name, getattr(params, name), limits.max_n, "max_n")
    if len(params.stop) > limits.max_stop_strings:
        raise _over(
            "the number of stop strings",
            len(params.stop),
            limits.max_stop_strings,
            "max_stop_strings",
        )
    longest = max((len(s.encode()) for s in params.stop), default=0)
    if longest > limits.max_stop_string_bytes:
        raise _over(
            "the longest stop string (bytes)",
            longest,
            limits.max_stop_string_bytes,
            "max_stop_string_bytes",
        )
    if len(params.stop_token_ids) > limits.max_stop_token_ids:
        raise _over(
            "the number of stop_token_ids",
            len(params.stop_token_ids),
            limits.max_stop_token_ids,
            "max_stop_token_ids",
        )
    for name in ("logprobs", "prompt_logprobs"):
        if params.HasField(name) and getattr(params, name) > limits.max_logprobs:
            raise _over(name, getattr(params, name), limits.max_logprobs, "max_logprobs")


def check_prompt_size(prompt, limits: RequestLimits) -> None:
    """A text prompt's size in bytes, before it is tokenized. (Token ids as sent are bounded by
    max_request_bytes; the prompt that runs, by check_prompt_tokens.)"""
    if prompt.WhichOneof("kind") != "text":
        return
    # Every character is at least one byte: only a text near the limit needs encoding to count.
    num_bytes = len(prompt.text)
    if num_bytes > limits.max_prompt_bytes // 4:
        num_bytes = len(prompt.text.encode())
    if num_bytes > limits.max_prompt_bytes:
        raise _over(
            "the prompt text (bytes)", num_bytes, limits.max_prompt_bytes, "max_prompt_bytes"
        )


def check_prompt_tokens(num_tokens: int, limits: RequestLimits, max_model_len: int = 0) -> None:
    """The prompt that will run (after truncate_prompt_tokens), in tokens."""
    if limits.max_prompt_tokens and num_tokens > limits.max_prompt_tokens:
        raise _over(
            "the prompt (tokens)", num_tokens, limits.max_prompt_tokens, "max_prompt_tokens"
        )
    if max_model_len and num_tokens >= max_model_len:
        raise LimitError(
            f"the prompt has {num_tokens} tokens; the model's context is {max_model_len} tokens and at "
            f"least one must be left to generate"
        )


def check_request_type(request_type: int) -> None:
    if request_type not in types_pb2.RequestType.values():
        raise LimitError(
            f"disaggregated_params.request_type {request_type} is not a RequestType "
            f"({', '.join(types_pb2.RequestType.keys())})"
        )


def check_finite(params) -> None:
    """NaN or infinite sampling values would poison the logits (NaN temperature: token 0 forever)."""
    for field, value in params.ListFields():
        if field.cpp_type not in (field.CPPTYPE_FLOAT, field.CPPTYPE_DOUBLE):
            continue
        values = value if field.is_repeated else (value,)
        if not all(math.isfinite(v) for v in values):
            raise LimitError(f"SamplingParams.{field.name} must be finite; got NaN or infinity")
