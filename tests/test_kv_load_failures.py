"""A decode that cannot load a handoff's KV (issue 39), forced over real processes: a prefill whose
leases are shorter than the decode's safety margin hands off KV that no decode may pull
(lease_expiring). Under --kv-load-failure-policy fail the decode ends the request UNAVAILABLE,
naming why, and the router retries it once on another prefill/decode pair; under recompute
(the default) the decode computes the prompt itself. Either way the outcome is in the decode's
WorkerState, its log, the router's per-pair metric, and the request's metrics and perf metrics;
the tokens are the aggregated path's and no KV block is left behind on any worker."""

from __future__ import annotations

import grpc
import pytest
from conftest import assert_all_blocks_free
from test_disagg import worker_state
from test_metrics import scrape, value

from tandem.client import LLM, DisaggregatedParams, RequestError, SamplingParams
from tandem.testing.cluster import LocalCluster

# Shorter than the decode's LEASE_SAFETY_MARGIN_S (1 s): every handoff of that prefill expires too soon.
SHORT_LEASE_S = "0.5"
MAX_TOKENS = 8


def _engine_args(model_dirs) -> list[str]:
    return ["--model", str(model_dirs["llama"]), "--num-blocks", "128", "--block-size", "8"]


def _prompts(oracle, model_dirs, n: int) -> list[list[int]]:
    tokenizer = oracle(model_dirs["llama"]).tokenizer
    return [tokenizer.encode(f"kv load failure {i} " * (3 + i)) for i in range(n)]


def _no_leaked_blocks(cluster) -> None:
    for worker in cluster.workers:
        with LLM(worker.address, **cluster.worker_client_kwargs()) as llm:
            assert_all_blocks_free(llm)


def _cluster(model_dirs, roles: list[str]) -> LocalCluster:
    """prefill-1 hands off leases too short to pull; decode-1 runs the fail policy; the router
    takes the workers of a role in turn."""
    return LocalCluster(
        roles=roles,
        engine_args=_engine_args(model_dirs),
        worker_args={
            "prefill-1": ["--kv-lease-seconds", SHORT_LEASE_S],
            "decode-1": ["--kv-load-failure-policy", "fail"],
        },
        router_args=["--routing", "round-robin"],
    )


@pytest.fixture(scope="module")
def two_prefills(model_dirs):
    """prefill-1's handoffs cannot be pulled, prefill-2's can; the one decode fails what it
    cannot load."""
    with _cluster(model_dirs, ["prefill", "prefill", "decode"]) as c:
        yield c


def test_fail_retries_on_another_prefill_and_the_tokens_are_the_aggregated_ones(
    two_prefills, model_dirs, oracle
):
    cluster = two_prefills
    short, good, decode = (w.address for w in cluster.workers)
    ref = oracle(model_dirs["llama"])
    prompts = _prompts(oracle, model_dirs, 6)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, return_perf_metrics=True)
    with LLM(cluster.address) as llm:
        outputs = [llm.generate(p, params, use_tqdm=False) for p in prompts]
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
        handoff = out.metrics.kv_handoff
        assert (handoff.outcome, handoff.prefill, handoff.decode) == ("pulled", good, decode)
        assert out.outputs[0].request_perf_metrics.kv_handoff.outcome == "pulled"
    retried = [o for o in outputs if short in o.metrics.served_by]
    assert retried, "round-robin sends some context phases to the short-lease prefill"
    assert all(good in o.metrics.served_by for o in retried)
    outcomes = worker_state(decode).kv_handoff_outcomes
    assert outcomes["failed:lease_expiring"] == len(retried)
    assert outcomes["pulled"] == len(prompts)
    assert "recomputed:lease_expiring" not in outcomes
    router = scrape(cluster.router)
    name = "tandem:router_kv_handoffs_total"
    assert value(
        router, name, prefill=short, decode=decode, outcome="failed", reason="lease_expiring"
    ) == len(retried)
    assert value(router, name, prefill=good, decode=decode, outcome="pulled") == len(prompts)
    decode_log = cluster.workers[2].log_path.read_text(errors="replace")
    assert decode_log.count("(lease_expiring); decode") >= len(retried)
    assert "fails the request (--kv-load-failure-policy fail)" in decode_log
    _no_leaked_blocks(cluster)


@pytest.fixture(scope="module")
def two_decodes(model_dirs):
    """One prefill, every lease too short; decode-1 fails what it cannot load, decode-2 (the
    default policy) computes the prompt itself."""
    with _cluster(model_dirs, ["prefill", "decode", "decode"]) as c:
        yield c


def test_recompute_is_counted_where_an_operator_and_a_client_see_it(
    two_decodes, model_dirs, oracle
):
    cluster = two_decodes
    prefill, failing, recomputing = (w.address for w in cluster.workers)
    ref = oracle(model_dirs["llama"])
    prompts = _prompts(oracle, model_dirs, 4)
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, return_perf_metrics=True)
    with LLM(cluster.address) as llm:
        outputs = [llm.generate(p, params, use_tqdm=False) for p in prompts]
        stats = llm.get_stats(timeout=2)
    for prompt, out in zip(prompts, outputs):
        assert out.outputs[0].token_ids == ref.greedy(prompt, MAX_TOKENS)
        handoff = out.metrics.kv_handoff
        # Each ends on the recomputing decode: directly, or retried there off the failing one.
        assert (handoff.outcome, handoff.reason, handoff.prefill, handoff.decode) == (
            "recomputed",
            "lease_expiring",
            prefill,
            recomputing,
        )
        assert handoff.num_pulled_blocks == 0
        perf = out.outputs[0].request_perf_metrics.kv_handoff
        assert (perf.outcome, perf.reason) == ("recomputed", "lease_expiring")
    failed = worker_state(failing).kv_handoff_outcomes["failed:lease_expiring"]
    assert 1 <= failed <= len(prompts)
    assert worker_state(recomputing).kv_handoff_outcomes["recomputed:lease_expiring"] == len(
        prompts
    )
    router = scrape(cluster.router)
    name = "tandem:router_kv_handoffs_total"
    assert value(router, name, decode=failing, outcome="failed", reason="lease_expiring") == failed
    assert value(router, name, decode=recomputing, outcome="recomputed") == len(prompts)
    decode_stats = [s for s in stats if s.get("worker_id") == recomputing]
    assert any(
        s.get("kvHandoffOutcomes", {}).get("recomputed:lease_expiring") for s in decode_stats
    ), decode_stats
    recompute_log = cluster.workers[2].log_path.read_text(errors="replace")
    assert f"prefill {prefill} was not pulled (lease_expiring); decode {recomputing}" in (
        recompute_log
    )
    _no_leaked_blocks(cluster)


def test_fail_without_a_retry_is_unavailable_and_says_why(two_decodes, model_dirs, oracle):
    """A client that runs the split itself against the failing decode: nobody retries for it."""
    cluster = two_decodes
    prefill, failing = cluster.workers[0].address, cluster.workers[1].address
    prompt = _prompts(oracle, model_dirs, 1)[0]
    kwargs = cluster.worker_client_kwargs()
    with LLM(prefill, **kwargs) as llm:
        ctx = llm.generate(
            prompt,
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            disaggregated_params=DisaggregatedParams(request_type="context_only"),
            use_tqdm=False,
        )
    h = ctx.outputs[0].disaggregated_params
    handoff = DisaggregatedParams(
        request_type="generation_only",
        first_gen_tokens=h.first_gen_tokens,
        ctx_request_id=h.ctx_request_id,
        opaque_state=h.opaque_state,
    )
    before = worker_state(failing).kv_handoff_outcomes.get("failed:lease_expiring", 0)
    with LLM(failing, **kwargs) as llm, pytest.raises(RequestError) as error:
        llm.generate(
            prompt,
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True),
            disaggregated_params=handoff,
            use_tqdm=False,
        )
    assert error.value.code == grpc.StatusCode.UNAVAILABLE
    assert "lease_expiring" in str(error.value) and prefill in str(error.value)
    assert worker_state(failing).kv_handoff_outcomes["failed:lease_expiring"] == before + 1
    _no_leaked_blocks(cluster)


def test_held_outputs_reach_the_stream_only_once_the_lease_is_confirmed():
    """What a pulled sequence's first step draws while ConfirmLease is on the way waits: released
    in order on a confirm, dropped (with whatever still comes) on a refusal."""
    from tandem.decode.generation import HeldOutputs

    class Stream(list):
        put_nowait = list.append

    confirmed = HeldOutputs(Stream())
    confirmed.put_nowait("first")
    confirmed.put_nowait("second")
    assert confirmed.stream == []
    confirmed.release()
    confirmed.put_nowait("third")
    assert confirmed.stream == ["first", "second", "third"]
    refused = HeldOutputs(Stream())
    refused.put_nowait("drawn from foreign KV")
    refused.discard()
    refused.put_nowait("a late output of the aborted step")
    refused.release()  # a release after a discard passes nothing on
    assert refused.stream == []
