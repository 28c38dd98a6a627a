"""`tandem serve openai` in front of the tiny Llama (issue 34), driven by the `openai` package
against real processes: LoRA adapters listed in /v1/models and chosen by `model` (vLLM's
--lora-modules), an unknown model's 404, /v1/embeddings refused on a decoder, and SIGTERM: the
front stops accepting, lets what is in flight finish within --shutdown-timeout, then exits."""

from __future__ import annotations

import signal
import subprocess
import sys
import threading
import time

import httpx
import openai
import pytest
from lora_adapters import write_adapter
from test_disagg import worker_state
from test_openai import openai_front

from tandem.client import LLM, LoRARequest, SamplingParams
from tandem.testing.cluster import LocalCluster

PROMPT = [1, 57, 12, 230, 9, 41, 77, 3, 150, 18, 66, 201, 5]


@pytest.fixture(scope="module")
def served(model_dirs, tmp_path_factory):
    model_dir = model_dirs["llama"]
    root = tmp_path_factory.mktemp("openai-models")
    adapters = {
        f"adapter-{i}": str(write_adapter(model_dir, root / f"a{i}", seed=i, rank=4, std=0.2))
        for i in (1, 2)
    }
    specs = [f"{name}={path}" for name, path in adapters.items()]
    with (
        LocalCluster(
            roles=["both"],
            engine_args=["--model", str(model_dir), "--num-blocks", "300", "--block-size", "8"],
        ) as cluster,
        openai_front(cluster, root / "front.log", "--lora-modules", *specs) as (base, _),
        LLM(cluster.address) as llm,
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)
        yield cluster, client, llm, model_dir.name, adapters, root


def test_adapters_are_listed_with_their_parent(served):
    _, client, _, model, adapters, _ = served
    cards = {m.id: m for m in client.models.list().data}
    assert list(cards) == [model, *adapters]
    assert cards[model].parent is None
    for name, path in adapters.items():
        assert cards[name].parent == model and cards[name].root == path
        assert client.models.retrieve(name).parent == model


def test_model_chooses_the_adapter(served):
    _, client, llm, model, adapters, _ = served
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    outputs = {}
    for number, name in enumerate([None, *adapters]):
        lora = None if name is None else LoRARequest(name, number, adapters[name])
        expected = llm.generate(PROMPT, params, lora_request=lora, use_tqdm=False).outputs[0]
        got = client.completions.create(
            model=name or model,
            prompt=PROMPT,
            max_tokens=8,
            temperature=0,
            extra_body={"ignore_eos": True},
        ).choices[0]
        assert got.text == expected.text, name
        outputs[name] = expected.token_ids
    assert len({tuple(ids) for ids in outputs.values()}) == 3  # each adapter changes the output
    chat = client.chat.completions.create(
        model="adapter-2",
        messages=[{"role": "user", "content": "hi"}],
        max_tokens=6,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    prompt = llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], add_generation_prompt=True
    )
    expected = llm.generate(
        prompt,
        SamplingParams(max_tokens=6, ignore_eos=True, add_special_tokens=False),
        lora_request=LoRARequest("adapter-2", 2, adapters["adapter-2"]),
        use_tqdm=False,
    )
    assert chat.choices[0].message.content == expected.outputs[0].text


def test_an_unknown_model_is_vllms_404(served):
    _, client, _, _, _, _ = served
    for call in (
        lambda: client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2),
        lambda: client.chat.completions.create(
            model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ),
        lambda: client.models.retrieve("gpt-4o"),
    ):
        with pytest.raises(openai.NotFoundError) as err:
            call()
        assert err.value.body["message"].startswith("The model `gpt-4o` does not exist.")


def test_embeddings_on_a_decoder_say_so(served):
    _, client, _, model, _, _ = served
    with pytest.raises(openai.BadRequestError) as err:
        client.embeddings.create(model=model, input="hi")
    assert "does not support the embeddings API" in err.value.body["message"]


def test_bad_lora_modules_are_refused_at_start():
    for spec, message in (("no-path", "write name=path"), ('{"name": "a"}', "'path'")):
        done = subprocess.run(
            [sys.executable, "-m", "tandem.cli.main", "serve", "openai", "--lora-modules", spec],
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert done.returncode != 0 and message in done.stderr, done.stderr


def _whole_in_thread(base: str, model: str, max_tokens: int) -> dict:
    """A non-streaming completion run in a thread: its answer or its error."""
    state = {"answer": None, "error": None}

    def run():
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)
        try:
            state["answer"] = client.completions.create(
                model=model,
                prompt="on and on",
                max_tokens=max_tokens,
                extra_body={"ignore_eos": True},
            )
        except Exception as exc:  # noqa: BLE001 - handed to the test
            state["error"] = exc

    state["thread"] = threading.Thread(target=run, daemon=True)
    state["thread"].start()
    return state


def _stream_in_thread(base: str, model: str, max_tokens: int) -> dict:
    """A streaming completion run in a thread: its token count, its end and its error."""
    state = {"num_tokens": None, "finish_reason": None, "error": None, "first": threading.Event()}

    def run():
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)
        try:
            for chunk in client.completions.create(
                model=model,
                prompt="go on",
                max_tokens=max_tokens,
                stream=True,
                stream_options={"include_usage": True},
                extra_body={"ignore_eos": True},
            ):
                state["first"].set()
                if chunk.usage is not None:
                    state["num_tokens"] = chunk.usage.completion_tokens
                if chunk.choices:
                    state["finish_reason"] = (
                        chunk.choices[0].finish_reason or state["finish_reason"]
                    )
        except Exception as exc:  # noqa: BLE001 - handed to the test
            state["error"] = exc
        finally:
            state["first"].set()

    state["thread"] = threading.Thread(target=run, daemon=True)
    state["thread"].start()
    return state


def _refused(base: str) -> bool:
    try:
        httpx.get(f"{base}/health", timeout=1)
    except httpx.TransportError:
        return True
    return False


def test_sigterm_lets_what_is_in_flight_finish_and_refuses_the_rest(served):
    cluster, _, _, model, _, root = served
    with openai_front(cluster, root / "drain.log", "--shutdown-timeout", "30") as (base, process):
        state = _stream_in_thread(base, model, 400)
        assert state["first"].wait(30) and state["error"] is None
        process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + 3
        while not _refused(base):
            assert time.monotonic() < deadline, "the front still accepts after SIGTERM"
            time.sleep(0.05)
        assert process.poll() is None, "it left before its request finished"
        state["thread"].join(60)
        assert state["error"] is None and state["finish_reason"] == "length"
        assert state["num_tokens"] == 400  # every token came
        # Drained, uvicorn re-raises the signal it caught: the exit status says SIGTERM.
        assert process.wait(15) == -signal.SIGTERM
        assert "Finished server process" in (root / "drain.log").read_text()


def test_sigterm_cuts_what_runs_past_the_bound(served):
    cluster, _, _, model, _, root = served
    worker = cluster.workers[0].address
    before = worker_state(worker).num_generated_tokens
    port_log = root / "bound.log"
    with openai_front(cluster, port_log, "--shutdown-timeout", "1") as (base, process):
        state = _stream_in_thread(base, model, 2000)  # ~7 s of tokens on this CPU
        whole = _whole_in_thread(base, model, 2000)
        assert state["first"].wait(30) and state["error"] is None
        deadline = time.monotonic() + 10
        while worker_state(worker).num_active_requests < 2:
            assert time.monotonic() < deadline, "the non-streaming request never started"
            time.sleep(0.05)
        started = time.monotonic()
        process.send_signal(signal.SIGTERM)
        process.wait(15)
        elapsed = time.monotonic() - started
        assert elapsed < 6, f"exited {elapsed:.1f} s after SIGTERM with a 1 s bound"
        state["thread"].join(15)
        whole["thread"].join(15)
        assert state["finish_reason"] != "length"  # cut, not finished
        assert whole["answer"] is None and whole["error"] is not None
    deadline = time.monotonic() + 5
    while worker_state(worker).num_active_requests and time.monotonic() < deadline:
        time.sleep(0.1)
    state_after = worker_state(worker)
    assert state_after.num_active_requests == 0, "the request ran on for nobody"
    assert state_after.num_generated_tokens - before < 2000  # neither ran to its end
    assert "timeout graceful shutdown exceeded" in port_log.read_text()
