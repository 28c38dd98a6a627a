"""Tool calls in generated text: the formats the front reads them in, and the OpenAI shapes
(a message's `tool_calls`, a stream's tool_calls deltas) it gives them.

A format is a function `parse(text, final) -> Parsed` over the text generated so far. What it
returns only grows as the text grows (text that may still turn into a call is held back until
it is known), so a stream is the difference between two parses (`ToolCallStream`) and a whole
answer one parse at the end (`extract`). The formats:

- `hermes` (vLLM's Hermes2ProToolParser): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
  blocks anywhere in the text; the text outside them is the content.
- `llama3_json` (vLLM's Llama3JsonToolParser): the output is one or more JSON objects
  `{"name": ..., "parameters": {...}}` (or "arguments") separated by `;`, possibly after
  `<|python_tag|>`; an output that starts otherwise is plain content.
- tool_choice "required": the JSON array of `{"name", "parameters"}` objects that the guide
  `required_schema` forces; a named tool_choice: the whole output is the arguments, which the
  guide `named_schema` forces.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field


@dataclass
class ParsedCall:
    name: str | None  # None until the name's string is complete
    raw_arguments: str  # the arguments' JSON text so far, as generated
    complete: bool = False

    @property
    def arguments(self) -> str:
        """The arguments as OpenAI gives them: JSON text of the object. A model that wrote them as
        a JSON string (of JSON) gets that string decoded; none written is `{}`."""
        raw = self.raw_arguments.strip()
        if not raw:
            return "{}" if self.complete else ""
        if raw.startswith('"'):
            return json.loads(raw) if self.complete else ""
        return raw


@dataclass
class Parsed:
    content: str
    calls: list[ParsedCall] = field(default_factory=list)
    # False: text that the format says is a call is not one (e.g. not JSON).
    valid: bool = True


# parse(text, final, scans=None): scans is the stream's memory of its scans (_value_end).
Format = Callable[..., Parsed]


class _Incomplete(Exception):
    """The text ends inside the value being scanned."""


class _Invalid(Exception):
    """The text is not what the format says."""


def _loads(text: str):
    """A JSON value the model wrote; what is not JSON (an unquoted name, a bad escape) makes the
    text not a call (its text stays content), never an error of the request."""
    try:
        return json.loads(text)
    except ValueError:
        raise _Invalid from None


_WHITESPACE = " \t\r\n"


def _skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WHITESPACE:
        i += 1
    return i


# A stream parses its text again at each token: the scans jump with regular expressions (C)
# rather than walk characters in Python.
_STRING_TAIL = re.compile(r'[^"\\]*(?:\\.[^"\\]*)*"', re.DOTALL)
_STRUCTURAL = re.compile(r'["{}\[\]]')


def _string_end(text: str, i: int) -> int:
    """The index after the JSON string starting at text[i] == '"'."""
    match = _STRING_TAIL.match(text, i + 1)
    if match is None:
        raise _Incomplete
    return match.end()


def _value_end(text: str, i: int, final: bool, scans: dict | None = None) -> int:
    """The index after the JSON value starting at text[i] (its extent only: json.loads checks it).
    scans: where earlier scans of a longer and longer text stopped inside a container value
    (start -> (depth, position)), so that a stream scans each character once."""
    if text[i] == '"':
        return _string_end(text, i)
    if text[i] in "{[":
        depth, j = scans.get(i, (0, i)) if scans is not None else (0, i)
        while True:
            match = _STRUCTURAL.search(text, j)
            if match is None:
                if scans is not None:
                    scans[i] = (depth, len(text))
                raise _Incomplete
            j = match.start()
            if match.group() == '"':
                try:
                    j = _string_end(text, j)
                except _Incomplete:
                    if scans is not None:
                        scans[i] = (depth, j)
                    raise
                continue
            depth += 1 if match.group() in "{[" else -1
            if depth == 0:
                return j + 1
            j += 1
    j = i
    while j < len(text) and text[j] not in ",}]" + _WHITESPACE:
        j += 1
    if j == i:
        raise _Invalid
    if j == len(text) and not final:
        raise _Incomplete  # a number or literal may go on
    return j


def _scan_call(
    text: str, i: int, final: bool, argument_keys: tuple[str, ...], scans: dict | None
) -> tuple[ParsedCall, int | None]:
    """The call object starting at text[i] == '{' and the index after it (None: not ended yet)."""
    call = ParsedCall(None, "")
    j = i + 1
    while True:
        j = _skip_ws(text, j)
        if j == len(text):
            return call, None
        if text[j] == "}":
            call.complete = call.name is not None
            if not call.complete:
                raise _Invalid
            return call, j + 1
        if text[j] == ",":
            j += 1
            continue
        if text[j] != '"':
            raise _Invalid
        try:
            key_end = _string_end(text, j)
        except _Incomplete:
            return call, None
        key = _loads(text[j:key_end])
        j = _skip_ws(text, key_end)
        if j == len(text):
            return call, None
        if text[j] != ":":
            raise _Invalid
        j = _skip_ws(text, j + 1)
        if j == len(text):
            return call, None
        try:
            end = _value_end(text, j, final, scans)
        except _Incomplete:
            if key in argument_keys:
                call.raw_arguments = text[j:]
            return call, None
        if key == "name":
            name = _loads(text[j:end])
            if not isinstance(name, str):
                raise _Invalid
            call.name = name
        elif key in argument_keys:
            call.raw_arguments = text[j:end]
            if call.raw_arguments.startswith('"'):
                _loads(call.raw_arguments)  # a string of JSON: it must be a JSON string
        j = end


def _held_back(text: str, marker: str) -> int:
    """How many characters at the end of text could be the start of marker."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


HERMES_START, HERMES_END = "<tool_call>", "</tool_call>"


def parse_hermes(text: str, final: bool, scans: dict | None = None) -> Parsed:
    content: list[str] = []
    calls: list[ParsedCall] = []
    pos = 0
    while True:
        start = text.find(HERMES_START, pos)
        if start < 0:
            tail = text[pos:]
            content.append(tail if final else tail[: len(tail) - _held_back(tail, HERMES_START)])
            return Parsed("".join(content), calls)
        content.append(text[pos:start])
        try:
            j = _skip_ws(text, start + len(HERMES_START))
            if j == len(text):
                return Parsed("".join(content), calls)
            if text[j] != "{":
                raise _Invalid
            call, end = _scan_call(text, j, final, ("arguments", "parameters"), scans)
            calls.append(call)
            if end is None:
                return Parsed("".join(content), calls)
            j = _skip_ws(text, end)
            if text.startswith(HERMES_END, j):
                pos = j + len(HERMES_END)
                continue
            if j == len(text) or (not final and HERMES_END.startswith(text[j:])):
                return Parsed("".join(content), calls)
            raise _Invalid
        except _Invalid:
            # What follows is content, as it came; the calls before it stand.
            return Parsed("".join(content) + text[start:], calls, valid=False)


PYTHON_TAG = "<|python_tag|>"


def parse_llama3_json(text: str, final: bool, scans: dict | None = None) -> Parsed:
    stripped = text.lstrip()
    if not final and PYTHON_TAG.startswith(stripped):
        return Parsed("")
    if not (stripped.startswith(PYTHON_TAG) or stripped.startswith("{")):
        return Parsed(text)
    offset = len(text) - len(stripped)
    j = offset + (len(PYTHON_TAG) if stripped.startswith(PYTHON_TAG) else 0)
    return _json_call_sequence(text, j, final, ";", None, scans)


def parse_required(text: str, final: bool, scans: dict | None = None) -> Parsed:
    j = _skip_ws(text, 0)
    if j == len(text):
        return Parsed("")
    if text[j] != "[":
        return Parsed(text, valid=False)
    return _json_call_sequence(text, j + 1, final, ",", "]", scans)


def _json_call_sequence(
    text: str, j: int, final: bool, separator: str, closing: str | None, scans: dict | None
) -> Parsed:
    calls: list[ParsedCall] = []
    try:
        while True:
            j = _skip_ws(text, j)
            if j == len(text):
                return Parsed("", calls)
            if closing is not None and text[j] == closing and not calls:
                raise _Invalid  # an empty list of calls
            if text[j] != "{":
                raise _Invalid
            call, end = _scan_call(text, j, final, ("parameters", "arguments"), scans)
            calls.append(call)
            if end is None:
                return Parsed("", calls)
            j = _skip_ws(text, end)
            if j == len(text):
                return Parsed("", calls)
            if text[j] == separator:
                j += 1
                continue
            if closing is not None and text[j] == closing and not text[j + 1 :].strip():
                return Parsed("", calls)
            raise _Invalid
    except _Invalid:
        return Parsed(text, [], valid=False)


def plain(text: str, final: bool, scans: dict | None = None) -> Parsed:
    """No calls: all text is content."""
    return Parsed(text)


def named(name: str) -> Format:
    """tool_choice naming a function: the whole output is its arguments."""

    def parse(text: str, final: bool, scans: dict | None = None) -> Parsed:
        return Parsed("", [ParsedCall(name, text.lstrip(), complete=final)])

    return parse


# --tool-call-parser's choices (tool_choice "auto").
PARSERS: dict[str, Format] = {"hermes": parse_hermes, "llama3_json": parse_llama3_json}
# Parsers whose markers are special tokens in their models' vocabularies (Hermes and Qwen's
# <tool_call>): the text is detokenized with them, as vLLM's parser asks.
KEEPS_SPECIAL_TOKENS = {"hermes"}


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _function_call(call: ParsedCall) -> dict:
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": call.name, "arguments": call.arguments},
    }


@dataclass
class Extracted:
    content: str | None
    tool_calls: list[dict]


def extract(parse: Format, text: str) -> Extracted:
    """A finished output's calls and content. An output whose calls do not parse (not JSON, cut
    off by max_tokens) is all content and no call, as vLLM answers it."""
    parsed = parse(text, True)
    calls_ok = parsed.valid and all(c.complete and _is_json(c.arguments) for c in parsed.calls)
    if not (calls_ok and parsed.calls):
        return Extracted(text or None, [])
    content = parsed.content if parsed.content.strip() else None
    return Extracted(content, [_function_call(c) for c in parsed.calls])


def _is_json(text: str) -> bool:
    try:
        json.loads(text)
    except ValueError:
        return False
    return True


class ToolCallStream:
    """One choice's stream: text deltas in, OpenAI delta fields out (content and tool_calls, the
    id, type and name in a call's first delta, its arguments in pieces after)."""

    def __init__(self, parse: Format):
        self.parse = parse
        self.scans: dict = {}
        self.text = ""
        self.num_content_sent = 0
        self.arguments_sent: list[str] = []

    @property
    def num_calls(self) -> int:
        return len(self.arguments_sent)

    def feed(self, text: str, final: bool) -> dict:
        self.text += text
        parsed = self.parse(self.text, final, self.scans)
        delta: dict = {}
        if len(parsed.content) > self.num_content_sent:
            delta["content"] = parsed.content[self.num_content_sent :]
            self.num_content_sent = len(parsed.content)
        tool_calls = []
        for index, call in enumerate(parsed.calls):
            if call.name is None:
                break  # a call is announced by its name, and in order
            arguments = call.arguments
            if index == len(self.arguments_sent):
                self.arguments_sent.append(arguments)
                tool_calls.append(
                    {
                        "index": index,
                        "id": new_call_id(),
                        "type": "function",
                        "function": {"name": call.name, "arguments": arguments},
                    }
                )
            elif arguments.startswith(self.arguments_sent[index]) and len(arguments) > len(
                self.arguments_sent[index]
            ):
                piece = arguments[len(self.arguments_sent[index]) :]
                self.arguments_sent[index] = arguments
                tool_calls.append({"index": index, "function": {"arguments": piece}})
        if tool_calls:
            delta["tool_calls"] = tool_calls
        return delta


def required_schema(tools: list[dict]) -> dict:
    """The guide of tool_choice "required" (vLLM's): a non-empty array of calls of the tools."""
    return {
        "type": "array",
        "minItems": 1,
        "items": {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [tool["function"]["name"]]},
                        "parameters": _parameters(tool),
                    },
                    "required": ["name", "parameters"],
                }
                for tool in tools
            ]
        },
    }


def named_schema(tool: dict) -> dict:
    """The guide of a named tool_choice: the function's parameters."""
    return _parameters(tool)


def _parameters(tool: dict) -> dict:
    return tool["function"].get("parameters") or {"type": "object", "properties": {}}
