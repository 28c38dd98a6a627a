"""Issue 11: workers found through DNS, added and dropped while traffic runs. On loopback the
workers differ by port, so the router resolves its names from a hosts file with ports
(--hosts-file) that the test rewrites; the default resolver, real DNS, is checked on localhost."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tandem.client import LLM, SamplingParams
from tandem.common.roles import Role
from tandem.router.discovery import (
    DnsDiscovery,
    DnsTarget,
    hosts_file_resolver,
    parse_dns_targets,
    resolve_dns,
)
from tandem.testing.cluster import LocalCluster
from tandem.v1 import llm_pb2, llm_pb2_grpc

pytestmark = pytest.mark.timeout(600)


def test_real_dns_resolves_localhost():
    addresses = asyncio.run(resolve_dns("localhost", 50052))
    assert "127.0.0.1:50052" in addresses or "[::1]:50052" in addresses


def test_dns_targets_parse_and_refuse():
    assert parse_dns_targets(("prefill=tandem-prefill.ns.svc:50052", "w:1")) == [
        DnsTarget("tandem-prefill.ns.svc", 50052, Role.PREFILL),
        DnsTarget("w", 1),
    ]
    for bad in ("prefill=host", "router=h:1", "h:0", ":5"):
        with pytest.raises(ValueError):
            parse_dns_targets((bad,))


def test_a_failed_resolution_keeps_the_last_answer(tmp_path):
    hosts = tmp_path / "hosts"
    hosts.write_text("w 127.0.0.1:1\nw 127.0.0.1:2\nother 127.0.0.1:9\n")
    seen = []
    discovery = DnsDiscovery([DnsTarget("w", 1)], seen.append, resolver=hosts_file_resolver(hosts))

    async def main():
        await discovery.refresh()
        hosts.write_text("# w is gone from DNS for a moment\n")
        await discovery.refresh()
        hosts.write_text("w 127.0.0.1:2\n")
        await discovery.refresh()

    asyncio.run(main())
    assert seen == [{"127.0.0.1:1", "127.0.0.1:2"}, {"127.0.0.1:1", "127.0.0.1:2"}, {"127.0.0.1:2"}]


def _served_by(llm: LLM, prompt: list[int]) -> list[str]:
    out = llm.generate(prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    assert len(out.outputs[0].token_ids) == 6
    return list(out.metrics.served_by)


def _wait_for(predicate, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.2)


def test_workers_join_and_leave_through_dns_under_traffic(model_dirs, tmp_path):
    engine_args = ["--model", str(model_dirs["llama"]), "--num-blocks", "128", "--block-size", "8"]
    with LocalCluster(
        roles=["prefill", "decode"], engine_args=engine_args, hosts_file=tmp_path / "hosts"
    ) as c:
        first_decode = c.workers[1]
        errors: list[BaseException] = []
        served: list[list[str]] = []
        stop = threading.Event()

        def traffic(seed: int):
            with LLM(c.address) as llm:
                i = 0
                while not stop.is_set():
                    try:
                        served.append(
                            _served_by(
                                llm, [1] + [(seed * 97 + i * 13 + k) % 240 + 4 for k in range(20)]
                            )
                        )
                    except BaseException as exc:  # noqa: BLE001 - the test fails on any
                        errors.append(exc)
                    i += 1

        threads = [threading.Thread(target=traffic, args=(s,)) for s in range(3)]
        for t in threads:
            t.start()
        try:
            second_decode = c.add_worker("decode")
            c.write_hosts_file()
            _wait_for(lambda: any(second_decode.address in s for s in served[-20:]))
            c.write_hosts_file(exclude=(first_decode.address,))
            time.sleep(1.0)  # a resolution or two: streams already on it finish there
            mark = len(served)
            _wait_for(lambda: len(served) > mark + 10)
            assert not any(first_decode.address in s for s in served[mark:])
        finally:
            stop.set()
            for t in threads:
                t.join(60)
        assert errors == []
        with c.channel(c.address) as channel:
            info = llm_pb2_grpc.AsyncLLMStub(channel).GetServerInfo(
                llm_pb2.GetServerInfoRequest(), timeout=10
            )
        assert {w.worker_id for w in info.workers} == {c.workers[0].address, second_decode.address}
