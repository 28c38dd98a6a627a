"""`tandem serve openai` as a real process in front of a real cluster, driven by the `openai`
package: completions and chat completions, streaming and not, against the gRPC client's own
results for the same requests; OpenAI-style errors; /v1/models, /health, /metrics."""

from __future__ import annotations

import contextlib
import subprocess
import sys
import time

import httpx
import openai
import pytest
from conftest import wait_all_blocks_free

from tandem.client import LLM, SamplingParams
from tandem.testing.cluster import LocalCluster, free_port

CONVERSATION = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Say hello to Paris"},
]


@contextlib.contextmanager
def openai_front(cluster, log_path, *flags: str, target: str | None = None, ready="/health"):
    """`tandem serve openai` in front of cluster's router (or target), once `ready` answers 200:
    (base URL, its process)."""
    port = free_port()
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tandem.cli.main",
                "serve",
                "openai",
                "--target",
                target or cluster.address,
                "--port",
                str(port),
                *flags,
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        base = f"http://127.0.0.1:{port}"
        try:
            deadline = time.monotonic() + 60
            while True:
                assert process.poll() is None, open(log_path).read()
                try:
                    if httpx.get(f"{base}{ready}", timeout=1).status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, open(log_path).read()
                time.sleep(0.1)
            yield base, process
        finally:
            process.terminate()
            process.wait(15)


@pytest.fixture(scope="module")
def front(model_dirs, tmp_path_factory):
    model_dir = model_dirs["llama"]
    with (
        LocalCluster(
            roles=["both"],
            engine_args=["--model", str(model_dir), "--num-blocks", "300", "--block-size", "8"],
        ) as cluster,
        openai_front(cluster, tmp_path_factory.mktemp("openai") / "front.log") as (base, _),
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="unused", max_retries=0, timeout=60)
        with LLM(cluster.address) as llm:
            yield base, client, llm, model_dir.name


def _greedy(llm, prompt, max_tokens, **kwargs):
    return llm.generate(
        prompt, SamplingParams(max_tokens=max_tokens, **kwargs), use_tqdm=False
    ).outputs[0]


def test_models_and_health(front):
    base, client, _, name = front
    assert [m.id for m in client.models.list().data] == [name]
    assert httpx.get(f"{base}/health").status_code == 200


def test_completions_equal_the_grpc_client(front):
    _, client, llm, name = front
    want = _greedy(llm, "The quick brown fox", 12, ignore_eos=True)
    got = client.completions.create(
        model=name,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"
    assert got.usage.completion_tokens == 12 and got.usage.prompt_tokens == len(
        llm.tokenizer.encode("The quick brown fox")
    )
    pieces, usage = [], None
    for chunk in client.completions.create(
        model=name,
        prompt="The quick brown fox",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    ):
        pieces += [c.text for c in chunk.choices]
        usage = chunk.usage or usage
    assert "".join(pieces) == want.text and usage.completion_tokens == 12
    # Two prompts (one as token ids) x n=2 seeded samples: four choices, indexed prompt-major.
    ids = llm.tokenizer.encode("Hello world")
    got = client.completions.create(
        model=name, prompt=[ids, ids], max_tokens=6, n=2, temperature=0.8, seed=3, logprobs=2
    )
    assert [c.index for c in got.choices] == [0, 1, 2, 3]
    assert got.choices[0].text == got.choices[2].text and got.choices[1].text == got.choices[3].text
    seeded = llm.generate(
        ids, SamplingParams(max_tokens=6, n=2, temperature=0.8, seed=3), use_tqdm=False
    )
    assert [c.text for c in got.choices[:2]] == [o.text for o in seeded.outputs]
    lp = got.choices[0].logprobs
    assert (
        len(lp.tokens)
        == len(lp.token_logprobs)
        == len(lp.top_logprobs)
        == len(seeded.outputs[0].token_ids)
    )
    # Keyed by token text: two ids that decode alike (partial UTF-8 bytes) share one key.
    assert all(
        1 <= len(top) <= 2 and value <= 0 for top, value in zip(lp.top_logprobs, lp.token_logprobs)
    )


def test_chat_completions_render_the_template(front):
    _, client, llm, name = front
    prompt = llm.tokenizer.apply_chat_template(CONVERSATION, add_generation_prompt=True)
    want = _greedy(llm, prompt, 10, add_special_tokens=False, ignore_eos=True)
    got = client.chat.completions.create(
        model=name,
        messages=CONVERSATION,
        max_tokens=10,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"ignore_eos": True},
    )
    assert (
        got.choices[0].message.role == "assistant" and got.choices[0].message.content == want.text
    )
    assert got.usage.prompt_tokens == len(llm.tokenizer.encode(prompt, add_special_tokens=False))
    content = got.choices[0].logprobs.content
    assert len(content) == 10 and all(len(c.top_logprobs) == 3 for c in content)
    assert "".join(c.token for c in content) == want.text
    roles, pieces, finish = [], [], None
    for chunk in client.chat.completions.create(
        model=name,
        messages=CONVERSATION,
        max_tokens=10,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    ):
        for c in chunk.choices:
            roles += [c.delta.role] if c.delta.role else []
            pieces.append(c.delta.content or "")
            finish = c.finish_reason or finish
    assert roles == ["assistant"] and "".join(pieces) == want.text and finish == "length"


def test_stop_strings_end_the_text(front):
    _, client, llm, name = front
    full = _greedy(llm, "Once upon a time", 16, ignore_eos=True).text
    stop = full[len(full) // 2 :][:3]
    got = client.completions.create(
        model=name,
        prompt="Once upon a time",
        max_tokens=16,
        temperature=0,
        stop=[stop],
        extra_body={"ignore_eos": True},
    )
    assert (
        got.choices[0].text == full[: full.index(stop)] and got.choices[0].finish_reason == "stop"
    )


def test_errors_are_openai_errors(front):
    base, client, _, name = front
    with pytest.raises(
        openai.BadRequestError
    ) as bad:  # the router's INVALID_ARGUMENT, its message kept
        client.completions.create(model=name, prompt=[10**6], max_tokens=4)
    assert bad.value.status_code == 400 and "vocab" in bad.value.message.lower()
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=name, prompt="x", max_tokens=4, temperature=5)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4", messages=CONVERSATION)
    with pytest.raises(openai.BadRequestError, match="logit_bias"):
        client.completions.create(model=name, prompt="x", logit_bias={"5": 1.0})
    reply = httpx.post(
        f"{base}/v1/completions", json={"model": name, "prompt": "x", "max_tokens": 0}
    )
    assert reply.status_code == 400 and reply.json()["error"]["type"] == "invalid_request_error"


def test_metrics_count_requests(front):
    base, client, _, name = front
    client.completions.create(model=name, prompt="count me", max_tokens=3, temperature=0)
    client.chat.completions.create(model=name, messages=CONVERSATION, max_tokens=2)
    assert (
        httpx.post(
            f"{base}/v1/completions", json={"model": name, "prompt": "x", "n": 0}
        ).status_code
        == 400
    )
    text = httpx.get(f"{base}/metrics").text
    ok = [
        line
        for line in text.splitlines()
        if line.startswith('tandem_openai_requests_total{endpoint="/v1/completions",status="200"}')
    ]
    assert ok and float(ok[0].split()[-1]) >= 1
    assert 'tandem_openai_requests_total{endpoint="/v1/completions",status="400"}' in text
    assert 'tandem_openai_request_duration_seconds_count{endpoint="/v1/chat/completions"}' in text
    generated = [
        line
        for line in text.splitlines()
        if line.startswith('tandem_openai_generation_tokens_total{endpoint="/v1/completions"}')
    ]
    assert generated and float(generated[0].split()[-1]) >= 3


def test_leaving_a_stream_aborts_the_request(front):
    _, client, llm, name = front
    stream = client.chat.completions.create(
        model=name,
        messages=CONVERSATION,
        max_tokens=1900,
        temperature=0,
        stream=True,
        extra_body={"ignore_eos": True},
    )
    next(iter(stream))
    stream.close()
    # 1,900 tokens take far longer than this: the blocks come back only because the request was aborted.
    caps = wait_all_blocks_free(llm, timeout=3)
    assert all(c["numFreeBlocks"] == c["maxNumBlocks"] for c in caps.values()), caps


def test_a_front_whose_router_is_down_is_alive_but_not_ready(tmp_path):
    """/ping (the chart's liveness) answers while the process does; /health (readiness) is 503
    while the router cannot be reached: Kubernetes takes the front out of its Service, and does
    not restart it."""
    nowhere = f"127.0.0.1:{free_port()}"
    with openai_front(None, tmp_path / "front.log", target=nowhere, ready="/ping") as (base, _):
        health = httpx.get(f"{base}/health", timeout=10)
    assert health.status_code == 503 and "router" in health.text
