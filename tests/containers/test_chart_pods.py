"""The chart's pods, run for real: render deploy/helm/tandem with values-cpu.yaml, run each pod's
exact command, args, env, securityContext and volumes under Docker on two "nodes" (two network
namespaces on an internal bridge: the router and the prefill on one, the decode on the other) with
the Services' DNS names resolved there (pod_runner.py), wait for the gRPC startup probes as kubelet
would, serve a request through the router Service's name with its KV pulled from the prefill's
node over TCP (the chart's default KV transport values), then delete the pods as kubelet would
(preStop, SIGTERM, termination grace) with a stream in flight on the decode pod."""

from __future__ import annotations

import json
import threading
import time

import helm_python as helm
import pytest
import yaml
from container_harness import ROOT, cpu_image, docker_client, logs
from pod_runner import PodRunner, Release, rendered_secrets

pytestmark = pytest.mark.timeout(1800)  # the first test may build the image from nothing

CHART_DIR = ROOT / "deploy" / "helm" / "tandem"
RELEASE, NAMESPACE = "llm", "serving"
# Stands in for `kubectl create secret generic tandem-admin --from-literal=token=...`.
SECRETS = {"tandem-admin": {"token": "chart-pods-test-token"}}
READY_TIMEOUT_S = 300

CLIENT_SCRIPT = r"""
import json, sys
import grpc
from tandem.v1 import llm_pb2, llm_pb2_grpc, types_pb2
target, ids, max_tokens, ignore_eos = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "1"
request = llm_pb2.GenerateRequest(prompt=types_pb2.Prompt(token_ids=types_pb2.TokenIds(ids=ids)), streaming=True,
                                  sampling_params=types_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=ignore_eos))
tokens, reason = [], None
with grpc.insecure_channel(target) as channel:
    for output in llm_pb2_grpc.AsyncLLMStub(channel).Generate(request, timeout=120):
        tokens += output.outputs[0].token_ids
        reason = types_pb2.FinishReason.Name(output.outputs[0].finish_reason)
        print(json.dumps({"num_tokens": len(tokens)}), flush=True)
print(json.dumps({"token_ids": tokens, "finish_reason": reason}), flush=True)
"""

# This namespace's ESTABLISHED TCP connections as (local port, remote address, remote port).
CONNECTIONS_SCRIPT = r"""
import json, socket, struct
found = []
for line in open("/proc/net/tcp").read().splitlines()[1:]:
    fields = line.split()
    if fields[3] != "01":
        continue
    (_, local_port), (remote_ip, remote_port) = (f.split(":") for f in fields[1:3])
    found.append([int(local_port, 16), socket.inet_ntoa(struct.pack("<I", int(remote_ip, 16))), int(remote_port, 16)])
print(json.dumps(found))
"""


def _render(image: str) -> list[dict]:
    repository, tag = image.split(":", 1)
    values = yaml.safe_load((CHART_DIR / "values-cpu.yaml").read_text())
    # The chart's model (SmolLM2) is the product's; the tiny model baked beside it keeps this fast,
    # and transformers is its oracle.
    values |= {
        "image": {**values["image"], "repository": repository, "tag": tag},
        "adminToken": {"secretName": "tandem-admin", "secretKey": "token"},
        "model": {"source": "image", "path": "/opt/tandem/models/tiny-llama-v2"},
    }
    with helm.Chart.load(CHART_DIR) as chart:
        manifests = chart.render(values=values, name=RELEASE, namespace=NAMESPACE)
    return [doc for text in manifests.values() for doc in yaml.safe_load_all(text) if doc]


def _by_component(release: Release) -> dict:
    return {pod.main["name"]: pod for pod in release.pods}


def _router_target(docs: list[dict]) -> str:
    (svc,) = [
        d for d in docs if d["kind"] == "Service" and d["metadata"]["name"].endswith("-router")
    ]
    return (
        f"{svc['metadata']['name']}.{NAMESPACE}.svc.cluster.local:{svc['spec']['ports'][0]['port']}"
    )


def _assert_kv_crossed_nodes_over_tcp(runner: PodRunner, pods: dict, docs: list[dict]) -> None:
    """The decode pulled the request's KV (its kv_pull_bytes counter), and its node holds an
    outgoing TCP connection to the prefill's node on a port no Service or container declares:
    UCX's own listener, i.e. the KV moved over TCP between the two namespaces."""
    metrics_port = next(
        p["containerPort"] for p in pods["decode"].main["ports"] if p["name"] == "metrics"
    )
    decode_host = next(
        n for n in runner.release.dns_pods if n.startswith(pods["decode"].name + ".")
    )
    scraped = runner.exec(
        [
            "python3",
            "-c",
            "import sys, urllib.request; print(urllib.request.urlopen(sys.argv[1], timeout=10).read().decode())",
            f"http://{decode_host}:{metrics_port}/metrics",
        ]
    )
    pulled = [
        float(line.rsplit(" ", 1)[1])
        for line in scraped.splitlines()
        if line.startswith("tandem:kv_pull_bytes_total{")
    ]
    handoffs = [line for line in scraped.splitlines() if "kv_handoff" in line or "kv_pull" in line]
    assert pulled and sum(pulled) > 0, (
        f"the decode pulled no KV: {handoffs}\n{logs(pods['decode'].container)[-4000:]}"
    )
    declared = {
        p["containerPort"]
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
        for p in c.get("ports", [])
    }
    connections = json.loads(runner.exec_on("b", ["python3", "-c", CONNECTIONS_SCRIPT]))
    kv_links = [
        (local, remote, port)
        for local, remote, port in connections
        if remote == runner.addresses["a"] and local not in declared and port not in declared
    ]
    assert kv_links, (
        f"no TCP connection from the decode's node to UCX on the prefill's: {connections}"
    )
    print(f"[chart-pods] KV pulled across nodes: {sum(pulled):.0f} bytes, TCP links {kv_links}")


def test_chart_pods_serve_through_the_router_service_and_drain_on_deletion(oracle, model_dirs):
    started = time.monotonic()
    client = docker_client()
    image = cpu_image()
    docs = _render(image)
    release = Release.from_manifests(docs, NAMESPACE)
    pods = _by_component(release)
    assert sorted(pods) == ["decode", "prefill", "router"]
    target = _router_target(docs)
    nodes = {pods["router"].name: "a", pods["prefill"].name: "a", pods["decode"].name: "b"}
    secrets = SECRETS | rendered_secrets(docs)
    with PodRunner(client, image, release, secrets, nodes) as runner:
        runner.wait_ready(READY_TIMEOUT_S)
        print("[chart-pods] ready after", {p.name: round(p.ready_after_s, 1) for p in release.pods})

        prompt = [1, 31, 7, 77, 5, 250]
        served = json.loads(
            runner.exec(
                ["python3", "-c", CLIENT_SCRIPT, target, json.dumps(prompt), "16", "0"]
            ).splitlines()[-1]
        )
        assert served["token_ids"] == oracle(model_dirs["llama"]).greedy(prompt, 16)
        _assert_kv_crossed_nodes_over_tcp(runner, pods, docs)

        # Delete the decode pod while it streams: the stream ends whole, the process exits 0 in its grace.
        stream = runner.holder.client.api.exec_create(
            runner.holder.id,
            ["python3", "-c", CLIENT_SCRIPT, target, json.dumps(prompt), "300", "1"],
        )
        lines: list[str] = []  # the script's complete JSON lines, as they arrive
        first_tokens = threading.Event()

        def read() -> None:
            pending = b""
            for chunk in runner.holder.client.api.exec_start(stream["Id"], stream=True):
                *complete, pending = (pending + chunk).split(b"\n")
                lines.extend(line.decode() for line in complete if line.startswith(b"{"))
                if lines:
                    first_tokens.set()

        reader = threading.Thread(target=read)
        reader.start()
        assert first_tokens.wait(60), "the stream did not start"
        streamed_before_sigterm = json.loads(lines[-1]).get("num_tokens")
        code, took_s = runner.terminate(pods["decode"])
        reader.join(60)
        decode_log = pods["decode"].container.logs().decode(errors="replace")
        assert code == 0, decode_log[-3000:]
        assert took_s < pods["decode"].spec["terminationGracePeriodSeconds"]
        final = json.loads(lines[-1])
        assert (
            len(final["token_ids"]) == 300 and final["finish_reason"] == "FINISH_REASON_LENGTH"
        ), lines[-3:]
        assert streamed_before_sigterm is not None and streamed_before_sigterm < 300, (
            "SIGTERM came mid-stream"
        )
        assert "drained" in decode_log
        print(
            f"[chart-pods] decode deleted mid-stream (at {streamed_before_sigterm}/300 tokens): exit 0 "
            f"after {took_s:.1f} s"
        )

        for name in ("router", "prefill"):
            code, took_s = runner.terminate(pods[name])
            assert code == 0, logs(pods[name].container)
            assert took_s < pods[name].spec["terminationGracePeriodSeconds"]
            print(f"[chart-pods] {name} deleted: exit 0 after {took_s:.1f} s")
    print(f"[chart-pods] done in {time.monotonic() - started:.0f} s")
