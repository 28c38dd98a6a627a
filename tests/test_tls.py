"""TLS and mTLS over real processes: a throwaway CA, a split cluster whose processes all serve
TLS and demand CA-signed client certificates from each other, a router whose public face asks
clients only to trust the CA (or, in the second cluster, demands their certificates too), and
everyone else refused: plaintext clients, clients without a certificate, certificates of
another CA. grpcurl and `tandem generate` reach the TLS router as the README shows."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import grpc
import httpx
import pytest
from conftest import abort_while_streaming, assert_all_blocks_free
from grpc_health.v1 import health_pb2, health_pb2_grpc
from test_disagg import worker_state
from tls_certs import make_authority

from tandem.client import LLM, RequestError, SamplingParams
from tandem.common.tls import TlsConfig
from tandem.testing.cluster import LocalCluster, free_port
from tandem.v1 import worker_pb2, worker_pb2_grpc

GRPCURL = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
PARAMS = SamplingParams(max_tokens=6, ignore_eos=True)
ENGINE_ARGS = ["--num-blocks", "64", "--block-size", "8"]

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def pki(tmp_path_factory):
    directory = tmp_path_factory.mktemp("pki")
    ca, rogue = make_authority(directory, "tandem-test-ca"), make_authority(directory, "rogue-ca")
    return {
        "ca": ca,
        "node": ca.issue(directory, "tandem-node"),
        "client": ca.issue(directory, "a-client"),
        "rogue": rogue.issue(directory, "rogue-client"),
    }


@pytest.fixture(scope="module")
def split(pki, model_dirs):
    """1 prefill + 1 decode: mTLS between all processes; the router's public face is TLS only."""
    tls = TlsConfig(
        str(pki["node"].cert), str(pki["node"].key), str(pki["ca"].cert), require_client_cert=False
    )
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=["--model", str(model_dirs["llama"]), *ENGINE_ARGS],
        tls=tls,
    ) as c:
        yield c


def _code(call) -> grpc.StatusCode:
    with pytest.raises(RequestError) as err:
        call()
    return err.value.code


def test_a_tls_split_cluster_serves_and_every_hop_is_tls(split, pki):
    """A client that trusts the CA gets the split's output; the decode fetched the prefill's
    transceiver state and confirmed the lease over mTLS (the lease ended 'pulled')."""
    before = dict(worker_state(split.workers[0].address).lease_endings)
    with LLM(split.address, root_certificates=str(pki["ca"].cert)) as llm:
        out = llm.generate("over TLS", PARAMS, use_tqdm=False)
        assert len(out.outputs[0].token_ids) == 6
        assert out.metrics.kv_transfer_bytes > 0  # the KV moved from prefill to decode
        assert_all_blocks_free(llm)
    after = dict(worker_state(split.workers[0].address).lease_endings)
    assert after.get("pulled", 0) == before.get("pulled", 0) + 1


def test_plaintext_and_uncertified_clients_are_refused(split, pki):
    router, prefill = split.address, split.workers[0].address
    for target in (router, prefill):  # plaintext against TLS: the handshake fails
        with LLM(target) as plain:
            assert _code(lambda: plain.get_kv_cache_capacity()) == grpc.StatusCode.UNAVAILABLE
    # Workers demand a CA-signed client certificate: none, or one of another CA, gets nowhere.
    for kwargs in (
        {},
        {"certificate_chain": str(pki["rogue"].cert), "private_key": str(pki["rogue"].key)},
    ):
        with LLM(
            prefill,
            root_certificates=str(pki["ca"].cert),
            cluster_token=split.cluster_token,
            **kwargs,
        ) as llm:
            assert _code(lambda: llm.get_kv_cache_capacity()) == grpc.StatusCode.UNAVAILABLE
    # A certificate of the cluster's CA without the cluster token: authenticated, not authorized.
    with LLM(
        prefill,
        root_certificates=str(pki["ca"].cert),
        certificate_chain=str(pki["client"].cert),
        private_key=str(pki["client"].key),
    ) as llm:
        assert _code(lambda: llm.get_kv_cache_capacity()) == grpc.StatusCode.UNAUTHENTICATED
    # The router's server certificate must chain to the CA the client trusts.
    with LLM(router, root_certificates=str(pki["rogue"].cert)) as llm:
        assert _code(lambda: llm.get_kv_cache_capacity()) == grpc.StatusCode.UNAVAILABLE


def _grpcurl(*args: str, data: str | None = None) -> str:
    argv = [GRPCURL, *(["-d", data] if data is not None else []), *args]
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0, f"{' '.join(argv)} failed: {proc.stderr}"
    return proc.stdout


def test_grpcurl_with_tls(split, pki):
    ca = str(pki["ca"].cert)
    assert "tandem.v1.AsyncLLM" in _grpcurl("-cacert", ca, split.address, "list").split()
    request = json.dumps(
        {
            "prompt": {"text": "Hello over TLS"},
            "sampling_params": {"max_tokens": 3, "ignore_eos": True},
        }
    )
    out = json.loads(
        _grpcurl("-cacert", ca, "-d", request, split.address, "tandem.v1.AsyncLLM/Generate")
    )
    assert len(out["outputs"][0]["token_ids"]) == 3
    # A worker, as an operator holding the cluster's certificate and token.
    state = json.loads(
        _grpcurl(
            "-cacert",
            ca,
            "-cert",
            str(pki["client"].cert),
            "-key",
            str(pki["client"].key),
            "-H",
            f"tandem-cluster-token: {split.cluster_token}",
            split.workers[1].address,
            "tandem.v1.Worker/GetWorkerState",
        )
    )
    assert state["role"] == "ROLE_DECODE"
    proc = subprocess.run(
        [GRPCURL, "-plaintext", split.address, "list"], capture_output=True, text=True, timeout=30
    )
    assert proc.returncode != 0


def test_the_openai_front_reaches_a_tls_router(split, pki, tmp_path):
    port = free_port()
    log = open(tmp_path / "front.log", "w")
    front = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            "openai",
            "--target",
            split.address,
            "--port",
            str(port),
            "--tls-ca",
            str(pki["ca"].cert),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert front.poll() is None, (tmp_path / "front.log").read_text()
            try:
                if httpx.get(f"{base}/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, (tmp_path / "front.log").read_text()
            time.sleep(0.1)
        reply = httpx.post(
            f"{base}/v1/completions",
            timeout=60,
            json={
                "model": Path(split.engine_args[1]).name,
                "prompt": "Hello",
                "max_tokens": 3,
                "ignore_eos": True,
            },
        )
        assert reply.status_code == 200, reply.text
        assert reply.json()["usage"]["completion_tokens"] == 3
    finally:
        front.terminate()
        front.wait(15)
        log.close()


def test_mtls_router_demands_client_certificates_and_tandem_generate_presents_one(pki, model_dirs):
    """A router that demands client certificates; a worker with a plaintext health-only port."""
    tls = TlsConfig(str(pki["node"].cert), str(pki["node"].key), str(pki["ca"].cert))
    health_port = free_port()
    with LocalCluster(
        roles=["both"],
        engine_args=["--model", str(model_dirs["llama"]), *ENGINE_ARGS],
        tls=tls,
        worker_args={"both-1": ["--health-port", str(health_port)]},
    ) as c:
        # Probes that speak no TLS (the kubelet's) get plaintext health there, and nothing else.
        with grpc.insecure_channel(f"127.0.0.1:{health_port}") as plain:
            check = health_pb2_grpc.HealthStub(plain).Check(
                health_pb2.HealthCheckRequest(), timeout=10
            )
            assert check.status == health_pb2.HealthCheckResponse.SERVING
            with pytest.raises(grpc.RpcError) as err:
                worker_pb2_grpc.WorkerStub(plain).GetWorkerState(
                    worker_pb2.WorkerStateRequest(), timeout=10
                )
            assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED
        with LLM(c.address, root_certificates=str(pki["ca"].cert)) as no_cert:
            assert _code(lambda: no_cert.get_kv_cache_capacity()) == grpc.StatusCode.UNAVAILABLE
        argv = [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "generate",
            "--target",
            c.address,
            "--max-tokens",
            "4",
            "--tls-ca",
            str(pki["ca"].cert),
            "--tls-cert",
            str(pki["client"].cert),
            "--tls-key",
            str(pki["client"].key),
            "Hello",
        ]
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=60)
        assert proc.returncode == 0, proc.stderr
        assert "[length: 4 tokens]" in proc.stdout
        with LLM(
            c.address,
            root_certificates=pki["ca"].cert.read_bytes(),
            certificate_chain=pki["client"].cert.read_bytes(),
            private_key=pki["client"].key.read_bytes(),
        ) as llm:
            assert_all_blocks_free(llm)
        with c.channel(
            c.workers[0].address
        ) as channel:  # the cluster's own identity reaches the worker
            state = worker_pb2_grpc.WorkerStub(channel).GetWorkerState(
                worker_pb2.WorkerStateRequest(), timeout=10
            )
        assert state.role == worker_pb2.ROLE_BOTH


def test_tls_files_are_checked_at_start_with_a_message_that_names_the_flag(pki):
    node, rogue = pki["node"], pki["rogue"]
    cases = [
        (
            {"cert_file": "/nonexistent.crt", "key_file": str(node.key)},
            "--tls-cert '/nonexistent.crt' cannot be read",
        ),
        (
            {"cert_file": str(node.cert), "key_file": str(rogue.key)},
            "not a PEM certificate and its private key",
        ),
        (
            {"cert_file": str(node.cert), "key_file": str(node.key), "ca_file": str(node.key)},
            "not a PEM CA bundle",
        ),
    ]
    for files, fragment in cases:
        with pytest.raises(ValueError) as err:
            TlsConfig(**files)
        assert fragment in str(err.value)


def test_tandem_serve_refuses_a_ca_without_its_own_certificate(pki):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tandem.cli.main",
            "serve",
            "router",
            "--workers",
            "127.0.0.1:1",
            "--tls-ca",
            str(pki["ca"].cert),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and "--tls-ca needs --tls-cert and --tls-key" in proc.stderr


def test_tandem_up_hands_tls_and_the_cluster_token_to_its_children(pki, model_dirs):
    """`tandem up` with TLS flags and TANDEM_CLUSTER_TOKEN: the children serve TLS, the workers
    demand the token, and no process shows the token on its command line."""
    token = "up-test-token-" + "z" * 20
    port = free_port()
    argv = [
        sys.executable,
        "-m",
        "tandem.cli.main",
        "up",
        "--both",
        "1",
        "--port",
        str(port),
        "--model",
        str(model_dirs["llama"]),
        "--num-blocks",
        "32",
        "--tls-cert",
        str(pki["node"].cert),
        "--tls-key",
        str(pki["node"].key),
        "--tls-ca",
        str(pki["ca"].cert),
        "--tls-client-auth",
        "none",
        "--metrics-port",
        str(free_port()),
    ]
    # The SIGINT below stops it even when pytest runs as a background job, whose children inherit
    # SIGINT ignored (`tandem up` installs its own handler).
    up = subprocess.Popen(
        argv,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=dict(os.environ, TANDEM_CLUSTER_TOKEN=token),
        start_new_session=True,
    )
    try:
        lines = []
        for line in up.stdout:
            lines.append(line)
            if "serving on" in line or "Traceback" in line:
                break
        assert "serving on" in lines[-1] and f"--tls-ca {pki['ca'].cert}" in lines[-1], "".join(
            lines
        )
        (worker,) = [line.split()[1] for line in lines if line.strip().startswith("both-1")]
        with LLM(f"127.0.0.1:{port}", root_certificates=str(pki["ca"].cert)) as llm:
            assert (
                len(llm.generate("up over TLS", PARAMS, use_tqdm=False).outputs[0].token_ids) == 6
            )
        operator = {
            "root_certificates": str(pki["ca"].cert),
            "certificate_chain": str(pki["client"].cert),
            "private_key": str(pki["client"].key),
        }
        with LLM(worker, **operator) as llm:
            assert _code(lambda: llm.get_kv_cache_capacity()) == grpc.StatusCode.UNAUTHENTICATED
        with LLM(worker, cluster_token=token, **operator) as llm:
            assert llm.get_kv_cache_capacity()["maxNumBlocks"] == 32
        for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
            try:
                assert token.encode() not in cmdline.read_bytes()
            except OSError:  # the process ended meanwhile
                pass
    finally:
        os.killpg(up.pid, signal.SIGINT)
        assert up.wait(timeout=60) == 0


def test_a_client_aborts_its_request_through_another_router(pki, model_dirs, tmp_path):
    """Two routers with client certificates: the client's Abort on the router that does not
    carry its stream reaches the request (the workers know its client), another client's does
    not, and the stream ends cancelled with every block free."""
    import asyncio

    from tandem.client import AsyncLLM

    tls = TlsConfig(str(pki["node"].cert), str(pki["node"].key), str(pki["ca"].cert))
    # gRPC names a TLS peer by its certificate's subject alternative names: one name a client.
    client = pki["ca"].issue(tmp_path, "client-a", hosts=("client-a.example",))
    other_client = pki["ca"].issue(tmp_path, "client-b", hosts=("client-b.example",))

    def identity(cert):
        return {
            "root_certificates": pki["ca"].cert.read_bytes(),
            "certificate_chain": cert.cert.read_bytes(),
            "private_key": cert.key.read_bytes(),
        }

    with LocalCluster(
        roles=["both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "256",
            "--block-size",
            "8",
        ],
        tls=tls,
    ) as c:
        second = c.add_router("router-2", [])

        async def go():
            streaming = await AsyncLLM(c.address, **identity(client))
            same_client = await AsyncLLM(second.address, **identity(client))
            stranger = await AsyncLLM(second.address, **identity(other_client))
            try:
                return await abort_while_streaming(
                    streaming,
                    [
                        stranger.abort,
                        same_client.abort,
                        lambda _: same_client.abort("no-such-request"),
                    ],
                )
            finally:
                for llm in (streaming, same_client, stranger):
                    llm.close()

        out, verdicts = asyncio.run(asyncio.wait_for(go(), 120))
        assert verdicts == [False, True, False]
        assert out.outputs[0].finish_reason == "cancelled"
        assert len(out.outputs[0].token_ids) < 1500
        with LLM(c.address, **identity(client)) as llm:
            assert_all_blocks_free(llm)
