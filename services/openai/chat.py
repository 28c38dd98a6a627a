"""/v1/chat/completions: the chat template, tool calls, the message and chunk shapes."""

from __future__ import annotations

import time

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.openai import responses as r
from tandem.openai.errors import OpenAIError
from tandem.openai.front import Front, event_stream, generate, log_ignored, within_context
from tandem.openai.protocol import ChatCompletionRequest
from tandem.openai.streams import Snapshot


async def chat_completions(
    front: Front, request: ChatCompletionRequest, http: Request | None = None
):
    started, endpoint = time.monotonic(), "/v1/chat/completions"
    model = await front.check_model(request.model)
    log_ignored(endpoint, request)
    tokenizer = await front.tokenizer()
    try:
        prompt = tokenizer.apply_chat_template(
            [m.for_template() for m in request.messages],
            tools=request.tools,
            add_generation_prompt=request.add_generation_prompt
            and not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}),
        )
    except ImportError as exc:
        raise OpenAIError(500, str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError and ours: the request's fault
        raise OpenAIError(400, f"cannot apply the chat template: {exc}") from exc
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    # The rendered template holds its special tokens (transformers tokenizes it without adding any).
    params = r.sampling_params(
        request, request.max_new_tokens, num_logprobs, add_special_tokens=False
    )
    prompts = await within_context(front, [prompt], request.max_new_tokens, False)
    response_id, created = r.new_id("chatcmpl"), r.now()
    outs = await generate(front, prompts, params, request.stream, http)

    def logprobs(token_ids, entries):
        return (
            r.chat_logprobs(tokenizer, token_ids, entries, num_logprobs)
            if num_logprobs is not None
            else None
        )

    if request.stream:

        def chunk(choices, **extra):
            return r.envelope(
                "chat.completion.chunk", response_id, model, created, choices, **extra
            )

        started_roles: set[int] = set()

        def chunks(snapshot: Snapshot):
            out = []
            for d in snapshot.deltas:
                if d.index not in started_roles:
                    started_roles.add(d.index)
                    out.append(
                        chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None,
                                    "finish_reason": None,
                                }
                            ]
                        )
                    )
                if d.text or d.finish_reason or d.token_ids:
                    out.append(
                        chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": {"content": d.text} if d.text else {},
                                    "logprobs": logprobs(d.token_ids, d.logprobs),
                                    "finish_reason": r.FINISH_REASONS[d.finish_reason],
                                    "stop_reason": d.stop_reason,
                                }
                            ]
                        )
                    )
            return out

        include_usage = request.stream_options is not None and request.stream_options.include_usage
        usage_chunk = (lambda u: chunk([], usage=u)) if include_usage else None
        return StreamingResponse(
            event_stream(front, endpoint, outs, started, chunks, usage_chunk),
            media_type="text/event-stream",
        )
    out = outs[0]
    choices = [
        {
            "index": o.index,
            "message": {"role": "assistant", "content": o.text},
            "logprobs": logprobs(o.token_ids, o.logprobs),
            "finish_reason": r.FINISH_REASONS[o.finish_reason],
            "stop_reason": o.stop_reason if o.finish_reason else None,
        }
        for o in out.outputs
    ]
    completion_tokens = sum(len(o.token_ids) for o in out.outputs)
    front.observe(endpoint, started, len(out.prompt_token_ids), completion_tokens)
    return r.envelope(
        "chat.completion",
        response_id,
        model,
        created,
        choices,
        usage=r.usage(len(out.prompt_token_ids), completion_tokens),
    )
