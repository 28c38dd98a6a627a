"""Prometheus metrics, scraped from a live cluster (router + prefill + decode, real processes) after
a known workload: every count equals what was sent and what the clients got back, the histograms
hold one observation per request, lease endings and KV bytes match what the workers report over
gRPC, and failed calls count under their status code."""

from __future__ import annotations

import asyncio
import collections
import time
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families
from test_disagg import worker_state

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.common.metrics import ProcessMetrics
from tandem.testing.cluster import LocalCluster, free_port

Samples = dict[tuple[str, frozenset], float]


@pytest.fixture(scope="module")
def cluster(model_dirs):
    engine_args = ["--model", str(model_dirs["llama"]), "--num-blocks", "128", "--block-size", "8"]
    with LocalCluster(roles=["prefill", "decode"], engine_args=engine_args) as c:
        yield c


def scrape(service) -> Samples:
    text = (
        urllib.request.urlopen(f"http://{service.metrics_address}/metrics", timeout=10)
        .read()
        .decode()
    )
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: Samples, name: str, **labels) -> float:
    """The sum over the series of `name` whose labels include `labels`."""
    want = set(labels.items())
    return sum(v for (n, ls), v in samples.items() if n == name and want <= ls)


class Scrapes:
    """Each process's samples before the test, and what changed since."""

    def __init__(self, cluster):
        self.services = {s.role: s for s in cluster.services}
        self.before = {role: scrape(s) for role, s in self.services.items()}

    def now(self, role: str) -> Samples:
        return scrape(self.services[role])

    def delta(self, role: str, name: str, **labels) -> float:
        return value(self.now(role), name, **labels) - value(self.before[role], name, **labels)


def wait_for(predicate, timeout: float = 10.0):
    deadline = time.monotonic() + timeout
    while not (result := predicate()) and time.monotonic() < deadline:
        time.sleep(0.05)
    return result


def test_every_process_serves_its_role_and_id(cluster):
    for s in cluster.services:
        samples = scrape(s)
        handled = [dict(ls) for (n, ls) in samples if n == "tandem:grpc_server_handled_total"]
        assert handled and all(h["role"] == s.role and h["worker_id"] == s.address for h in handled)
        assert value(samples, "process_resident_memory_bytes") > 0
    for w in cluster.workers:
        samples = scrape(w)
        (labels,) = [dict(ls) for (n, ls) in samples if n == "tandem:kv_cache_usage_perc"]
        assert labels == {"model_name": "tiny-llama-v2", "role": w.role, "worker_id": w.address}


def test_a_known_workload_is_counted_on_every_process(cluster):
    scrapes = Scrapes(cluster)
    prefill, decode = cluster.workers
    state_before = {w.role: worker_state(w.address) for w in (prefill, decode)}
    outputs = []
    with LLM(cluster.address) as llm:

        def run(prompt: str, **params):
            out = llm.generate(prompt, SamplingParams(ignore_eos=True, **params), use_tqdm=False)
            outputs.append(out)
            return out.outputs[0]

        shared = "metrics count the tokens of a prompt that comes back twice"
        greedy = run(shared, max_tokens=8)
        # A stop token: the first of the greedy tokens (after the first) not seen before it.
        stop_at = next(i for i in range(1, 8) if greedy.token_ids[i] not in greedy.token_ids[:i])
        stopped = run(shared, max_tokens=8, stop_token_ids=[greedy.token_ids[stop_at]])
        run("one token: done in the context phase", max_tokens=1)
        run("a short one", max_tokens=3)

        async def streamed():
            async with AsyncLLM(cluster.address) as allm:
                async for out in allm.generate_async(
                    "and one streamed",
                    SamplingParams(max_tokens=6, ignore_eos=True),
                    streaming=True,
                ):
                    pass
                return out

        outputs.append(asyncio.run(streamed()))
    # The stop token is generated (and counted) but not returned (TensorRT-LLM trims it from token_ids).
    assert stopped.finish_reason == "stop" and len(stopped.token_ids) == stop_at

    num_prompt = sum(len(o.prompt_token_ids) for o in outputs)
    num_generated = [len(o.outputs[0].token_ids) for o in outputs]  # what the clients got
    num_sampled = [
        n + (o.outputs[0].finish_reason == "stop") for o, n in zip(outputs, num_generated)
    ]
    handed_off = [
        o for o, n in zip(outputs, num_sampled) if n > 1
    ]  # max_tokens=1 ended on the prefill
    reasons = collections.Counter(o.outputs[0].finish_reason for o in outputs)
    assert reasons == {"length": 4, "stop": 1}

    # Every context phase leases its KV (fidelity: the first token could be handed off); the
    # decode's confirm ends a pulled one, the one max_tokens=1 ended is withdrawn on the prefill.
    assert wait_for(
        lambda: (
            value(scrapes.now("prefill"), "tandem:kv_leases_active") == 0
            and scrapes.delta("prefill", "tandem:kv_lease_endings_total") == len(outputs)
        )
    )

    # The router: the client's view of every request.
    assert scrapes.delta("router", "tandem:prompt_tokens_total") == num_prompt
    assert scrapes.delta("router", "tandem:generation_tokens_total") == sum(num_generated)
    for reason, count in reasons.items():
        assert (
            scrapes.delta("router", "tandem:request_success_total", finished_reason=reason) == count
        )
    router_now = scrapes.now("router")
    for histogram in (
        "time_to_first_token_seconds",
        "e2e_request_latency_seconds",
        "request_prompt_tokens",
        "request_generation_tokens",
    ):
        assert scrapes.delta("router", f"tandem:{histogram}_count") == len(outputs), histogram
        count = value(router_now, f"tandem:{histogram}_count")
        assert value(router_now, f"tandem:{histogram}_bucket", le="+Inf") == count
    assert scrapes.delta("router", "tandem:time_per_output_token_seconds_count") == sum(
        n >= 2 for n in num_generated
    )
    assert scrapes.delta("router", "tandem:request_prompt_tokens_sum") == num_prompt
    assert scrapes.delta("router", "tandem:request_generation_tokens_sum") == sum(num_generated)
    generate_ok = {"grpc_method": "Generate", "grpc_code": "OK"}
    assert scrapes.delta("router", "tandem:grpc_server_handled_total", **generate_ok) == len(
        outputs
    )
    e2e_sum = scrapes.delta("router", "tandem:e2e_request_latency_seconds_sum")
    ttft_sum = scrapes.delta("router", "tandem:time_to_first_token_seconds_sum")
    assert 0 < ttft_sum < e2e_sum

    # The prefill: every prompt, one token each, a handoff for each request that went on to the decode.
    assert scrapes.delta("prefill", "tandem:prompt_tokens_total") == num_prompt
    assert scrapes.delta("prefill", "tandem:generation_tokens_total") == len(outputs)
    assert scrapes.delta(
        "prefill", "tandem:request_success_total", finished_reason="handoff"
    ) == len(handed_off)
    assert scrapes.delta("prefill", "tandem:request_success_total", finished_reason="length") == 1
    assert scrapes.delta("prefill", "tandem:kv_handoffs_total") == len(outputs)  # leases opened
    assert (
        scrapes.delta("prefill", "tandem:kv_lease_endings_total", way="stopped") == 1
    )  # max_tokens=1
    assert scrapes.delta("prefill", "tandem:kv_lease_endings_total", way="pulled") == len(
        handed_off
    )
    assert scrapes.delta(
        "prefill", "tandem:grpc_server_handled_total", grpc_method="ConfirmLease"
    ) == len(handed_off)
    state_after = {w.role: worker_state(w.address) for w in (prefill, decode)}
    for way, count in state_after["prefill"].lease_endings.items():
        assert scrapes.delta(
            "prefill", "tandem:kv_lease_endings_total", way=way
        ) == count - state_before["prefill"].lease_endings.get(way, 0), way
    # The repeated prompt's blocks came from the prefill's prefix cache; the client sees how many.
    hits = scrapes.delta("prefill", "tandem:prefix_cache_hits_total")
    assert hits == sum(o.metrics.num_cached_prompt_tokens for o in outputs) > 0
    assert scrapes.delta("prefill", "tandem:prefix_cache_queries_total") == num_prompt

    # The decode: the rest of the tokens, and the KV it pulled, as it reports it over gRPC and to the clients.
    assert scrapes.delta("decode", "tandem:prompt_tokens_total") == sum(
        len(o.prompt_token_ids) for o in handed_off
    )
    # The router's split does not get the context phase's first token back from the decode (the
    # client has it already): the decode counts the tokens it generated, the prefill the first.
    assert scrapes.delta("decode", "tandem:generation_tokens_total") == sum(
        len(o.outputs[0].token_ids) - 1 for o in handed_off
    )
    assert scrapes.delta("decode", "tandem:request_success_total", finished_reason="stop") == 1
    pulled = scrapes.delta("decode", "tandem:kv_transfer_bytes_total")
    assert (
        pulled == state_after["decode"].kv_bytes_received - state_before["decode"].kv_bytes_received
    )
    assert pulled == sum(o.metrics.kv_transfer_bytes for o in outputs) > 0
    assert scrapes.delta("decode", "tandem:kv_transfer_seconds_count") == len(handed_off)
    # Each handoff that reached the decode was pulled: none was computed again, silently or not.
    assert scrapes.delta("decode", "tandem:kv_handoffs_total", outcome="pulled") == len(handed_off)
    assert scrapes.delta("decode", "tandem:kv_handoffs_total") == len(handed_off)
    # ... and the router saw the same per prefill->decode pair.
    pair = dict(prefill=cluster.workers[0].address, decode=cluster.workers[1].address)
    assert scrapes.delta(
        "router", "tandem:router_kv_handoffs_total", outcome="pulled", **pair
    ) == len(handed_off)
    assert scrapes.delta("router", "tandem:router_kv_handoffs_total") == len(handed_off)
    outcomes_before = state_before["decode"].kv_handoff_outcomes
    assert {
        k: v - outcomes_before.get(k, 0)
        for k, v in state_after["decode"].kv_handoff_outcomes.items()
        if v != outcomes_before.get(k, 0)
    } == {"pulled": len(handed_off)}

    for role in ("prefill", "decode"):
        now = scrapes.now(role)
        assert (
            value(now, "tandem:num_requests_running")
            == value(now, "tandem:num_requests_waiting")
            == 0
        )
        assert value(now, "tandem:kv_cache_usage_perc") == 0.0
        steps = scrapes.delta(role, "tandem:engine_steps_total")
        assert 0 < scrapes.delta(role, "tandem:engine_step_duration_seconds_count") <= steps
        assert scrapes.delta(role, "tandem:engine_step_batch_size_sum") >= scrapes.delta(
            role, "tandem:engine_step_batch_size_count"
        )
    # The KV cache's settings as labels (vLLM's cache_config_info), on each worker.
    for role in ("prefill", "decode"):
        assert (
            value(
                scrapes.now(role), "tandem:cache_config_info", block_size="8", num_gpu_blocks="128"
            )
            == 1
        )
    # vLLM's request phases on each worker, one observation per request it served to the end:
    # every request's context phase on the prefill, the handed-off ones' decode on the decode.
    for role, count in (("prefill", len(outputs)), ("decode", len(handed_off))):
        for phase in ("queue", "prefill", "decode", "inference"):
            name = f"tandem:request_{phase}_time_seconds"
            assert scrapes.delta(role, f"{name}_count") == count, (role, phase)
            assert scrapes.delta(role, f"{name}_sum") >= 0
        # The decode phase of the decodes' requests ran (several tokens each).
    assert scrapes.delta("decode", "tandem:request_decode_time_seconds_sum") > 0
    assert scrapes.delta("prefill", "tandem:request_prefill_time_seconds_sum") > 0
    # Inter-token latency: one interval per message of new tokens after the first; the streamed
    # request's messages are the only ones the router's clients got several of.
    assert scrapes.delta("router", "tandem:inter_token_latency_seconds_count") >= 1
    # The decode's confirm ended each pulled lease: the router sent no ReleaseKv after it (the
    # router's release would go right after a request's last message: long past by now).
    time.sleep(0.5)
    assert (
        scrapes.delta("prefill", "tandem:grpc_server_handled_total", grpc_method="ReleaseKv") == 0
    )


def test_failed_calls_count_under_their_status_code(cluster):
    scrapes = Scrapes(cluster)
    with LLM(cluster.address) as llm:
        with pytest.raises(Exception, match="out of vocabulary"):
            llm.generate(
                {"prompt_token_ids": [10**6]}, SamplingParams(max_tokens=2), use_tqdm=False
            )
        with pytest.raises(Exception, match="encoder-only"):
            llm.encode("not an encoder")
    generate = {"grpc_method": "Generate", "grpc_service": "tandem.v1.AsyncLLM"}
    # The prefill refused the prompt; the router relayed its status.
    for role in ("router", "prefill"):
        assert (
            scrapes.delta(
                role, "tandem:grpc_server_handled_total", grpc_code="INVALID_ARGUMENT", **generate
            )
            == 1
        )
        assert (
            scrapes.delta(role, "tandem:grpc_server_handled_total", grpc_code="OK", **generate) == 0
        )
        assert scrapes.delta(role, "tandem:e2e_request_latency_seconds_count") == 0
    assert (
        scrapes.delta(
            "router",
            "tandem:grpc_server_handled_total",
            grpc_method="Encode",
            grpc_code="FAILED_PRECONDITION",
        )
        == 1
    )
    assert (
        scrapes.delta("router", "tandem:grpc_server_handled_total", grpc_code="INVALID_ARGUMENT")
        == 1
    )


def test_an_aborted_request_counts_as_cancelled(cluster):
    scrapes = Scrapes(cluster)

    async def abort_after_first_token():
        async with AsyncLLM(cluster.address) as llm:
            result = llm.generate_async(
                "abort me", SamplingParams(max_tokens=1500, ignore_eos=True), streaming=True
            )
            async for out in result:
                if out.outputs and out.outputs[0].token_ids:
                    result.abort()
            return out

    out = asyncio.run(abort_after_first_token())
    assert out.outputs[0].finish_reason == "cancelled" and len(out.outputs[0].token_ids) < 1500
    assert wait_for(
        lambda: (
            scrapes.delta("router", "tandem:request_success_total", finished_reason="cancelled")
            == 1
        )
    )
    assert scrapes.delta("router", "tandem:generation_tokens_total") == len(
        out.outputs[0].token_ids
    )


def test_a_client_that_goes_away_counts_as_cancelled(cluster):
    scrapes = Scrapes(cluster)

    async def leave_after_first_token():
        async with AsyncLLM(cluster.address) as llm:
            async for out in llm.generate_async(
                "leave me", SamplingParams(max_tokens=1500, ignore_eos=True), streaming=True
            ):
                if out.outputs and out.outputs[0].token_ids:
                    return  # the channel closes under the stream

    asyncio.run(leave_after_first_token())
    generate = {"grpc_method": "Generate", "grpc_code": "CANCELLED"}
    assert wait_for(
        lambda: scrapes.delta("router", "tandem:grpc_server_handled_total", **generate) == 1
    )
    assert scrapes.delta("router", "tandem:e2e_request_latency_seconds_count") == 0


def test_metrics_port_zero_is_none_and_a_taken_port_fails_loudly():
    metrics = ProcessMetrics("router")
    assert metrics.serve_http("127.0.0.1", 0) is None
    port = free_port()
    url = metrics.serve_http("127.0.0.1", port)
    try:
        assert urllib.request.urlopen(url, timeout=10).status == 200
        with pytest.raises(OSError, match=f"metrics port 127.0.0.1:{port}"):
            ProcessMetrics("router").serve_http("127.0.0.1", port)
    finally:
        metrics.close()
    with pytest.raises(OSError):
        urllib.request.urlopen(url, timeout=2)
