"""What a real stack needs of `tandem serve openai` (issue 34), driven by the `openai` package
against real processes: an API key, fields it does not know accepted, response_format through
guided decoding, stop_reason, the context length enforced, /v1/models/{id}, /tokenize,
/detokenize, /version, and a non-streaming request whose client left stops on the worker."""

from __future__ import annotations

import time

import httpx
import openai
import pytest
from test_disagg import worker_state
from test_openai import openai_front

from tandem.client import LLM, GuidedDecodingParams, SamplingParams
from tandem.testing.cluster import LocalCluster

API_KEY = "front-api-key"
CONTEXT = 2048  # the tiny model's max_position_embeddings


@pytest.fixture(scope="module")
def front(model_dirs, tmp_path_factory):
    model_dir = model_dirs["llama"]
    log_path = tmp_path_factory.mktemp("openai-front") / "front.log"
    with (
        LocalCluster(
            roles=["both"],
            engine_args=["--model", str(model_dir), "--num-blocks", "300", "--block-size", "8"],
        ) as cluster,
        openai_front(cluster, log_path, "--api-key", API_KEY) as (base, _),
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=60)
        with LLM(cluster.address) as llm:
            yield base, client, llm, model_dir.name, cluster, str(log_path)


def test_the_api_wants_the_key_and_the_probes_do_not(front):
    base, _, _, model, _, _ = front
    anonymous = openai.OpenAI(base_url=f"{base}/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as err:
        anonymous.completions.create(model=model, prompt="hi", max_tokens=2)
    assert err.value.status_code == 401 and "API key" in err.value.body["message"]
    assert httpx.post(f"{base}/tokenize", json={"prompt": "hi"}).status_code == 401
    assert httpx.get(f"{base}/health").status_code == 200
    assert httpx.get(f"{base}/version").json()["version"]


def test_fields_it_does_not_know_are_accepted_and_logged(front):
    _, client, _, model, _, log_path = front
    out = client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=3,
        extra_body={"parallel_tool_calls": False, "store": False, "reasoning_effort": "low"},
    )
    assert out.choices[0].message.content is not None
    text = open(log_path).read()
    assert "ignoring fields tandem does not know" in text and "reasoning_effort" in text


def test_response_format_runs_the_guide_the_grpc_client_would(front):
    _, client, llm, model, _, _ = front
    messages = [{"role": "user", "content": "give json"}]
    prompt = llm.tokenizer.apply_chat_template(messages, add_generation_prompt=True)
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    for response_format, guide in (
        ({"type": "json_object"}, GuidedDecodingParams(json={"type": "object"})),
        (
            {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
            GuidedDecodingParams(json=schema),
        ),
    ):
        out = client.chat.completions.create(
            model=model,
            messages=messages,
            max_tokens=24,
            temperature=0,
            response_format=response_format,
        )
        expected = llm.generate(
            prompt,
            SamplingParams(
                max_tokens=24, guided_decoding=guide, add_special_tokens=False, temperature=0
            ),
            use_tqdm=False,
        ).outputs[0]
        assert out.choices[0].message.content == expected.text, response_format
        assert expected.text.lstrip().startswith("{")
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(
            model=model, messages=messages, response_format={"type": "yaml"}
        )


def test_stop_reason_names_the_stop_string(front):
    _, client, _, model, _, _ = front
    free = client.completions.create(model=model, prompt="stop here", max_tokens=12, temperature=0)
    text = free.choices[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 2]
    assert stop.strip(), text
    out = client.completions.create(
        model=model, prompt="stop here", max_tokens=12, temperature=0, stop=[stop]
    )
    choice = out.choices[0]
    assert choice.finish_reason == "stop" and choice.stop_reason == stop
    assert free.choices[0].stop_reason is None


def test_max_tokens_past_the_context_is_refused_with_the_numbers(front):
    _, client, llm, model, _, _ = front
    num_prompt = len(llm.tokenizer.encode("too long"))
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model, prompt="too long", max_tokens=CONTEXT)
    message = err.value.body["message"]
    assert f"maximum context length is {CONTEXT}" in message
    assert f"{num_prompt} in the prompt, {CONTEXT} in the completion" in message


def test_models_tokenize_detokenize(front):
    base, client, llm, model, _, _ = front
    assert client.models.retrieve(model).id == model
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("no-such-model")
    headers = {"Authorization": f"Bearer {API_KEY}"}
    tokens = httpx.post(
        f"{base}/tokenize", json={"model": model, "prompt": "count me"}, headers=headers
    ).json()
    assert tokens["tokens"] == llm.tokenizer.encode("count me")
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == CONTEXT
    text = httpx.post(
        f"{base}/detokenize", json={"tokens": tokens["tokens"]}, headers=headers
    ).json()["prompt"]
    assert text == llm.tokenizer.decode(tokens["tokens"], skip_special_tokens=False)
    chat = httpx.post(
        f"{base}/tokenize",
        json={"messages": [{"role": "user", "content": "hi"}]},
        headers=headers,
    ).json()
    assert chat["tokens"] == llm.tokenizer.encode(
        llm.tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True
        ),
        add_special_tokens=False,
    )


def test_a_client_that_leaves_a_non_streaming_request_stops_it(front):
    base, _, _, model, cluster, _ = front
    worker = cluster.workers[0].address
    before = worker_state(worker).num_generated_tokens
    impatient = openai.OpenAI(base_url=f"{base}/v1", api_key=API_KEY, max_retries=0, timeout=1.0)
    with pytest.raises(openai.APITimeoutError):
        impatient.completions.create(
            model=model, prompt="go on", max_tokens=2000, extra_body={"ignore_eos": True}
        )
    deadline = time.monotonic() + 4  # its 2000 tokens take ~7 s on this CPU, longer under load
    while worker_state(worker).num_active_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    state = worker_state(worker)
    assert state.num_active_requests == 0, "the request ran on for nobody"
    assert state.num_generated_tokens - before < 2000, "it ran to its end"
