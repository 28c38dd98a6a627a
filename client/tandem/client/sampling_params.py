"""tensorrt_llm.SamplingParams and GuidedDecodingParams: every field, TensorRT-LLM's defaults,
its construction-time checks (tensorrt_llm/sampling_params.py, SamplingParams._validate),
and the protobuf form.

What a tandem server cannot receive (Python callables) is refused here, when the params are
built; every other field travels, and the server refuses with UNIMPLEMENTED, naming the
field, what it does not implement yet (see types.proto).
"""

from __future__ import annotations

import json as _json
import os
from abc import ABC, abstractmethod
from dataclasses import dataclass, fields
from typing import Any

from tandem.v1 import types_pb2


@dataclass(slots=True, kw_only=True)
class GuidedDecodingParams:
    """At most one guide. json: a schema as JSON text, a dict, or a pydantic model (class or instance)."""

    json: str | dict | Any | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False
    structural_tag: str | None = None

    def _validate(self) -> None:
        num_guides = sum(bool(getattr(self, f.name)) for f in fields(self))
        if num_guides > 1:
            raise ValueError(f"Only one guide can be used for a request, but got {num_guides}.")

    def to_proto(self) -> types_pb2.GuidedDecodingParams:
        if self.json_object:
            return types_pb2.GuidedDecodingParams(json_object=True)
        if self.json is not None:
            schema = self.json
            if hasattr(schema, "model_json_schema"):  # a pydantic model, without importing pydantic
                schema = schema.model_json_schema()
            if not isinstance(schema, str):
                schema = _json.dumps(schema)
            return types_pb2.GuidedDecodingParams(json_schema=schema)
        for name in ("regex", "grammar", "structural_tag"):
            value = getattr(self, name)
            if value is not None:
                return types_pb2.GuidedDecodingParams(**{name: value})
        return types_pb2.GuidedDecodingParams()


_REPEATED = {
    "bad",
    "bad_token_ids",
    "stop",
    "stop_token_ids",
    "embedding_bias",
    "beam_width_array",
    "additional_model_outputs",
}
# Cannot travel to a server (Python objects); refused when a request carrying them is sent.
_LOCAL_ONLY = {"logits_processor", "apply_batched_logits_processor"}


class LogitsProcessor(ABC):
    """tensorrt_llm.sampling_params.LogitsProcessor, for scripts that subclass it. tandem runs
    no client-side callable in its server: a request whose SamplingParams carries one is refused
    (NotImplementedError) when it is sent."""

    @abstractmethod
    def __call__(self, req_id, logits, token_ids, stream_ptr, client_id): ...


class BatchedLogitsProcessor(ABC):
    """tensorrt_llm.sampling_params.BatchedLogitsProcessor (see LogitsProcessor)."""

    @abstractmethod
    def __call__(self, req_ids, logits, token_ids, stream_ptr, client_ids): ...


@dataclass(slots=True, kw_only=True)
class SamplingParams:
    """tensorrt_llm.SamplingParams, field for field, with TensorRT-LLM's defaults.

    Differences: embedding_bias is a list of floats (anything with .tolist() is converted;
    the client has no torch); logits_processor and apply_batched_logits_processor are
    refused (a callable cannot reach the server); return_prompt_token_ids is tandem's own.
    """

    end_id: int | None = None
    pad_id: int | None = None
    max_tokens: int = 32
    bad: str | list[str] | None = None
    bad_token_ids: list[int] | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False

    embedding_bias: list[float] | None = None
    logits_processor: Any | None = None
    apply_batched_logits_processor: bool = False

    n: int = 1
    best_of: int | None = None
    use_beam_search: bool = False

    top_k: int | None = None
    top_p: float | None = None
    top_p_min: float | None = None
    top_p_reset_ids: int | None = None
    top_p_decay: float | None = None
    seed: int | None = None
    temperature: float | None = None
    min_tokens: int | None = None
    beam_search_diversity_rate: float | None = None
    repetition_penalty: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    length_penalty: float | None = None
    early_stopping: int | None = None
    no_repeat_ngram_size: int | None = None
    min_p: float | None = None
    beam_width_array: list[int] | None = None

    logprobs: int | None = None
    prompt_logprobs: int | None = None
    return_context_logits: bool = False
    return_generation_logits: bool = False
    exclude_input_from_output: bool = True
    return_encoder_output: bool = False
    return_perf_metrics: bool = False
    additional_model_outputs: list[str] | None = None

    lookahead_config: Any | None = None
    guided_decoding: GuidedDecodingParams | None = None

    ignore_eos: bool = False
    detokenize: bool = True
    add_special_tokens: bool = True
    truncate_prompt_tokens: int | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_prompt_token_ids: bool = True

    def __post_init__(self):
        if self.pad_id is None:
            self.pad_id = self.end_id
        self.best_of = self.best_of or self.n
        if self.embedding_bias is not None:
            bias = self.embedding_bias
            self.embedding_bias = [
                float(v) for v in (bias.tolist() if hasattr(bias, "tolist") else bias)
            ]
        self._validate()

    def _refuse_local_only(self) -> None:
        """Refused when the request is sent (a script may build them and never use them)."""
        if self.logits_processor is not None:
            raise NotImplementedError(
                "logits_processor: a Python callable cannot be sent to a tandem server"
            )
        if self.apply_batched_logits_processor:
            raise NotImplementedError(
                "apply_batched_logits_processor: a tandem server runs no client-side "
                "batched logits processor"
            )

    def _validate(self) -> None:
        """TensorRT-LLM's checks and messages (SamplingParams._validate)."""
        if self.top_p is not None and (self.top_p < 0 or self.top_p > 1):
            raise ValueError(f"require 0 <= top_p <= 1, got top_p={self.top_p}")
        if self.top_k is not None and self.top_k < 0:
            raise ValueError(f"require top_k >= 0, got top_k={self.top_k}")
        if self.temperature is not None and self.temperature < 0:
            raise ValueError(f"require temperature >= 0, got temperature={self.temperature}")
        if self.best_of < self.n:
            raise ValueError(f"best_of ({self.best_of}) cannot be less than n ({self.n})")
        if (
            self.best_of > 1
            and self._greedy_decoding
            and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING")
        ):
            raise ValueError(
                f"Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, "
                f"got best_of={self.best_of}. Please set to best_of=1 or set an environment variable "
                f"TLLM_ALLOW_N_GREEDY_DECODING=1 to allow best_of > 1 under the greedy decoding."
            )
        if self.truncate_prompt_tokens is not None and self.truncate_prompt_tokens < 1:
            raise ValueError(
                f"truncate_prompt_tokens must be >= 1, got {self.truncate_prompt_tokens}"
            )
        if self.guided_decoding is not None:
            self.guided_decoding._validate()
        # As in TensorRT-LLM, logprobs=True asks for the top-1 and False for none.
        self.logprobs = _count(self.logprobs)
        self.prompt_logprobs = _count(self.prompt_logprobs)

    @staticmethod
    def params_imply_greedy_decoding(
        *, temperature: float | None, top_p: float | None, top_k: int | None
    ) -> bool:
        return (
            (temperature is None and top_p is None and top_k is None)
            or top_k == 1
            or top_p == 0.0
            or temperature == 0
        )

    @property
    def _greedy_decoding(self) -> bool:
        return not self.use_beam_search and self.params_imply_greedy_decoding(
            temperature=self.temperature, top_p=self.top_p, top_k=self.top_k
        )

    def to_proto(self) -> types_pb2.SamplingParams:
        self._refuse_local_only()
        msg = types_pb2.SamplingParams()
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None or f.name in _LOCAL_ONLY:
                continue
            if f.name == "best_of" and value == self.n:
                continue  # TensorRT-LLM's default (best_of = n) is the proto's default too
            if f.name in _REPEATED:
                getattr(msg, f.name).extend([value] if isinstance(value, str) else list(value))
            elif f.name == "guided_decoding":
                msg.guided_decoding.CopyFrom(value.to_proto())
            elif f.name == "lookahead_config":
                msg.lookahead_config.CopyFrom(_lookahead_proto(value))
            else:
                setattr(msg, f.name, value)
        return msg


def _count(value) -> int | None:
    if value is None or value is False:
        return None
    return int(value)


def _lookahead_proto(config: Any) -> types_pb2.LookaheadDecodingConfig:
    """tensorrt_llm's LookaheadDecodingConfig (or a dict / (W, N, G) tuple with the same values)."""
    names = ("max_window_size", "max_ngram_size", "max_verification_set_size")
    if isinstance(config, dict):
        values = [config[n] for n in names]
    elif isinstance(config, (tuple, list)):
        values = list(config)
    else:
        values = [getattr(config, n) for n in names]
    return types_pb2.LookaheadDecodingConfig(**dict(zip(names, (int(v) for v in values))))
