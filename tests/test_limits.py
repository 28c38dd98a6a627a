"""Issue 8, items 4 and 10: every input has a bound, checked before work is done on it, and a
clear status when it is over; malformed or non-finite input is INVALID_ARGUMENT, never UNKNOWN,
INTERNAL or token 0 forever. Over real processes, at the router and at a worker called
directly (both run the same text front)."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
from reliability import record
from test_disagg import worker_state

from tandem.testing.cluster import LocalCluster, channel_to
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2

INVALID = grpc.StatusCode.INVALID_ARGUMENT
CONTEXT_LEN = 2048  # the tiny model's max_position_embeddings


# Bad requests sent and how many were refused with the right status (for `make reliability`).
TALLY = {"tried": 0, "handled": 0}


@pytest.fixture(scope="module")
def cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "320",
            "--block-size",
            "8",
        ],
    ) as c:
        yield c
    record(
        "over-limit, non-finite, malformed and mistyped requests (router and worker)",
        TALLY["tried"],
        TALLY["handled"],
        TALLY["tried"] - TALLY["handled"],
        "pytest tests/test_limits.py",
        "refused up front with INVALID_ARGUMENT or RESOURCE_EXHAUSTED; no block or lease left behind",
    )


@pytest.fixture(scope="module", params=["router", "worker"])
def target(request, cluster):
    """The router, and the prefill worker called directly (its own text front)."""
    return cluster.address if request.param == "router" else cluster.workers[0].address


@pytest.fixture(autouse=True)
def no_leaks(cluster):
    yield
    deadline = time.monotonic() + 10
    while True:
        states = [worker_state(w.address) for w in cluster.workers]
        if all(s.num_free_blocks == s.num_total_blocks and s.num_leases == 0 for s in states):
            break
        assert time.monotonic() < deadline, f"KV blocks or leases left behind: {states}"
        time.sleep(0.05)
    cluster.check_alive()


def request(prompt="a prompt", **params) -> llm_pb2.GenerateRequest:
    kind = (
        {"text": prompt}
        if isinstance(prompt, str)
        else {"token_ids": types_pb2.TokenIds(ids=prompt)}
    )
    params.setdefault("max_tokens", 4)
    return llm_pb2.GenerateRequest(
        prompt=types_pb2.Prompt(**kind), sampling_params=types_pb2.SamplingParams(**params)
    )


def generate(address: str, req, timeout: float = 30) -> list:
    with channel_to(address) as channel:  # a worker's: with the cluster's credentials
        return list(llm_pb2_grpc.AsyncLLMStub(channel).Generate(req, timeout=timeout))


def refused(address: str, req, timeout: float = 30) -> grpc.RpcError:
    started = time.monotonic()
    TALLY["tried"] += 1
    with pytest.raises(grpc.RpcError) as err:
        generate(address, req, timeout)
    err.value.elapsed = time.monotonic() - started
    if err.value.code() in (INVALID, grpc.StatusCode.RESOURCE_EXHAUSTED):
        TALLY["handled"] += 1
    return err.value


@pytest.mark.parametrize(
    "params, flag",
    [
        (dict(n=5000, temperature=1.0), "--max-n"),
        (dict(n=2, best_of=129, temperature=1.0), "--max-n"),
        (dict(stop=["x"] * 100_000), "--max-stop-strings"),
        (dict(stop=["y" * 2000]), "--max-stop-string-bytes"),
        (dict(stop_token_ids=list(range(5000))), "--max-stop-token-ids"),
        (dict(logprobs=21), "--max-logprobs"),
    ],
    ids=["n", "best_of", "stop_count", "stop_length", "stop_token_ids", "logprobs"],
)
def test_request_over_a_limit_is_refused_up_front(target, params, flag):
    err = refused(target, request(**params))
    assert err.code() == INVALID and flag in err.details(), err.details()
    assert err.elapsed < 2  # nothing was tokenized, leased or started


def test_n_5000_leaves_nothing_behind_and_n_at_the_limit_runs(cluster):
    err = refused(cluster.address, request(n=5000, temperature=1.0))
    assert err.code() == INVALID
    out = generate(
        cluster.address, request(n=128, temperature=1.0, max_tokens=2, ignore_eos=True), timeout=120
    )
    assert out[-1].finished and sorted(o.index for o in out[-1].outputs) == list(range(128))
    assert all(len(o.token_ids) == 2 for o in out[-1].outputs)


def test_prompt_text_over_the_byte_limit_is_refused_before_tokenizing(target):
    big = "many words in a long prompt " * 100_000  # 2.8 MB: seconds to tokenize
    err = refused(target, request(big))
    assert err.code() == INVALID and "--max-prompt-bytes" in err.details()
    assert err.elapsed < 1.5


def test_a_message_over_max_request_bytes_is_refused_by_grpc(target):
    err = refused(target, request("z" * (17 << 20)))
    assert err.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, err


def test_a_long_prompt_under_the_limit_does_not_stall_other_streams(cluster):
    """Tokenizing a ~1 MB prompt takes seconds of CPU: it runs off the event loop and without
    the GIL, so a stream in flight keeps its pace."""
    gaps = []
    steady = llm_pb2.GenerateRequest(
        prompt=types_pb2.Prompt(text="steady"),
        streaming=True,
        sampling_params=types_pb2.SamplingParams(max_tokens=1900, ignore_eos=True),
    )
    channel = grpc.insecure_channel(cluster.address)
    call = llm_pb2_grpc.AsyncLLMStub(channel).Generate(steady, timeout=120)

    def stream():
        last = time.monotonic()
        try:
            for _ in call:
                now = time.monotonic()
                gaps.append(now - last)
                last = now
        except grpc.RpcError as exc:
            assert exc.code() == grpc.StatusCode.CANCELLED

    thread = threading.Thread(target=stream)
    thread.start()
    while len(gaps) < 10:
        time.sleep(0.01)
    num_before = len(gaps)
    started = time.monotonic()
    long_prompt = "words words, more words. " * 40_000  # 1,000,000 bytes
    req = request(long_prompt, truncate_prompt_tokens=16)
    out = generate(cluster.address, req, timeout=120)
    tokenize_s = time.monotonic() - started
    call.cancel()
    thread.join(30)
    channel.close()
    assert out[-1].finished and len(out[0].prompt_token_ids) == 16
    # Had the tokenizer held the GIL, the stream would have stood still for all of tokenize_s.
    assert tokenize_s > 0.5 and len(gaps) > num_before + 10, (tokenize_s, len(gaps))
    assert max(gaps[num_before:]) < tokenize_s / 2, (max(gaps), tokenize_s)


@pytest.mark.parametrize(
    "field",
    [
        "temperature",
        "top_p",
        "min_p",
        "repetition_penalty",
        "presence_penalty",
        "frequency_penalty",
    ],
)
@pytest.mark.parametrize(
    "value", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"]
)
def test_non_finite_sampling_values_are_invalid(target, field, value):
    err = refused(target, request(**{field: value}))
    assert err.code() == INVALID and field in err.details()


def test_a_prompt_over_the_context_is_invalid_and_max_tokens_ends_at_the_context(target):
    err = refused(target, request([1] * CONTEXT_LEN))
    assert err.code() == INVALID and "context" in err.details()
    # max_tokens past the context is clipped to it, as TensorRT-LLM's PyTorch backend does.
    out = generate(target, request([1] * (CONTEXT_LEN - 4), max_tokens=10**9, ignore_eos=True))[-1]
    assert out.finished and out.outputs[0].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert len(out.outputs[0].token_ids) == 4


def test_unknown_request_type_is_invalid_everywhere(cluster):
    req = request()
    req.disaggregated_params.request_type = 7
    for address in [cluster.address] + [w.address for w in cluster.workers]:
        err = refused(address, req)
        assert err.code() == INVALID and "request_type 7" in err.details(), (address, err)


@pytest.mark.parametrize(
    "method, payload",
    [
        ("/tandem.v1.AsyncLLM/Generate", b"\xff\xff\xff\xff"),
        ("/tandem.v1.AsyncLLM/Abort", b"\x0a\xff"),
        ("/tandem.v1.AsyncLLM/GetKvCacheCapacity", b"\x0a"),
    ],
)
def test_malformed_protobuf_is_invalid_argument(cluster, method, payload):
    for address in [cluster.address] + [w.address for w in cluster.workers]:
        with channel_to(address) as channel:
            stream = method.endswith("Generate")
            call = (channel.unary_stream if stream else channel.unary_unary)(method)
            TALLY["tried"] += 1
            with pytest.raises(grpc.RpcError) as err:
                list(call(payload, timeout=10)) if stream else call(payload, timeout=10)
        TALLY["handled"] += err.value.code() == INVALID
        assert err.value.code() == INVALID, (address, method, err.value)
        assert "not a valid protobuf message" in err.value.details()


def test_a_finished_context_only_id_can_be_used_again(cluster, target):
    """The same id for the context phase again, and for the generation phase (TensorRT-LLM's
    disaggregated flow uses one id for both)."""
    for _ in range(2):
        req = request("reused id", max_tokens=4, ignore_eos=True)
        req.request_id = "reused-context-only-id"
        req.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_CONTEXT_ONLY
        handoff = generate(target, req)[-1].outputs[0].disaggregated_params
        assert handoff.opaque_state
        gen = request("reused id", max_tokens=4, ignore_eos=True)
        gen.request_id = req.request_id
        gen.disaggregated_params.CopyFrom(handoff)
        gen.disaggregated_params.request_type = types_pb2.REQUEST_TYPE_GENERATION_ONLY
        address = cluster.address if target == cluster.address else cluster.workers[1].address
        assert len(generate(address, gen)[-1].outputs[0].token_ids) >= 1
