"""Tool calling through `tandem serve openai` (issue 34), driven by the `openai` package against
real processes serving SmolLM2-135M-Instruct: tool_choice "required" and a named function
through guided decoding, "auto" through --tool-call-parser hermes and llama3_json, streamed
deltas as OpenAI's, the tool messages of a conversation in the chat template, and the refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import openai
import pytest
from test_openai import openai_front

from tandem.client import LLM, GuidedDecodingParams, SamplingParams
from tandem.engine.checkpoints import default_model_dir
from tandem.openai import tools as t
from tandem.testing.cluster import LocalCluster

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}},
                "required": ["city"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The time in a time zone",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
MESSAGES = [{"role": "user", "content": "What is the weather in Paris?"}]
# The hermes answer a regex guide (vLLM's guided_regex) makes the model write, city of its choice.
HERMES_REGEX = (
    r'Let me check\. <tool_call>\n\{"name": "get_weather", "arguments": '
    r'\{"city": "(Paris|Rome|Oslo)"\}\}\n</tool_call>'
)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    default_model_dir()
    logs = tmp_path_factory.mktemp("openai-tools")
    with (
        LocalCluster(roles=["both"], engine_args=["--num-blocks", "256"]) as cluster,
        openai_front(cluster, logs / "plain.log") as (plain, _),
        openai_front(cluster, logs / "hermes.log", "--tool-call-parser", "hermes") as (hermes, _),
        openai_front(cluster, logs / "llama3.log", "--tool-call-parser", "llama3_json") as (
            llama3,
            _,
        ),
        LLM(cluster.address) as llm,
    ):
        clients = {
            name: openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=120)
            for name, base in (("plain", plain), ("hermes", hermes), ("llama3", llama3))
        }
        model = clients["plain"].models.list().data[0].id
        yield clients, model, llm


def _ask(client, model, stream=False, **kwargs):
    kwargs = {"messages": MESSAGES, "max_tokens": 80, "temperature": 0, **kwargs}
    if not stream:
        return client.chat.completions.create(model=model, **kwargs).choices[0]
    chunks = list(client.chat.completions.create(model=model, stream=True, **kwargs))
    return chunks


def _joined(chunks):
    """A stream's content, calls [(id, name, arguments)] and finish reason, put back together
    as an OpenAI client does; each call's first delta must carry its id and name."""
    content, calls, finish = "", {}, None
    for c in chunks:
        if not c.choices:
            continue
        delta = c.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in calls:
                assert call.id and call.id.startswith("call_") and call.type == "function"
                assert call.function.name
                calls[call.index] = [call.id, call.function.name, ""]
            else:
                assert call.id is None and call.function.name is None
            calls[call.index][2] += call.function.arguments or ""
        finish = c.choices[0].finish_reason or finish
    return content, [tuple(v) for v in calls.values()], finish


def _guided_text(llm, schema) -> str:
    prompt = llm.tokenizer.apply_chat_template(MESSAGES, tools=TOOLS, add_generation_prompt=True)
    params = SamplingParams(
        max_tokens=80,
        temperature=0,
        add_special_tokens=False,
        guided_decoding=GuidedDecodingParams(json=schema),
    )
    return llm.generate(prompt, params, use_tqdm=False).outputs[0].text


def test_required_calls_are_the_guided_output_parsed(served):
    clients, model, llm = served
    choice = _ask(clients["plain"], model, tools=TOOLS, tool_choice="required")
    # The same request through the gRPC client with vLLM's "required" schema: its JSON array.
    expected = json.loads(_guided_text(llm, t.required_schema(TOOLS)))
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    got = [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls]
    assert got == [(e["name"], e["parameters"]) for e in expected]
    assert all(name in ("get_weather", "get_time") for name, _ in got)
    assert all(c.id.startswith("call_") and c.type == "function" for c in choice.message.tool_calls)
    content, calls, finish = _joined(
        _ask(clients["plain"], model, stream=True, tools=TOOLS, tool_choice="required")
    )
    assert [(name, json.loads(arguments)) for _, name, arguments in calls] == got
    assert finish == "tool_calls" and content == ""


def test_a_named_function_is_called_with_arguments_of_its_schema(served):
    clients, model, llm = served
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = _ask(clients["plain"], model, tools=TOOLS, tool_choice=named)
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_time"
    arguments = json.loads(call.function.arguments)
    assert arguments == json.loads(_guided_text(llm, TOOLS[1]["function"]["parameters"]))
    assert arguments["zone"] in ("UTC", "CET")
    assert choice.finish_reason == "tool_calls"
    _, calls, finish = _joined(
        _ask(clients["plain"], model, stream=True, tools=TOOLS, tool_choice=named)
    )
    assert [(name, json.loads(a)) for _, name, a in calls] == [("get_time", arguments)]
    assert finish == "tool_calls"


def test_auto_with_hermes_reads_the_tool_call_blocks(served):
    clients, model, _ = served
    plain = _ask(clients["plain"], model, extra_body={"guided_regex": HERMES_REGEX})
    assert re.fullmatch(HERMES_REGEX, plain.message.content)  # the text the parser gets
    city = json.loads(plain.message.content.split("\n")[1])["arguments"]["city"]
    choice = _ask(clients["hermes"], model, tools=TOOLS, extra_body={"guided_regex": HERMES_REGEX})
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check. "
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        {"city": city},
    )
    chunks = _ask(
        clients["hermes"],
        model,
        stream=True,
        tools=TOOLS,
        tool_choice="auto",
        extra_body={"guided_regex": HERMES_REGEX},
    )
    content, calls, finish = _joined(chunks)
    assert content == "Let me check. " and finish == "tool_calls"
    assert [(name, json.loads(a)) for _, name, a in calls] == [("get_weather", {"city": city})]
    # The arguments came in several deltas, not in one at the end.
    assert sum(bool(c.choices and c.choices[0].delta.tool_calls) for c in chunks) > 3


def test_auto_with_llama3_json_reads_the_json_call(served):
    clients, model, _ = served
    schema = {
        "type": "object",
        "properties": {
            "name": {"type": "string", "enum": ["get_weather"]},
            "parameters": TOOLS[0]["function"]["parameters"],
        },
        "required": ["name", "parameters"],
        "additionalProperties": False,
    }
    response_format = {"type": "json_schema", "json_schema": {"name": "call", "schema": schema}}
    text = _ask(clients["plain"], model, response_format=response_format).message.content
    expected = json.loads(text)
    choice = _ask(clients["llama3"], model, tools=TOOLS, response_format=response_format)
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    assert (call.function.name, json.loads(call.function.arguments)) == (
        "get_weather",
        expected["parameters"],
    )
    content, calls, finish = _joined(
        _ask(clients["llama3"], model, stream=True, tools=TOOLS, response_format=response_format)
    )
    assert content == "" and finish == "tool_calls"
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", expected["parameters"])]


def test_auto_on_plain_text_is_content_and_none_leaves_calls_alone(served):
    clients, model, _ = served
    free = _ask(clients["plain"], model, max_tokens=12)
    for name in ("hermes", "llama3"):
        choice = _ask(clients[name], model, tools=TOOLS, max_tokens=12)
        assert choice.message.tool_calls is None and choice.finish_reason == "length"
    hermes_text = _ask(clients["hermes"], model, tools=TOOLS, tool_choice="none")
    assert hermes_text.message.tool_calls is None
    regexed = _ask(
        clients["hermes"],
        model,
        tools=TOOLS,
        tool_choice="none",
        extra_body={"guided_regex": HERMES_REGEX},
    )
    assert regexed.message.tool_calls is None and "<tool_call>" in regexed.message.content
    assert free.message.content  # the same prompt without tools answers in text


def test_tool_messages_reach_the_chat_template(served):
    clients, model, llm = served
    history = [
        *MESSAGES,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
    ]
    choice = clients["plain"].chat.completions.create(
        model=model, messages=history, tools=TOOLS, max_tokens=4, temperature=0
    )
    # SmolLM2's template writes each message's content: the tool's answer is in the prompt, the
    # assistant's call-only message renders with empty content.
    rendered = llm.tokenizer.apply_chat_template(
        [
            MESSAGES[0],
            {"role": "assistant", "content": "", "tool_calls": history[1]["tool_calls"]},
            {"role": "tool", "tool_call_id": "call_1", "content": "22 degrees and sunny"},
        ],
        tools=TOOLS,
        add_generation_prompt=True,
    )
    assert "<|im_start|>tool\n22 degrees and sunny<|im_end|>" in rendered
    ids = llm.tokenizer.encode(rendered, add_special_tokens=False)
    out = (
        clients["plain"]
        .chat.completions.with_raw_response.create(
            model=model, messages=history, tools=TOOLS, max_tokens=4, temperature=0
        )
        .parse()
    )
    assert out.usage.prompt_tokens == len(ids) == choice.usage.prompt_tokens


def test_refusals_name_what_to_fix(served):
    clients, model, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        _ask(
            clients["plain"],
            model,
            tools=TOOLS,
            tool_choice={"type": "function", "function": {"name": "book_flight"}},
        )
    assert "'book_flight', which is not in tools" in err.value.body["message"]
    assert "get_weather" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["plain"], model, tools=TOOLS, tool_choice="auto")
    assert "--tool-call-parser" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["plain"], model, tool_choice="required")
    assert "needs tools" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(
            clients["plain"],
            model,
            tools=TOOLS,
            tool_choice="required",
            response_format={"type": "json_object"},
        )
    assert "cannot be combined" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["plain"], model, tools=[{"type": "function", "function": {"name": "a b"}}])
    assert "tools.0.function.name" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["plain"], model, tools=[TOOLS[0], TOOLS[0]], tool_choice="required")
    assert "distinct function names" in err.value.body["message"]
    with pytest.raises(openai.BadRequestError) as err:
        _ask(clients["plain"], model, tools=TOOLS * 65)
    assert "at most 128" in err.value.body["message"]


def test_an_unknown_parser_is_refused_at_start_with_the_list():
    done = subprocess.run(
        [sys.executable, "-m", "tandem.cli.main", "serve", "openai", "--tool-call-parser", "nope"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2
    assert "invalid choice: 'nope'" in done.stderr
    assert "'hermes'" in done.stderr and "'llama3_json'" in done.stderr
