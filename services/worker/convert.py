"""Proto messages <-> the engine's types. Validation errors are ValueErrors (INVALID_ARGUMENT)."""

from __future__ import annotations

from collections.abc import Callable

from tandem.common.sampling import check_several_returns, implies_greedy
from tandem.engine.sampling_options import SamplingOptions
from tandem.v1 import types_pb2


def _opt(msg, name: str, default):
    return getattr(msg, name) if msg.HasField(name) else default


def sampling_options(
    params: types_pb2.SamplingParams,
    eos_token_ids: tuple[int, ...],
    encode: Callable[[str], list[int]] | None = None,
) -> SamplingOptions:
    """SamplingParams -> SamplingOptions as TensorRT-LLM reads them: greedy when the params imply it
    (no temperature, top_k or top_p; top_k=1; top_p=0; temperature=0), else sampling at the given
    temperature or 1. end_id=-1 is no end id (the model's EOS does not stop the sequence). encode
    tokenizes the `bad` strings without special tokens (SamplingParams._setup)."""
    end_id = _opt(params, "end_id", None)
    best_of = _opt(params, "best_of", None)
    n = _opt(params, "n", 1)
    check_several_returns(params)
    beam_search = params.use_beam_search
    if best_of is not None and best_of != n and not beam_search:
        raise NotImplementedError(
            "best_of different from n is not supported yet without use_beam_search; "
            "leave best_of unset"
        )
    if beam_search:
        _check_beam_search(params)
    greedy = implies_greedy(params) or beam_search  # beams are searched, not sampled
    if end_id is not None and end_id != -1 and end_id < 0:
        raise ValueError(f"end_id must be a token id or -1 (no end id), got {end_id}")
    return SamplingOptions(
        max_tokens=_opt(params, "max_tokens", 32),
        min_tokens=_opt(params, "min_tokens", 0),
        temperature=0.0 if greedy else _opt(params, "temperature", 1.0),
        top_k=_opt(params, "top_k", 0),
        top_p=1.0 if greedy else _opt(params, "top_p", 1.0),
        min_p=_opt(params, "min_p", 0.0),
        seed=_opt(params, "seed", None),
        n=n,
        stop=tuple(params.stop),
        stop_token_ids=tuple(params.stop_token_ids),
        include_stop_str_in_output=params.include_stop_str_in_output,
        ignore_eos=params.ignore_eos,
        repetition_penalty=_opt(params, "repetition_penalty", 1.0),
        presence_penalty=_opt(params, "presence_penalty", 0.0),
        frequency_penalty=_opt(params, "frequency_penalty", 0.0),
        logprobs=_opt(params, "logprobs", None),
        prompt_logprobs=_opt(params, "prompt_logprobs", None),
        detokenize=_opt(params, "detokenize", True),
        skip_special_tokens=_opt(params, "skip_special_tokens", True),
        spaces_between_special_tokens=_opt(params, "spaces_between_special_tokens", True),
        eos_token_ids=eos_token_ids if end_id is None else () if end_id == -1 else (end_id,),
        bad_words=_bad_words(params, encode),
        no_repeat_ngram_size=_opt(params, "no_repeat_ngram_size", 0),
        embedding_bias=tuple(params.embedding_bias),
        return_context_logits=_opt(params, "return_context_logits", False),
        return_generation_logits=_opt(params, "return_generation_logits", False),
        return_perf_metrics=_opt(params, "return_perf_metrics", False),
        beam_width=(best_of or n) if beam_search else 1,
        length_penalty=_opt(params, "length_penalty", 0.0),
        early_stopping=_opt(params, "early_stopping", 1),
    )


def _check_beam_search(params: types_pb2.SamplingParams) -> None:
    """What TensorRT-LLM's TorchSampler.validate_request refuses with beam search, and what tandem's
    beam search does not do (it searches from the logits as transformers' num_beams does)."""
    if any(
        params.HasField(name) and getattr(params, name) != default
        for name, default in (
            ("repetition_penalty", 1.0),
            ("presence_penalty", 0.0),
            ("frequency_penalty", 0.0),
        )
    ):
        raise ValueError(
            "beam search does not support repetition, presence, or frequency penalties"
        )
    if params.HasField("logprobs") and params.logprobs > 0:
        raise ValueError(
            "beam search only supports returning the sampled logprob per token (logprobs=0)"
        )
    if params.return_generation_logits:
        raise NotImplementedError(
            "return_generation_logits with use_beam_search is not supported yet"
        )
    if params.HasField("guided_decoding") and params.guided_decoding.WhichOneof("guide"):
        raise NotImplementedError("guided_decoding with use_beam_search is not supported yet")
    if params.HasField("beam_search_diversity_rate") or len(params.beam_width_array):
        raise NotImplementedError(
            "SamplingParams.beam_search_diversity_rate / beam_width_array are not supported "
            "yet; leave them at their defaults"
        )


def _bad_words(params: types_pb2.SamplingParams, encode) -> tuple[tuple[int, ...], ...]:
    """TensorRT-LLM's SamplingParams._get_bad_words: each bad token id a word, then each bad string's ids."""
    words = [(t,) for t in params.bad_token_ids]
    if params.bad:
        if encode is None:
            raise ValueError("SamplingParams.bad needs the served tokenizer")
        words += [tuple(encode(text)) for text in params.bad]
    return tuple(words)


def check_unsupported(request) -> None:
    """Fields whose feature this build does not have fail loudly instead of being ignored."""
    if (
        request.HasField("prompt_adapter_request")
        and request.prompt_adapter_request.prompt_adapter_name
    ):
        raise NotImplementedError(
            "prompt adapters (prompt_adapter_request: prompt tuning's virtual tokens) are not "
            "supported; adapt the model with a LoRA adapter (lora_request) instead"
        )
    if request.HasField("priority") and not 0.0 <= request.priority <= 1.0:
        raise ValueError(f"priority must be in [0, 1], got {request.priority}")
    for name in _UNIMPLEMENTED_SAMPLING_FIELDS:
        if _is_set(request.sampling_params, name):
            raise NotImplementedError(
                f"SamplingParams.{name} is not supported yet; leave it at its default"
            )


# TensorRT-LLM SamplingParams fields this build does not implement yet (see types.proto): refused
# when set, never ignored. A bool is "set" when it differs from its default.
_UNIMPLEMENTED_SAMPLING_FIELDS = (
    "top_p_min",
    "top_p_reset_ids",
    "top_p_decay",
    "beam_search_diversity_rate",
    "beam_width_array",
    "return_encoder_output",
    "additional_model_outputs",
    "lookahead_config",
)
_BOOL_DEFAULTS = {
    "use_beam_search": False,
    "return_context_logits": False,
    "return_generation_logits": False,
    "exclude_input_from_output": True,
    "return_encoder_output": False,
}


def _is_set(params: types_pb2.SamplingParams, name: str) -> bool:
    if params.DESCRIPTOR.fields_by_name[name].is_repeated:
        return len(getattr(params, name)) > 0
    if not params.HasField(name):
        return False
    return name not in _BOOL_DEFAULTS or getattr(params, name) != _BOOL_DEFAULTS[name]
