"""A client of several routers (issue 35): calls go round-robin over every router its target
names (a comma-separated list here; a DNS name resolving to every router in Kubernetes), and a
router that goes away leaves the others serving the client, a call that found it gone retried
on another. Real processes: two routers over one worker, on 127.0.0.1 and 127.0.0.2 (the same
port)."""

from __future__ import annotations

import asyncio
import socket

import pytest
from conftest import abort_while_streaming
from test_metrics import scrape, value

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.client.transport import channel_target
from tandem.testing.cluster import LocalCluster


def _port_free_on_both() -> int:
    for _ in range(50):
        with socket.socket() as a, socket.socket() as b:
            a.bind(("127.0.0.1", 0))
            port = a.getsockname()[1]
            try:
                b.bind(("127.0.0.2", port))
            except OSError:
                continue
            return port
    raise RuntimeError("no port free on both 127.0.0.1 and 127.0.0.2")


def test_router_lists_become_grpc_address_lists_and_bad_ones_are_refused():
    assert channel_target("router:50051") == "router:50051"
    assert channel_target("10.0.0.1:1, 10.0.0.2:1") == "ipv4:10.0.0.1:1,10.0.0.2:1"
    assert channel_target("[::1]:5,[fe80::1]:5") == "ipv6:[::1]:5,[fe80::1]:5"
    for bad in ("a:1,b:1", "10.0.0.1:1,[::1]:1", "10.0.0.1,10.0.0.2:1"):
        with pytest.raises(ValueError, match="IP:port entries of one family"):
            LLM(bad)


def test_a_client_spreads_over_two_routers_and_keeps_serving_when_one_goes(model_dirs):
    port = _port_free_on_both()
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    with LocalCluster(
        roles=["both"], engine_args=["--model", str(model_dirs["llama"])], router_port=port
    ) as cluster:
        second = cluster.add_router("router-2", [], host="127.0.0.2", port=port)
        routers = [cluster.router, second]
        with LLM(f"127.0.0.1:{port},127.0.0.2:{port}") as llm:
            want = llm.generate([1, 5, 9, 13], params, use_tqdm=False).outputs[0].token_ids
            for _ in range(11):
                assert (
                    llm.generate([1, 5, 9, 13], params, use_tqdm=False).outputs[0].token_ids == want
                )
            served = [
                value(scrape(r), "tandem:request_success_total") for r in routers
            ]  # both took some of the 12
            assert all(n >= 2 for n in served) and sum(served) == 12, served
            _a_plaintext_abort_stays_with_its_connection(f"127.0.0.1:{port}", f"127.0.0.2:{port}")
            cluster.router.process.kill()
            cluster.router.process.wait(10)
            for _ in range(6):  # every call answered, by the router left
                assert (
                    llm.generate([1, 5, 9, 13], params, use_tqdm=False).outputs[0].token_ids == want
                )
        assert value(scrape(second), "tandem:request_success_total") == served[1] + 6


def _a_plaintext_abort_stays_with_its_connection(first: str, second: str) -> None:
    """Without a client certificate a client is its connection: another connection's Abort of
    its request, on another router, is refused (aborted: false) and the stream runs on; its own
    connection's Abort ends it."""

    async def go():
        owner, other = await AsyncLLM(first), await AsyncLLM(second)
        try:
            return await abort_while_streaming(owner, [other.abort, owner.abort])
        finally:
            owner.close()
            other.close()

    out, verdicts = asyncio.run(asyncio.wait_for(go(), 60))
    assert verdicts == [False, True]
    assert out.outputs[0].finish_reason == "cancelled"
