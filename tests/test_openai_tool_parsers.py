"""The tool-call formats of the OpenAI front (tandem.openai.tools) on generated text: what a
finished output gives (message.tool_calls and content, as vLLM's hermes and llama3_json parsers
read them), and that a stream cut anywhere gives the same calls and content in OpenAI's deltas."""

from __future__ import annotations

import json

import pytest

from tandem.openai import tools as t

HERMES = (
    "Let me look. <tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris", "days": [1, 2], "note": "a}\\"b"}}\n'
    "</tool_call>\n"
    '<tool_call>{"arguments": {}, "name": "get_time"}</tool_call>'
)
LLAMA3 = (
    '<|python_tag|>{"name": "get_weather", "parameters": {"city": "Rome"}}; '
    '{"name": "get_time", "parameters": {"tz": "UTC"}}'
)
REQUIRED = '[{"name": "get_weather", "parameters": {"city": "Oslo"}}, {"name": "get_time", "parameters": {}}]'


def _calls(extracted: t.Extracted) -> list[tuple[str, dict]]:
    return [
        (c["function"]["name"], json.loads(c["function"]["arguments"]))
        for c in extracted.tool_calls
    ]


def _streamed(parse: t.Format, text: str, piece: int):
    """The stream's deltas for text cut into pieces of `piece` characters, put back together."""
    stream = t.ToolCallStream(parse)
    content, calls = "", {}
    for start in range(0, len(text), piece):
        delta = stream.feed(text[start : start + piece], final=start + piece >= len(text))
        content += delta.get("content", "")
        for call in delta.get("tool_calls", []):
            if call["index"] not in calls:
                # The first delta of a call has its id, type and name; the later ones none.
                assert call["index"] == len(calls)
                assert call["id"].startswith("call_") and call["type"] == "function"
                calls[call["index"]] = [call["function"]["name"], ""]
            else:
                assert set(call) == {"index", "function"} and set(call["function"]) == {"arguments"}
            calls[call["index"]][1] += call["function"]["arguments"]
    return content, [(name, json.loads(arguments)) for name, arguments in calls.values()]


def test_hermes_blocks_and_the_text_around_them():
    out = t.extract(t.parse_hermes, HERMES)
    assert _calls(out) == [
        ("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a}"b'}),
        ("get_time", {}),
    ]
    assert out.content == "Let me look. \n"
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in out.tool_calls)
    assert len({c["id"] for c in out.tool_calls}) == 2


def test_llama3_json_objects_after_the_python_tag_or_alone():
    out = t.extract(t.parse_llama3_json, LLAMA3)
    assert _calls(out) == [("get_weather", {"city": "Rome"}), ("get_time", {"tz": "UTC"})]
    assert out.content is None
    bare = t.extract(t.parse_llama3_json, ' {"name": "f", "arguments": {"x": 1}}')
    assert _calls(bare) == [("f", {"x": 1})]
    prose = t.extract(t.parse_llama3_json, "The weather is {sunny}.")
    assert prose.tool_calls == [] and prose.content == "The weather is {sunny}."


def test_required_array_and_named_arguments():
    assert _calls(t.extract(t.parse_required, REQUIRED)) == [
        ("get_weather", {"city": "Oslo"}),
        ("get_time", {}),
    ]
    named = t.extract(t.named("get_weather"), '{"city": "Lima"}')
    assert _calls(named) == [("get_weather", {"city": "Lima"})] and named.content is None


@pytest.mark.parametrize(
    "parse, text",
    [
        (t.parse_hermes, 'a <tool_call>{"name": "f", "arguments": {"x": '),  # cut by max_tokens
        (t.parse_hermes, "a <tool_call>not json</tool_call>"),
        (t.parse_hermes, '<tool_call>{"arguments": {}}</tool_call>'),  # no name
        (t.parse_llama3_json, '{"name": "f", "parameters": {"x": 1}} and more'),
        (t.parse_required, "[]"),
    ],
)
def test_what_does_not_parse_is_content_and_no_call(parse, text):
    out = t.extract(parse, text)
    assert out.tool_calls == [] and out.content == text


def test_plain_text_is_content():
    for parse in (t.parse_hermes, t.parse_llama3_json, t.plain):
        out = t.extract(parse, "Paris is sunny. <tool")
        assert out.tool_calls == [] and out.content == "Paris is sunny. <tool"


@pytest.mark.parametrize(
    "parse, text",
    [
        (t.parse_hermes, HERMES),
        (t.parse_llama3_json, LLAMA3),
        (t.parse_required, REQUIRED),
        (t.named("get_weather"), '{"city": "Lima", "when": {"day": 3}}'),
        (t.parse_hermes, "no calls here, only <tool talk"),
    ],
)
@pytest.mark.parametrize("piece", [1, 2, 3, 7, 1000])
def test_a_stream_cut_anywhere_gives_the_finished_calls_and_content(parse, text, piece):
    whole = t.extract(parse, text)
    content, calls = _streamed(parse, text, piece)
    assert calls == _calls(whole)
    assert (content or None) == whole.content


def test_a_call_streams_its_arguments_before_it_ends():
    stream = t.ToolCallStream(t.parse_hermes)
    first = stream.feed('<tool_call>{"name": "get_weather", "arguments": {"ci', final=False)
    assert first["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"ci'}
    assert "content" not in first
    nxt = stream.feed('ty": "Par', final=False)
    assert nxt["tool_calls"] == [{"index": 0, "function": {"arguments": 'ty": "Par'}}]
    # A text that may still become a marker is held back, then let go when it does not.
    plain = t.ToolCallStream(t.parse_hermes)
    assert plain.feed("hello <tool", final=False) == {"content": "hello "}
    assert plain.feed("s are fun", final=True) == {"content": "<tools are fun"}


def test_guides_of_required_and_named():
    tools = [
        {"type": "function", "function": {"name": "a", "parameters": {"type": "object"}}},
        {"type": "function", "function": {"name": "b"}},
    ]
    schema = t.required_schema(tools)
    assert schema["type"] == "array" and schema["minItems"] == 1
    assert [s["properties"]["name"]["enum"] for s in schema["items"]["anyOf"]] == [["a"], ["b"]]
    assert t.named_schema(tools[1]) == {"type": "object", "properties": {}}


@pytest.mark.parametrize(
    "parse, text",
    [
        (t.parse_hermes, '<tool_call>{"name": get_weather, "arguments": {}}</tool_call>'),
        (t.parse_hermes, '<tool_call>{"name": "f", "arguments": "\\q"}</tool_call>'),
        (t.parse_hermes, '<tool_call>{"na\\me": "f", "arguments": {}}</tool_call>'),
        (t.parse_llama3_json, '{"name": nul'),
    ],
)
def test_json_the_model_got_wrong_is_content_not_an_error(parse, text):
    """What the model wrote that is not JSON (an unquoted name, a bad escape, an answer cut in a
    literal) is its content, whole or streamed: never an error of the request."""
    out = t.extract(parse, text)
    assert out.tool_calls == [] and out.content == text
    for piece in (1, 3, 1000):  # streamed: no error either (a call announced by its name
        stream = t.ToolCallStream(parse)  # before its arguments went wrong stays announced)
        for start in range(0, len(text), piece):
            stream.feed(text[start : start + piece], final=start + piece >= len(text))


def test_guides_made_from_tools_or_choices_are_bounded_as_given_ones():
    from pydantic import ValidationError

    from tandem.openai.chat import tool_calls_mode
    from tandem.openai.errors import OpenAIError
    from tandem.openai.protocol import MAX_GUIDE_CHARS, ChatCompletionRequest

    big = {"type": "object", "properties": {f"p{i}": {"type": "string"} for i in range(4000)}}
    request = ChatCompletionRequest(
        model="m",
        messages=[{"role": "user", "content": "hi"}],
        tools=[{"type": "function", "function": {"name": "f", "parameters": big}}],
        tool_choice="required",
    )
    with pytest.raises(OpenAIError) as error:
        tool_calls_mode(request, None)
    assert "smaller parameter schemas" in str(error.value.message)
    with pytest.raises(ValidationError, match="guided_choice"):
        ChatCompletionRequest(
            model="m",
            messages=[{"role": "user", "content": "hi"}],
            guided_choice=["x" * (MAX_GUIDE_CHARS // 2 + 1)] * 2,
        )
