"""Who may call what (tandem.common.auth): the access policy itself, protected mode over a real
non-loopback socket (a cluster with no admin token bound to a routable address cannot be shut
down from the network), and a prefill worker refusing to start without a cluster token."""

from __future__ import annotations

import os
import socket
import subprocess
import sys

import grpc
import pytest

from tandem.client import LLM, RequestError, SamplingParams
from tandem.common.auth import AccessPolicy, is_loopback_peer
from tandem.testing.cluster import LocalCluster

pytestmark = pytest.mark.timeout(180)
TOKEN = "c" * 32


@pytest.mark.parametrize(
    "peer, loopback",
    [
        ("ipv4:127.0.0.1:5000", True),
        ("ipv4:127.8.9.1:1", True),
        ("ipv6:[::1]:5000", True),
        ("ipv6:[::ffff:127.0.0.1]:5000", True),
        ("unix:/tmp/sock", True),
        ("ipv4:192.0.2.2:5000", False),
        ("ipv6:[2001:db8::1]:5000", False),
        ("ipv6:[::ffff:10.0.0.1]:5000", False),
        ("garbage", False),
    ],
)
def test_loopback_peers(peer, loopback):
    assert is_loopback_peer(peer) is loopback


def _code(policy: AccessPolicy, method: str, metadata: dict) -> grpc.StatusCode | str | None:
    verdict = policy.decide(method, metadata)
    return "loopback only" if verdict.loopback_only else verdict.code


def test_the_policy_table():
    worker = AccessPolicy(cluster_token=TOKEN, internal=True)
    router = AccessPolicy(cluster_token=TOKEN)
    admin_router = AccessPolicy(admin_token="adm", cluster_token=TOKEN)
    cluster, admin = {"tandem-cluster-token": TOKEN}, {"authorization": "Bearer adm"}
    rows = [
        # health and reflection stay open everywhere (probes)
        (worker, "/grpc.health.v1.Health/Check", {}, None),
        (worker, "/grpc.reflection.v1alpha.ServerReflection/ServerReflectionInfo", {}, None),
        # a worker serves only the internal plane
        (worker, "/tandem.v1.AsyncLLM/Generate", {}, grpc.StatusCode.UNAUTHENTICATED),
        (
            worker,
            "/tandem.v1.AsyncLLM/Generate",
            {"tandem-cluster-token": "wrong"},
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (worker, "/tandem.v1.AsyncLLM/Generate", cluster, None),
        (worker, "/tandem.v1.AsyncLLM/GetDataTransceiverState", cluster, None),
        # admin calls on a worker without an admin token: a cluster peer relays them
        (worker, "/tandem.v1.AsyncLLM/Shutdown", cluster, None),
        # the router's public face
        (router, "/tandem.v1.AsyncLLM/Generate", {}, None),
        (router, "/tandem.v1.AsyncLLM/Shutdown", {}, "loopback only"),
        (router, "/tandem.v1.AsyncLLM/GetKvCacheEvents", {}, "loopback only"),
        (router, "/tandem.v1.AsyncLLM/StreamKvCacheEvents", {}, "loopback only"),
        (router, "/tandem.v1.AsyncLLM/GetDataTransceiverState", {}, "loopback only"),
        (router, "/tandem.v1.AsyncLLM/GetStats", {}, None),
        (admin_router, "/tandem.v1.AsyncLLM/Shutdown", {}, grpc.StatusCode.UNAUTHENTICATED),
        (
            admin_router,
            "/tandem.v1.AsyncLLM/Shutdown",
            {"authorization": "Bearer no"},
            grpc.StatusCode.PERMISSION_DENIED,
        ),
        (admin_router, "/tandem.v1.AsyncLLM/Shutdown", admin, None),
        (admin_router, "/tandem.v1.AsyncLLM/GetKvCacheEvents", {}, grpc.StatusCode.UNAUTHENTICATED),
        (admin_router, "/tandem.v1.AsyncLLM/GetKvCacheEvents", admin, None),
    ]
    for policy, method, metadata, expected in rows:
        assert _code(policy, method, metadata) == expected, (policy, method, metadata)


def _routable_address() -> str:
    """This host's address on its default route (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("10.255.255.255", 1))
        address = probe.getsockname()[0]
    assert not address.startswith("127."), (
        f"no routable IPv4 address here ({address}): protected mode needs one"
    )
    return address


def test_protected_mode_refuses_admin_calls_from_the_network(model_dirs):
    """No admin token, bound to a routable address: a client reaching it over that address can
    generate but cannot shut down, pause, read KV events or transceiver state."""
    host = _routable_address()
    with (
        LocalCluster(
            roles=["both"],
            host=host,
            engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"],
        ) as c,
        LLM(c.address) as llm,
    ):
        assert (
            llm.generate("still serving", SamplingParams(max_tokens=3), use_tqdm=False)
            .outputs[0]
            .token_ids
        )
        for call in (
            llm.shutdown_cluster,
            lambda: llm.get_kv_cache_events(timeout=0.1),
            llm.get_data_transceiver_state,
        ):
            with pytest.raises(RequestError) as err:
                call()
            assert (
                err.value.code == grpc.StatusCode.PERMISSION_DENIED
                and "protected mode" in err.value.details
            )
        c.check_alive()
        assert (
            llm.generate("still serving", SamplingParams(max_tokens=3), use_tqdm=False)
            .outputs[0]
            .token_ids
        )


def test_admin_calls_from_loopback_need_no_token_in_protected_mode(model_dirs):
    with (
        LocalCluster(
            roles=["both"], engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"]
        ) as c,
        LLM(c.address) as llm,
    ):
        assert llm.get_kv_cache_events(timeout=0.1) is not None
        detail = llm.shutdown_cluster()
        assert any("stopping" in d for d in detail)
        for s in c.services:
            assert s.process.wait(timeout=30) == 0


def test_a_prefill_worker_refuses_to_start_without_a_cluster_token(model_dirs):
    env = {k: v for k, v in os.environ.items() if k != "TANDEM_CLUSTER_TOKEN"}
    for token_args, fragment in (
        ([], "needs the cluster token (--cluster-token or TANDEM_CLUSTER_TOKEN)"),
        (["--cluster-token", "short"], "--cluster-token must be at least 16 characters"),
    ):
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "tandem.cli.main",
                "serve",
                "prefill",
                "--port",
                "0",
                "--model",
                str(model_dirs["llama"]),
                *token_args,
            ],
            capture_output=True,
            text=True,
            timeout=60,
            env=env,
        )
        assert proc.returncode == 2 and fragment in proc.stderr, proc.stderr
