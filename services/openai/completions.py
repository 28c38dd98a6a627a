"""/v1/completions."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.openai import responses as r
from tandem.openai.front import Front, event_stream, generate, log_ignored, within_context
from tandem.openai.protocol import CompletionRequest
from tandem.openai.streams import Snapshot


async def completions(front: Front, request: CompletionRequest, http: Request | None = None):
    started, endpoint = time.monotonic(), "/v1/completions"
    model, lora_request = await front.check_model(request.model)
    log_ignored(endpoint, request)
    tokenizer = await front.tokenizer()
    prompts = await within_context(front, request.prompts, request.max_tokens, True)
    params = r.sampling_params(
        request, request.max_tokens, request.logprobs, add_special_tokens=True
    )
    response_id, created = r.new_id("cmpl"), r.now()
    outs = await generate(front, prompts, params, request.stream, http, lora_request, response_id)

    def logprobs(token_ids, entries, offset):
        if request.logprobs is None:
            return None
        return r.completion_logprobs(tokenizer, token_ids, entries, request.logprobs, offset)

    if request.stream:
        offsets: dict[tuple[int, int], int] = {}

        def chunks(snapshot: Snapshot):
            choices = []
            for d in snapshot.deltas:
                key = (snapshot.request, d.index)
                if d.text or d.finish_reason or d.token_ids:
                    choices.append(
                        {
                            "index": snapshot.request * request.n + d.index,
                            "text": d.text,
                            "logprobs": logprobs(d.token_ids, d.logprobs, offsets.get(key, 0)),
                            "finish_reason": r.FINISH_REASONS[d.finish_reason],
                            "stop_reason": d.stop_reason,
                        }
                    )
                offsets[key] = offsets.get(key, 0) + len(d.text)
            return (
                [r.envelope("text_completion", response_id, model, created, choices)]
                if choices
                else []
            )

        include_usage = request.stream_options is not None and request.stream_options.include_usage
        usage_chunk = (
            (lambda u: r.envelope("text_completion", response_id, model, created, [], usage=u))
            if include_usage
            else None
        )
        return StreamingResponse(
            event_stream(front, endpoint, outs, started, chunks, usage_chunk),
            media_type="text/event-stream",
        )
    choices = [
        {
            "index": i * request.n + o.index,
            "text": o.text,
            "logprobs": logprobs(o.token_ids, o.logprobs, 0),
            "finish_reason": r.FINISH_REASONS[o.finish_reason],
            "stop_reason": o.stop_reason if o.finish_reason else None,
        }
        for i, out in enumerate(outs)
        for o in out.outputs
    ]
    prompt_tokens = sum(len(out.prompt_token_ids) for out in outs)
    completion_tokens = sum(len(o.token_ids) for out in outs for o in out.outputs)
    front.observe(endpoint, started, prompt_tokens, completion_tokens)
    return r.envelope(
        "text_completion",
        response_id,
        model,
        created,
        choices,
        usage=r.usage(prompt_tokens, completion_tokens),
    )
