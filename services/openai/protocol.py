"""The request bodies of the OpenAI API that the front accepts, validated by pydantic.

Fields OpenAI defines that tandem cannot honour are accepted at their defaults and refused
with a message naming them when set (`_refuse`). A few vLLM extensions that map directly onto
tandem's SamplingParams (top_k, min_p, repetition_penalty, ...) are accepted too. Fields neither
defines (agent frameworks send `parallel_tool_calls`, `store`, `reasoning_effort`, ...) are
accepted and ignored, as vLLM does, and the route logs their names (`ignored_fields`).
"""

from __future__ import annotations

import json
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

GUIDED_FIELDS = ("guided_json", "guided_regex", "guided_grammar", "guided_choice")
# Bounds on what a request may carry (OpenAI's own limits where it has one).
MAX_GUIDE_CHARS = 1 << 16
MAX_TOOLS = 128
# The tools' JSON (their schemas become a guide or part of the prompt).
MAX_TOOLS_JSON_CHARS = 1 << 18
MAX_MESSAGES = 4096


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    n: int = Field(1, ge=1, le=16)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, ge=0.0, le=1.0)
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # vLLM extensions.
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM's guided decoding extensions (one at most; not with response_format).
    guided_json: dict[str, Any] | None = None
    guided_regex: str | None = Field(None, max_length=MAX_GUIDE_CHARS)
    guided_grammar: str | None = Field(None, max_length=MAX_GUIDE_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=256)

    @property
    def ignored_fields(self) -> list[str]:
        """Fields of the body that neither OpenAI's API nor tandem defines (ignored)."""
        return sorted(self.model_extra or {})

    @model_validator(mode="after")
    def _refuse(self):
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by tandem")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed with stream=true")
        if self.guided_json is not None and len(json.dumps(self.guided_json)) > MAX_GUIDE_CHARS:
            raise ValueError(f"guided_json is longer than {MAX_GUIDE_CHARS} characters as JSON")
        if self.guided_choice is not None and sum(map(len, self.guided_choice)) > MAX_GUIDE_CHARS:
            raise ValueError(
                f"guided_choice's strings are longer than {MAX_GUIDE_CHARS} characters together"
            )
        given = [name for name in GUIDED_FIELDS if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give one guided decoding field at most, got {given}")
        return self

    @property
    def guide(self) -> dict[str, Any] | None:
        """GuidedDecodingParams' fields for the guide the request asks for (None: free text)."""
        if self.guided_json is not None:
            return {"json": self.guided_json}
        if self.guided_regex is not None:
            return {"regex": self.guided_regex}
        if self.guided_grammar is not None:
            return {"grammar": self.guided_grammar}
        if self.guided_choice is not None:
            return {"regex": "|".join(re.escape(choice) for choice in self.guided_choice)}
        return None


class CompletionRequest(_SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @model_validator(mode="after")
    def _refuse_completion_fields(self):
        if self.echo:
            raise ValueError("echo is not supported by tandem")
        if self.suffix:
            raise ValueError("suffix is not supported by tandem")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by tandem")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        return self

    @property
    def prompts(self) -> list[str | list[int]]:
        """The prompts, one per entry: a string, a list of strings, token ids or lists of token ids."""
        if isinstance(self.prompt, str) or all(isinstance(t, int) for t in self.prompt):
            return [self.prompt]
        return list(self.prompt)


class FunctionCall(BaseModel):
    name: str = Field(max_length=256)
    arguments: str = Field(max_length=1 << 20)


class ToolCall(BaseModel):
    """A call the assistant made, in a request's history."""

    model_config = ConfigDict(extra="allow")

    id: str = Field(max_length=256)
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: str
    content: str | list[dict[str, Any]] | None = None
    # An assistant message's calls, and the call a role "tool" message answers.
    tool_calls: list[ToolCall] | None = Field(None, max_length=MAX_TOOLS)
    tool_call_id: str | None = Field(None, max_length=256)

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates expect it: content as one string (text parts joined; an
        assistant message with only calls has ""), a call's arguments as the object they encode
        (templates write them with tojson), as vLLM hands them over."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):
            kinds = {part.get("type") for part in self.content}
            if kinds - {"text"}:
                raise ValueError(
                    f"only text content parts are supported, got {sorted(k for k in kinds if k)}"
                )
            message["content"] = "".join(part.get("text", "") for part in self.content)
        elif self.content is None:
            message["content"] = ""
        for call in message.get("tool_calls", []):
            try:
                call["function"]["arguments"] = json.loads(call["function"]["arguments"])
            except ValueError:
                pass  # not JSON: the template gets the text
        return message


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(BaseModel):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=20)
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)
    # None: "auto" when tools are given and the front has a --tool-call-parser, else "none".
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    response_format: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # vLLM's: extra arguments of the chat template (e.g. enable_thinking).
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _refuse_chat_fields(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        kind = (self.response_format or {}).get("type")
        if kind not in (None, "text", "json_object", "json_schema"):
            raise ValueError(
                f"response_format type {kind!r} is not supported: text, json_object or json_schema"
            )
        if kind == "json_schema" and not isinstance(
            (self.response_format.get("json_schema") or {}).get("schema"), dict
        ):
            raise ValueError("response_format json_schema needs json_schema.schema (an object)")
        if kind not in (None, "text") and any(getattr(self, f) is not None for f in GUIDED_FIELDS):
            raise ValueError(f"response_format and {GUIDED_FIELDS} are exclusive: give one")
        self._check_tool_choice()
        reserved = {"messages", "tools", "add_generation_prompt", "continue_final_message"}
        if self.chat_template_kwargs and reserved & set(self.chat_template_kwargs):
            raise ValueError(
                f"chat_template_kwargs may not set {sorted(reserved & set(self.chat_template_kwargs))}"
            )
        return self

    def _check_tool_choice(self) -> None:
        if self.tools and len(json.dumps(self.tools_for_template)) > MAX_TOOLS_JSON_CHARS:
            raise ValueError(f"tools are longer than {MAX_TOOLS_JSON_CHARS} characters as JSON")
        names = self.tool_names
        if len(set(names)) != len(names):
            raise ValueError(f"tools must have distinct function names, got {names}")
        choice = self.tool_choice
        if choice in (None, "none"):
            return
        if not self.tools:
            raise ValueError(f"tool_choice {self.forced_tool_choice_label} needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in self.tool_names:
            raise ValueError(
                f"tool_choice names the function {choice.function.name!r}, which is not in "
                f"tools: {self.tool_names}"
            )
        if choice != "auto" and (
            (self.response_format or {}).get("type") not in (None, "text")
            or any(getattr(self, f) is not None for f in GUIDED_FIELDS)
        ):
            raise ValueError(
                f"tool_choice {self.forced_tool_choice_label} is itself a guide: it cannot be "
                "combined with response_format or guided decoding fields"
            )

    @property
    def tool_names(self) -> list[str]:
        return [tool.function.name for tool in self.tools or []]

    @property
    def forced_tool_choice_label(self) -> str:
        choice = self.tool_choice
        return repr(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"

    @property
    def tools_for_template(self) -> list[dict[str, Any]] | None:
        return [t.model_dump(exclude_none=True) for t in self.tools] if self.tools else None

    @property
    def guide(self) -> dict[str, Any] | None:
        """GuidedDecodingParams' fields for response_format or vLLM's guided_* fields (None: free
        text). A forced tool_choice's guide is the route's (it knows the tools' schemas)."""
        extension = super().guide
        if extension is not None:
            return extension
        kind = (self.response_format or {}).get("type")
        if kind == "json_object":
            # OpenAI's json_object is an object; xgrammar's builtin JSON grammar (what tandem's
            # json_object is) takes any JSON value.
            return {"json": {"type": "object"}}
        if kind == "json_schema":
            return {"json": self.response_format["json_schema"]["schema"]}
        return None

    @property
    def max_new_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered with the model's template."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True

    @model_validator(mode="after")
    def _one_input(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    """vLLM's /detokenize."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    tokens: list[int] = Field(max_length=1 << 20)
