"""OpenAI request fields -> tandem SamplingParams, and tandem outputs -> OpenAI response bodies."""

from __future__ import annotations

import time
import uuid
from typing import Any

from tandem.client import GuidedDecodingParams, SamplingParams
from tandem.openai.protocol import ChatCompletionRequest, CompletionRequest

# tandem's finish reasons as OpenAI names them ("abort" is vLLM's word for a cancelled request).
FINISH_REASONS = {"stop": "stop", "length": "length", "cancelled": "abort", None: None}


def sampling_params(
    request: CompletionRequest | ChatCompletionRequest,
    max_tokens: int | None,
    num_logprobs: int | None,
    add_special_tokens: bool,
    guide: dict | None = None,
    skip_special_tokens: bool | None = None,
) -> SamplingParams:
    """guide: GuidedDecodingParams' fields (default: the request's own guide);
    skip_special_tokens: overrides the request's."""
    # OpenAI's default temperature is 1 (sampling); tandem's own default is greedy.
    temperature = 1.0 if request.temperature is None else request.temperature
    guide = guide or request.guide
    return SamplingParams(
        guided_decoding=GuidedDecodingParams(**guide) if guide else None,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=request.top_p,
        top_k=request.top_k,
        min_p=request.min_p,
        min_tokens=request.min_tokens,
        seed=request.seed,
        n=request.n,
        stop=request.stop,
        stop_token_ids=request.stop_token_ids,
        include_stop_str_in_output=request.include_stop_str_in_output,
        ignore_eos=request.ignore_eos,
        repetition_penalty=request.repetition_penalty,
        presence_penalty=request.presence_penalty,
        frequency_penalty=request.frequency_penalty,
        logprobs=num_logprobs,
        skip_special_tokens=request.skip_special_tokens
        if skip_special_tokens is None
        else skip_special_tokens,
        add_special_tokens=add_special_tokens,
    )


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def envelope(
    object_name: str, response_id: str, model: str, created: int, choices: list[dict], **extra
) -> dict:
    return {
        "id": response_id,
        "object": object_name,
        "created": created,
        "model": model,
        "choices": choices,
        **extra,
    }


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    }


def now() -> int:
    return int(time.time())


def _value(logprob: Any) -> float:
    # A plain float, or an object with .logprob (TensorRT-LLM's Logprob).
    return float(getattr(logprob, "logprob", logprob))


def _top(entry: dict[int, Any], k: int) -> list[tuple[int, float]]:
    return sorted(((t, _value(v)) for t, v in entry.items()), key=lambda item: -item[1])[:k]


def completion_logprobs(
    tokenizer, token_ids: list[int], entries: list[dict[int, Any]], k: int, text_offset: int
) -> dict:
    """The legacy completions format: tokens, token_logprobs, top_logprobs, text_offset."""
    tokens, token_logprobs, tops, offsets = [], [], [], []
    for token_id, entry in zip(token_ids, entries):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        tokens.append(text)
        token_logprobs.append(_value(entry[token_id]) if token_id in entry else None)
        tops.append(
            {tokenizer.decode([t], skip_special_tokens=False): lp for t, lp in _top(entry, k)}
            if k
            else None
        )
        offsets.append(text_offset)
        text_offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": tops,
        "text_offset": offsets,
    }


def chat_logprobs(tokenizer, token_ids: list[int], entries: list[dict[int, Any]], k: int) -> dict:
    """The chat format: one entry per token with its bytes and its top alternatives."""

    def item(token_id: int, logprob: float | None) -> dict:
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    content = []
    for token_id, entry in zip(token_ids, entries):
        content.append(
            {
                **item(token_id, _value(entry[token_id]) if token_id in entry else None),
                "top_logprobs": [item(t, lp) for t, lp in _top(entry, k)],
            }
        )
    return {"content": content}
