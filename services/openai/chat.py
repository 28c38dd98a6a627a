"""/v1/chat/completions: the chat template, tool calls, the message and chunk shapes."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import StreamingResponse

from tandem.openai import responses as r
from tandem.openai import tools as t
from tandem.openai.errors import OpenAIError
from tandem.openai.front import Front, event_stream, generate, log_ignored, within_context
from tandem.openai.protocol import MAX_GUIDE_CHARS, ChatCompletionRequest, NamedToolChoice
from tandem.openai.streams import Snapshot


async def chat_completions(
    front: Front, request: ChatCompletionRequest, http: Request | None = None
):
    started, endpoint = time.monotonic(), "/v1/chat/completions"
    model, lora_request = await front.check_model(request.model)
    log_ignored(endpoint, request)
    tokenizer = await front.tokenizer()
    try:
        prompt = tokenizer.apply_chat_template(
            [m.for_template() for m in request.messages],
            tools=request.tools_for_template,
            add_generation_prompt=request.add_generation_prompt
            and not request.continue_final_message,
            continue_final_message=request.continue_final_message,
            **(request.chat_template_kwargs or {}),
        )
    except ImportError as exc:
        raise OpenAIError(500, str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - jinja2's TemplateError and ours: the request's fault
        raise OpenAIError(400, f"cannot apply the chat template: {exc}") from exc
    calls = tool_calls_mode(request, front.tool_call_parser)
    num_logprobs = (request.top_logprobs or 0) if request.logprobs else None
    # The rendered template holds its special tokens (transformers tokenizes it without adding any).
    params = r.sampling_params(
        request,
        request.max_new_tokens,
        num_logprobs,
        add_special_tokens=False,
        guide=calls.guide,
        skip_special_tokens=calls.skip_special_tokens,
    )
    prompts = await within_context(front, [prompt], request.max_new_tokens, False)
    response_id, created = r.new_id("chatcmpl"), r.now()
    outs = await generate(front, prompts, params, request.stream, http, lora_request, response_id)

    def logprobs(token_ids, entries):
        return (
            r.chat_logprobs(tokenizer, token_ids, entries, num_logprobs)
            if num_logprobs is not None
            else None
        )

    def without_end_token(text: str, last_token: int) -> str:
        """The text without the special token that ended it, which a parser's
        skip_special_tokens=False leaves there (vLLM never writes the stop token's text)."""
        if calls.skip_special_tokens is not False or request.include_stop_str_in_output:
            return text
        piece = tokenizer.decode([last_token], skip_special_tokens=False)
        special = not tokenizer.decode([last_token], skip_special_tokens=True)
        return text[: -len(piece)] if special and piece and text.endswith(piece) else text

    def finish_reason(reason: str | None, made_calls: bool) -> str | None:
        return "tool_calls" if made_calls and reason == "stop" else r.FINISH_REASONS[reason]

    if request.stream:

        def chunk(choices, **extra):
            return r.envelope(
                "chat.completion.chunk", response_id, model, created, choices, **extra
            )

        streams: dict[int, t.ToolCallStream] = {}

        def chunks(snapshot: Snapshot):
            out = []
            for d in snapshot.deltas:
                if d.index not in streams:
                    streams[d.index] = t.ToolCallStream(calls.format)
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
                stream = streams[d.index]
                text = d.text
                if d.finish_reason is not None and d.token_ids:
                    text = without_end_token(text, d.token_ids[-1])
                delta = stream.feed(text, final=d.finish_reason is not None)
                if delta or d.finish_reason or d.token_ids:
                    out.append(
                        chunk(
                            [
                                {
                                    "index": d.index,
                                    "delta": delta,
                                    "logprobs": logprobs(d.token_ids, d.logprobs),
                                    "finish_reason": finish_reason(
                                        d.finish_reason, stream.num_calls > 0
                                    ),
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
    choices = []
    for o in out.outputs:
        text = without_end_token(o.text, o.token_ids[-1]) if o.token_ids else o.text
        message = {"role": "assistant", "content": text}
        extracted = t.extract(calls.format, text) if calls.format is not t.plain else None
        if extracted is not None and extracted.tool_calls:
            message = {
                "role": "assistant",
                "content": extracted.content,
                "tool_calls": extracted.tool_calls,
            }
        choices.append(
            {
                "index": o.index,
                "message": message,
                "logprobs": logprobs(o.token_ids, o.logprobs),
                "finish_reason": finish_reason(o.finish_reason, "tool_calls" in message),
                "stop_reason": o.stop_reason if o.finish_reason else None,
            }
        )
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


@dataclass(frozen=True)
class ToolCallsMode:
    """How a request's output is read for calls: the format, the guide that forces it (required,
    a named function), and whether special tokens stay in the text (None: as the request says)."""

    format: t.Format
    guide: dict | None = None
    skip_special_tokens: bool | None = None


def tool_calls_mode(request: ChatCompletionRequest, parser: str | None) -> ToolCallsMode:
    choice = request.tool_choice
    if choice is None:
        choice = "auto" if request.tools and parser is not None else "none"
    if choice == "none":
        return ToolCallsMode(t.plain)
    if choice == "auto":
        if parser is None:
            raise OpenAIError(
                400,
                'tool_choice "auto" needs a tool-call parser: start the front with '
                f"--tool-call-parser ({', '.join(t.PARSERS)}), or use tool_choice "
                '"required" or a named function (guided decoding)',
                "tool_choice",
            )
        return ToolCallsMode(
            t.PARSERS[parser], None, False if parser in t.KEEPS_SPECIAL_TOKENS else None
        )
    tools = [tool.model_dump(exclude_none=True) for tool in request.tools]
    if choice == "required":
        mode = ToolCallsMode(t.parse_required, {"json": t.required_schema(tools)})
    else:
        assert isinstance(choice, NamedToolChoice)
        tool = next(x for x in tools if x["function"]["name"] == choice.function.name)
        mode = ToolCallsMode(t.named(choice.function.name), {"json": t.named_schema(tool)})
    # The guide these tools make is bounded as a guide given directly is (guided_json).
    if len(json.dumps(mode.guide["json"])) > MAX_GUIDE_CHARS:
        raise OpenAIError(
            400,
            f"the tools' schemas make a guide longer than {MAX_GUIDE_CHARS} characters as JSON "
            f"(tool_choice {choice if isinstance(choice, str) else 'a named function'}): give "
            "smaller parameter schemas",
            "tools",
        )
    return mode
