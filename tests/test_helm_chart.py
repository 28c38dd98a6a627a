"""The Helm chart: lint, render, Kubernetes-schema validation, wiring, values schema, golden renders.

Needs helm-python-sdk (Helm's Go SDK through ctypes: no helm binary), kubernetes-validate and pyyaml.
TANDEM_UPDATE_GOLDEN=1 rewrites tests/golden/helm/*.yaml from the current chart.
"""

from __future__ import annotations

import base64
import dataclasses
import importlib.util
import json
import os
import re
from pathlib import Path

# `make install` installs these; a missing one is a broken install, so the import fails loudly.
import helm_python as helm
import kubernetes_validate
import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
CHART_DIR = ROOT / "deploy" / "helm" / "tandem"
GOLDEN_DIR = ROOT / "tests" / "golden" / "helm"
RELEASE, NAMESPACE = "llm", "serving"
KUBE_VERSION = "1.35.0"

CPU_VALUES = yaml.safe_load((CHART_DIR / "values-cpu.yaml").read_text())
VALUE_SETS = {
    "default": {},
    "cpu": CPU_VALUES,
    "disaggregated": {
        "model": {"source": "pvc", "claimName": "models", "path": "Llama-3.1-8B-Instruct"},
        "engine": {"dtype": "bfloat16"},
        "prefill": {
            "replicas": 2,
            "gpus": 2,
            "resources": {"requests": {"cpu": "4", "memory": "16Gi"}},
        },
        "decode": {
            "replicas": 3,
            "kvCacheGb": 40,
            "tensorParallelSize": 2,
            "resources": {"limits": {"memory": "64Gi"}},
            "nodeSelector": {"nvidia.com/gpu.present": "true"},
            "tolerations": [
                {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}
            ],
        },
        "podDisruptionBudget": {"enabled": True},
        "adminToken": {"secretName": "tandem-admin"},
        "drain": {"seconds": 120, "routerPreStopSeconds": 10},
        "networkPolicy": {
            "enabled": True,
            "routerFrom": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        },
        "metrics": {
            "serviceMonitor": {"enabled": True, "labels": {"release": "kube-prometheus-stack"}}
        },
    },
    "aggregated": {
        "model": {"source": "hostPath", "hostPath": "/mnt/models", "path": "qwen3"},
        "prefill": {"replicas": 0},
        "decode": {"replicas": 0},
        "both": {
            "replicas": 2,
            "numBlocks": 4096,
            "maxNumBatchedTokens": 1048576,
            "extraArgs": ["--seed", "7"],
        },
        "metrics": {"enabled": False},
    },
    "secured": {
        "tls": {
            "enabled": True,
            "secretName": "tandem-tls",
            "routerClientAuth": "none",
            "serverName": "tandem.internal",
        },
        "clusterToken": {"secretName": "tandem-cluster", "secretKey": "cluster-token"},
        "adminToken": {"secretName": "tandem-admin"},
        "networkPolicy": {
            "extraWorkerIngress": [{"namespaceSelector": {"matchLabels": {"name": "monitoring"}}}]
        },
    },
}
# The token the chart generates is random: golden renders hold a placeholder.
RANDOM_TOKEN = re.compile(r'^(  token: )"[A-Za-z0-9+/=]{64}"$', re.MULTILINE)


@pytest.fixture(scope="module")
def chart():
    with helm.Chart.load(CHART_DIR) as loaded:
        yield loaded


def chart_version() -> str:
    return yaml.safe_load((CHART_DIR / "Chart.yaml").read_text())["appVersion"]


def render(chart, values: dict) -> dict[str, str]:
    return chart.render(values=values, name=RELEASE, namespace=NAMESPACE)


def objects(chart, values: dict) -> list[dict]:
    return [
        doc for text in render(chart, values).values() for doc in yaml.safe_load_all(text) if doc
    ]


def by_kind(docs: list[dict], kind: str) -> list[dict]:
    return [d for d in docs if d["kind"] == kind]


def containers(docs: list[dict]) -> list[dict]:
    return [
        c
        for d in docs
        if d["kind"] in ("Deployment", "StatefulSet")
        for c in d["spec"]["template"]["spec"]["containers"]
    ]


def flag(container: dict, name: str) -> str | None:
    values = [a.split("=", 1)[1] for a in container["args"] if a.startswith(f"--{name}=")]
    return values[0] if values else None


@pytest.mark.parametrize("case", VALUE_SETS)
def test_lint_is_clean(case):
    report = helm.lint(
        CHART_DIR,
        VALUE_SETS[case],
        strict=True,
        namespace=NAMESPACE,
        kube_version=f"v{KUBE_VERSION}",
    )
    assert report["errors"] == []
    assert [m for m in report["messages"] if m["severity"] >= 2] == []


@pytest.mark.parametrize("case", VALUE_SETS)
def test_manifests_are_valid_kubernetes(chart, case):
    docs = objects(chart, VALUE_SETS[case])
    assert docs
    for doc in docs:
        if doc["apiVersion"].startswith("monitoring.coreos.com/"):
            continue  # a CRD: test_service_monitor_scrapes_every_service checks it
        kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)


@pytest.mark.parametrize("case", VALUE_SETS)
def test_router_finds_exactly_the_worker_pods(chart, case):
    """By DNS, each role's headless Service (publishing not-ready pods: the router checks their
    health itself), so `kubectl scale` needs no re-render; statically (router.discovery=static,
    or TLS without a serverName), the rendered pods by name."""
    values = helm.Chart.merge_values(chart, VALUE_SETS[case])
    for discovery in ("dns", "static"):
        overrides = dict(
            VALUE_SETS[case], router={**VALUE_SETS[case].get("router", {}), "discovery": discovery}
        )
        docs = objects(chart, overrides)
        headless = {
            s["metadata"]["name"]: s
            for s in by_kind(docs, "Service")
            if s["spec"].get("clusterIP") == "None"
        }
        expected_pods, expected_services = [], []
        for sts in by_kind(docs, "StatefulSet"):
            role = sts["metadata"]["labels"]["app.kubernetes.io/component"]
            assert sts["spec"]["replicas"] == values[role]["replicas"] > 0
            svc = sts["spec"]["serviceName"]
            assert svc in headless and headless[svc]["spec"]["publishNotReadyAddresses"] is True
            port = sts["spec"]["template"]["spec"]["containers"][0]["ports"][0]["containerPort"]
            expected_pods += [
                f"{sts['metadata']['name']}-{i}.{svc}.{NAMESPACE}.svc.cluster.local:{port}"
                for i in range(sts["spec"]["replicas"])
            ]
            expected_services.append(f"{role}={svc}.{NAMESPACE}.svc.cluster.local:{port}")
        assert len(expected_pods) == sum(
            values[r]["replicas"] for r in ("prefill", "decode", "both")
        )
        (router,) = [
            d for d in by_kind(docs, "Deployment") if d["metadata"]["name"].endswith("-router")
        ]
        container = router["spec"]["template"]["spec"]["containers"][0]
        by_dns = discovery == "dns" and (
            not values["tls"]["enabled"] or values["tls"]["serverName"]
        )
        if by_dns:
            assert flag(container, "workers") is None
            assert sorted(flag(container, "workers-dns").split(",")) == sorted(expected_services)
        else:
            assert flag(container, "workers-dns") is None
            assert sorted(flag(container, "workers").split(",")) == sorted(expected_pods)


def test_router_flags_follow_the_values(chart):
    docs = objects(
        chart,
        {
            "router": {
                "routing": "prefill=kv,decode=least-load",
                "disaggMinUncachedTokens": 256,
                "maxInFlight": 64,
                "streamInterval": 4,
            }
        },
    )
    (router,) = by_kind(docs, "Deployment")
    container = router["spec"]["template"]["spec"]["containers"][0]
    assert [
        flag(container, f)
        for f in ("routing", "disagg-min-uncached-tokens", "max-in-flight", "stream-interval")
    ] == ["prefill=kv,decode=least-load", "256", "64", "4"]


@pytest.mark.parametrize("case", VALUE_SETS)
def test_probes_are_grpc_health_checks_on_the_serving_port(chart, case):
    """On the serving port; with TLS on the plaintext health-only port (kubelet probes speak no TLS)."""
    tls = VALUE_SETS[case].get("tls", {}).get("enabled", False)
    for container in containers(objects(chart, VALUE_SETS[case])):
        port = container["ports"][0]["containerPort"]
        assert flag(container, "port") == str(port)
        if container["name"] == "openai":  # HTTP (test_the_openai_front_...)
            continue
        if tls:
            assert container["ports"][1] == {"name": "health", "containerPort": 50060}
            assert flag(container, "health-port") == "50060"
            port = 50060
        for probe in ("startupProbe", "readinessProbe"):
            assert container[probe]["grpc"] == {"port": port}
        # Liveness: the process answers (not "can route": a router with a role down is alive).
        assert container["livenessProbe"]["grpc"] == {"port": port, "service": "tandem.liveness"}
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert not {"httpGet", "tcpSocket", "exec"} & container[probe].keys()


def test_router_service_is_cluster_ip_on_50051(chart):
    (svc,) = [
        s
        for s in by_kind(objects(chart, {}), "Service")
        if s["metadata"]["name"].endswith("-router")
    ]
    assert svc["spec"]["type"] == "ClusterIP" and svc["spec"]["ports"][0]["port"] == 50051


def test_workers_run_on_gpus_by_default(chart):
    by_role = {c["name"]: c for c in containers(objects(chart, {}))}
    for role in ("prefill", "decode"):
        assert flag(by_role[role], "device") == "cuda"
        assert by_role[role]["resources"] == {
            "limits": {"nvidia.com/gpu": 1},
            "requests": {"nvidia.com/gpu": 1},
        }
    assert "resources" not in by_role["router"]
    (image,) = {c["image"] for c in by_role.values()}
    assert image == f"tandem:{chart_version()}-gpu"


def test_gpu_requests_merge_with_resources(chart):
    by_role = {c["name"]: c for c in containers(objects(chart, VALUE_SETS["disaggregated"]))}
    assert by_role["decode"]["resources"] == {
        "limits": {"nvidia.com/gpu": 2, "memory": "64Gi"},
        "requests": {"nvidia.com/gpu": 2},
    }
    assert by_role["prefill"]["resources"] == {
        "limits": {"nvidia.com/gpu": 2},
        "requests": {"nvidia.com/gpu": 2, "cpu": "4", "memory": "16Gi"},
    }


def test_tensor_parallel_size_per_role_sets_the_flag_and_the_gpu_request(chart):
    by_role = {c["name"]: c for c in containers(objects(chart, VALUE_SETS["disaggregated"]))}
    assert (
        flag(by_role["decode"], "tensor-parallel-size") == "2"
        and flag(by_role["decode"], "max-loras") == "0"
    )
    assert "--tensor-parallel-size" not in " ".join(by_role["prefill"]["args"])
    # gpus 2 on a TP-1 prefill stays 2; the request is whichever is larger.
    assert by_role["prefill"]["resources"]["limits"]["nvidia.com/gpu"] == 2
    cpu = {
        c["name"]: c
        for c in containers(
            objects(
                chart,
                {**CPU_VALUES, "decode": {**CPU_VALUES.get("decode", {}), "tensorParallelSize": 2}},
            )
        )
    }
    assert flag(cpu["decode"], "tensor-parallel-size") == "2"
    assert "nvidia.com/gpu" not in str(cpu["decode"].get("resources"))
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"decode": {"tensorParallelSize": 0}})


def test_cpu_values_request_no_gpu_and_use_the_cpu_image(chart):
    docs = objects(chart, CPU_VALUES)
    assert "nvidia.com/gpu" not in yaml.safe_dump(docs)
    for c in containers(docs):
        assert c["image"] == f"tandem:{chart_version()}-cpu"
        if c["name"] != "router":
            assert flag(c, "device") == "cpu"
    ports = [c["ports"][0]["containerPort"] for c in containers(docs)]
    assert len(ports) == len(set(ports)), (
        "the roles' ports differ, so the release fits one network namespace"
    )


def test_make_image_builds_the_tags_the_chart_runs():
    spec = importlib.util.spec_from_file_location(
        "tandem_image_build", ROOT / "deploy" / "image" / "build.py"
    )
    build = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(build)
    default_tag = build.default_tag
    assert default_tag("cpu") == f"tandem:{chart_version()}-cpu"
    assert default_tag("gpu") == f"tandem:{chart_version()}-gpu"


@pytest.mark.parametrize(
    "case, model_flag",
    [
        ("default", "/opt/tandem/models/SmolLM2-135M-Instruct.Q4_1.gguf"),
        ("disaggregated", "/models/Llama-3.1-8B-Instruct"),
        ("aggregated", "/models/qwen3"),
    ],
)
def test_model_source(chart, case, model_flag):
    docs = objects(chart, VALUE_SETS[case])
    for sts in by_kind(docs, "StatefulSet"):
        pod = sts["spec"]["template"]["spec"]
        assert flag(pod["containers"][0], "model") == model_flag
        assert any(v["name"] == "model" for v in pod["volumes"]) == model_flag.startswith(
            "/models/"
        )


@pytest.mark.parametrize("case", VALUE_SETS)
def test_drain_preStop_and_termination_grace_agree(chart, case):
    drain = helm.Chart.merge_values(chart, VALUE_SETS[case])["drain"]
    for d in by_kind(objects(chart, VALUE_SETS[case]), "Deployment") + by_kind(
        objects(chart, VALUE_SETS[case]), "StatefulSet"
    ):
        pod = d["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        # The OpenAI front's drain is its --shutdown-timeout.
        drain_flag = "shutdown-timeout" if container["name"] == "openai" else "drain-seconds"
        assert flag(container, drain_flag) == str(drain["seconds"])
        pre_stop = container.get("lifecycle", {}).get("preStop")
        if container["name"] == "router":
            assert pre_stop == {"exec": {"command": ["sleep", str(drain["routerPreStopSeconds"])]}}
            waited = drain["routerPreStopSeconds"]
        else:
            assert pre_stop is None, (
                "a worker's router sees NOT_SERVING itself: nothing to wait for"
            )
            waited = 0
        assert (
            pod["terminationGracePeriodSeconds"] == waited + drain["seconds"] + drain["exitSeconds"]
        )


def test_network_policies_are_on_by_default(chart):
    assert len(by_kind(objects(chart, {}), "NetworkPolicy")) == 2
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in by_kind(objects(chart, VALUE_SETS["disaggregated"]), "NetworkPolicy")
    }
    router, workers = policies[f"{RELEASE}-tandem-router"], policies[f"{RELEASE}-tandem-workers"]
    scrape = {
        "ports": [{"port": "metrics"}]
    }  # metrics.enabled: Prometheus, from anywhere (metricsFrom empty)
    assert router["ingress"] == [
        {
            "ports": [{"port": "grpc"}],
            "from": [{"namespaceSelector": {"matchLabels": {"team": "apps"}}}],
        },
        scrape,
    ]
    assert workers["podSelector"]["matchExpressions"][0]["values"] == ["prefill", "decode", "both"]
    assert (
        workers["ingress"][0]["from"][0]["podSelector"]["matchLabels"]["app.kubernetes.io/instance"]
        == RELEASE
    )
    assert workers["ingress"][1:] == [scrape]
    no_metrics = dict(VALUE_SETS["disaggregated"], metrics={"enabled": False})
    policies = {
        p["metadata"]["name"]: p["spec"]
        for p in by_kind(objects(chart, no_metrics), "NetworkPolicy")
    }
    assert all(len(p["ingress"]) == 1 for p in policies.values())


def test_large_integers_render_as_integers(chart):
    (sts,) = by_kind(objects(chart, VALUE_SETS["aggregated"]), "StatefulSet")
    assert (
        flag(sts["spec"]["template"]["spec"]["containers"][0], "max-num-batched-tokens")
        == "1048576"
    )


def test_admin_token_comes_from_the_secret_in_every_process(chart):
    for c in containers(objects(chart, VALUE_SETS["disaggregated"])):
        (env,) = [e for e in c["env"] if e["name"] == "TANDEM_ADMIN_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"] == {"name": "tandem-admin", "key": "token"}
    assert all(
        "TANDEM_ADMIN_TOKEN" not in str(c["env"])
        for c in containers(objects(chart, VALUE_SETS["default"]))
    )


def test_every_process_gets_the_cluster_token(chart):
    """Generated into a Secret of the release unless one is named; every container reads it."""
    docs = objects(chart, VALUE_SETS["default"])
    (secret,) = by_kind(docs, "Secret")
    assert secret["metadata"]["name"] == f"{RELEASE}-tandem-cluster-token"
    assert len(base64.b64decode(secret["data"]["token"])) == 48
    for c in containers(docs):
        (env,) = [e for e in c["env"] if e["name"] == "TANDEM_CLUSTER_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"] == {
            "name": secret["metadata"]["name"],
            "key": "token",
        }
    named = objects(chart, VALUE_SETS["secured"])
    assert by_kind(named, "Secret") == []
    for c in containers(named):
        (env,) = [e for e in c["env"] if e["name"] == "TANDEM_CLUSTER_TOKEN"]
        assert env["valueFrom"]["secretKeyRef"] == {
            "name": "tandem-cluster",
            "key": "cluster-token",
        }


def test_tls_mounts_the_secret_and_passes_the_flags(chart):
    docs = objects(chart, VALUE_SETS["secured"])
    for d in docs:
        if d["kind"] not in ("Deployment", "StatefulSet"):
            continue
        pod = d["spec"]["template"]["spec"]
        (volume,) = [v for v in pod["volumes"] if v["name"] == "tls"]
        assert volume["secret"]["secretName"] == "tandem-tls"
        (container,) = pod["containers"]
        assert {"name": "tls", "mountPath": "/etc/tandem/tls", "readOnly": True} in container[
            "volumeMounts"
        ]
        assert [
            flag(container, f) for f in ("tls-cert", "tls-key", "tls-ca", "tls-server-name")
        ] == [
            "/etc/tandem/tls/tls.crt",
            "/etc/tandem/tls/tls.key",
            "/etc/tandem/tls/ca.crt",
            "tandem.internal",
        ]
        is_router = d["kind"] == "Deployment"
        assert flag(container, "tls-client-auth") == ("none" if is_router else None)
    assert all(
        flag(c, "tls-cert") is None for c in containers(objects(chart, VALUE_SETS["default"]))
    )


def test_network_policy_admits_only_the_release_to_the_workers(chart):
    (policy,) = [
        p
        for p in by_kind(objects(chart, VALUE_SETS["secured"]), "NetworkPolicy")
        if p["metadata"]["name"] == f"{RELEASE}-tandem-workers"
    ]
    selector = policy["spec"]["podSelector"]
    assert selector["matchExpressions"] == [
        {
            "key": "app.kubernetes.io/component",
            "operator": "In",
            "values": ["prefill", "decode", "both"],
        }
    ]
    assert policy["spec"]["policyTypes"] == ["Ingress"]
    rule, *scrape = policy["spec"]["ingress"]
    assert scrape == [
        {"ports": [{"port": "metrics"}]}
    ]  # Prometheus, from anywhere (metricsFrom empty)
    assert "ports" not in rule  # gRPC and the UCX ports NIXL picks at run time
    assert rule["from"] == [
        {
            "podSelector": {
                "matchLabels": {
                    "app.kubernetes.io/name": "tandem",
                    "app.kubernetes.io/instance": RELEASE,
                },
                # Not the release's OpenAI front (a public face, whose calls go to the router).
                "matchExpressions": [
                    {
                        "key": "app.kubernetes.io/component",
                        "operator": "In",
                        "values": ["router", "prefill", "decode", "both"],
                    }
                ],
            }
        },
        {"namespaceSelector": {"matchLabels": {"name": "monitoring"}}},
    ]
    assert by_kind(objects(chart, {"networkPolicy": {"enabled": False}}), "NetworkPolicy") == []


def test_pods_run_as_non_root(chart):
    docs = objects(chart, VALUE_SETS["disaggregated"])
    for d in docs:
        if d["kind"] in ("Deployment", "StatefulSet"):
            assert d["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert all(c["securityContext"]["allowPrivilegeEscalation"] is False for c in containers(docs))
    assert len(by_kind(docs, "PodDisruptionBudget")) == 3


def test_long_names_are_truncated_to_dns_labels(chart):
    docs = objects(chart, {"fullnameOverride": "x" * 63, "both": {"replicas": 1}})
    for sts in by_kind(docs, "StatefulSet"):
        # the controller-revision-hash label is "<name>-<10 chars>" and must stay a 63-char label
        assert len(sts["metadata"]["name"]) <= 52
    router = by_kind(docs, "Deployment")[0]["spec"]["template"]["spec"]["containers"][0]
    assert all(
        len(label) <= 63
        for name in flag(router, "workers-dns").split(",")
        for label in name.split("=", 1)[1].rsplit(":", 1)[0].split(".")
    )


def pod_templates(docs: list[dict]) -> list[dict]:
    return [d["spec"]["template"] for d in docs if d["kind"] in ("Deployment", "StatefulSet")]


@pytest.mark.parametrize("case", ["default", "disaggregated"])
def test_every_pod_is_scraped_on_its_metrics_port(chart, case):
    docs = objects(chart, VALUE_SETS[case])
    values = helm.Chart.merge_values(chart, VALUE_SETS[case])
    templates = pod_templates(docs)
    assert len(templates) == len(by_kind(docs, "Service")) >= 3
    for template in templates:
        (container,) = template["spec"]["containers"]
        role = template["metadata"]["labels"]["app.kubernetes.io/component"]
        (port,) = [p["containerPort"] for p in container["ports"] if p["name"] == "metrics"]
        assert port == values[role]["metricsPort"] and flag(container, "metrics-port") == str(port)
        assert template["metadata"]["annotations"] == {
            "prometheus.io/scrape": "true",
            "prometheus.io/port": str(port),
            "prometheus.io/path": "/metrics",
        }
    for svc in by_kind(docs, "Service"):
        (port,) = [p for p in svc["spec"]["ports"] if p["name"] == "metrics"]
        assert port["targetPort"] == "metrics"


def test_metrics_off_is_no_port_no_annotation(chart):
    docs = objects(chart, VALUE_SETS["aggregated"])
    for template in pod_templates(docs):
        (container,) = template["spec"]["containers"]
        assert flag(container, "metrics-port") == "0"
        assert "annotations" not in template["metadata"] and [
            p["name"] for p in container["ports"]
        ] == ["grpc"]
    assert all(
        [p["name"] for p in svc["spec"]["ports"]] == ["grpc"] for svc in by_kind(docs, "Service")
    )
    assert not by_kind(docs, "ServiceMonitor")


def test_service_monitor_scrapes_every_service(chart):
    assert not by_kind(
        objects(chart, {}), "ServiceMonitor"
    )  # opt-in: it needs prometheus-operator's CRD
    docs = objects(chart, VALUE_SETS["disaggregated"])
    (monitor,) = by_kind(docs, "ServiceMonitor")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    spec = monitor["spec"]
    assert spec["namespaceSelector"] == {"matchNames": [NAMESPACE]}
    assert spec["endpoints"] == [
        {"port": "metrics", "path": "/metrics", "interval": "15s", "scrapeTimeout": "10s"}
    ]
    selected = [
        svc
        for svc in by_kind(docs, "Service")
        if spec["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    ]
    assert {s["metadata"]["labels"]["app.kubernetes.io/component"] for s in selected} == {
        "router",
        "prefill",
        "decode",
    }
    assert len(selected) == len(by_kind(docs, "Service"))


@pytest.mark.parametrize(
    "bad",
    [
        {"prefill": {"replicas": -1}},
        {"mixed": {"replicas": 1}},
        {"decode": {"replica": 2}},
        {"both": {"device": "tpu"}},
        {"router": {"port": 70000}},
        {"model": {"source": "pvc"}},
        {"model": {"source": "s3"}},
        {"model": {"source": "pvc", "claimName": "models", "path": "/abs"}},
        {"model": {"path": "relative/in/the/image"}},
        {"image": {"variant": "tpu"}},
        {"drain": {"seconds": -1}},
        {"drain": {"seconds": 1.5}},
        {"terminationGracePeriodSeconds": 30},
        {"engine": {"dtype": "int4"}},
        {"router": {"metricsPort": 0}},
        {"router": {"discovery": "consul"}},
        {"router": {"routing": "prefill=fastest"}},
        {"router": {"maxInFlight": 0}},
        {"router": {"streamInterval": 0}},
        {"router": {"streamInterval": 257}},
        {"metrics": {"serviceMonitor": {"interval": "often"}}},
        {"metrics": {"scrape": True}},
        {"tls": {"enabled": True}},
        {"tls": {"routerClientAuth": "optional"}},
        {"probes": {"healthPort": 0}},
        {"decode": {"cudaIpcGetZcopy": "yes please"}},
        {"metrics": {"prometheusRule": {"recomputeShare": 0}}},
        {"metrics": {"prometheusRule": {"window": "ten minutes"}}},
        {"logFormat": "xml"},
        {"tracing": {"otlpEndpoint": "otel-collector:4318"}},
        {"autoscaling": {"enabled": True, "kind": "vpa"}},
        {"decode": {"autoscaling": {"metric": "up"}}},
        {"topologySpread": {"whenUnsatisfiable": "Sometimes"}},
        {"topologySpread": {"topologyKeys": []}},
        {"openai": {"toolCallParser": "mistral"}},
        {"openai": {"loraModules": ["no-equals-sign"]}},
        {"decode": {"hostKvCacheGb": -1}},
        {"kvTransfer": {"ucxTransports": "rc; rm -rf /"}},
        {"kvTransfer": {"rdmaResources": {"rdma/hca": 0}}},
        {"kvTransfer": {"hostNetwork": "yes"}},
    ],
    ids=lambda bad: repr(bad),
)
def test_schema_rejects_bad_values(chart, bad):
    with pytest.raises(helm.HelmValuesError):
        render(chart, bad)


def _env(container: dict) -> dict[str, str]:
    return {e["name"]: e.get("value") for e in container.get("env", [])}


def test_the_cuda_ipc_get_path_is_the_codes_default_and_values_override_it(chart):
    """The worker turns UCX's CUDA IPC get path on itself (kvtransfer/ucx_env.py): the default
    render sets nothing, so that an `env` entry of the operator's still reaches it alone."""

    def worker_env(values):
        return {
            c["name"]: _env(c) for c in containers(objects(chart, values)) if c["name"] != "router"
        }

    assert all("UCX_CUDA_IPC_ENABLE_GET_ZCOPY" not in env for env in worker_env({}).values())
    overridden = worker_env(
        {"prefill": {"cudaIpcGetZcopy": "auto"}, "decode": {"cudaIpcGetZcopy": "n"}}
    )
    assert {name: env.get("UCX_CUDA_IPC_ENABLE_GET_ZCOPY") for name, env in overridden.items()} == {
        "prefill": "auto",
        "decode": "n",
    }


def test_the_charts_router_values_default_to_the_routers_own_and_name_its_policies():
    """Each router value that is one of RouterConfig's flags (the flag's name in camelCase) has
    the router's default, and the schema's routing pattern allows exactly policies.py's names:
    the defaults and the policy names live in the code, the chart follows them."""
    from tandem.router.config import RouterConfig
    from tandem.router.policies import Policy

    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())["router"]
    checked = []
    for field in dataclasses.fields(RouterConfig):
        if "help" not in field.metadata:
            continue  # the server's settings, not flags of this config
        words = (field.metadata["flag"] or "--" + field.name.replace("_", "-"))[2:].split("-")
        key = words[0] + "".join(w.title() for w in words[1:])
        if key in values:
            assert values[key] == field.default, key
            checked.append(key)
    assert len(checked) >= 8, checked
    schema = json.loads((CHART_DIR / "values.schema.json").read_text())
    pattern = schema["properties"]["router"]["properties"]["routing"]["pattern"]
    named = set(re.findall(r"\(([a-z|-]+)\)\|\(\(prefill", pattern)[0].split("|"))
    assert named == {p.value for p in Policy}


def test_the_model_implementation_is_one_engine_value_for_every_worker(chart):
    def impls(values):
        return {
            c["name"]: flag(c, "model-impl")
            for c in containers(objects(chart, values))
            if c["name"] not in ("router", "openai")
        }

    assert set(impls({}).values()) == {None}  # auto: the worker's default
    assert set(impls({"engine": {"modelImpl": "transformers"}}).values()) == {"transformers"}
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"engine": {"modelImpl": "vllm"}})


def test_kv_transfer_renders_nothing_by_default_and_the_rdma_values_where_asked(chart):
    """Plain TCP between nodes needs no value; an RDMA setup reaches every worker pod (and no other
    pod): the UCX transports and devices, the device plugin's resource beside the GPUs, IPC_LOCK
    added to a container that still drops every other capability, and the node's network."""

    def worker_pods(values):
        return {
            d["spec"]["template"]["spec"]["containers"][0]["name"]: d["spec"]["template"]["spec"]
            for d in by_kind(objects(chart, values), "StatefulSet")
        }

    for pod in worker_pods({}).values():
        container = pod["containers"][0]
        assert not {"UCX_TLS", "UCX_NET_DEVICES"} & _env(container).keys()
        assert "add" not in container["securityContext"]["capabilities"]
        assert "hostNetwork" not in pod
    rdma = {
        "kvTransfer": {
            "ucxTransports": "rc,sm,self,cuda_copy,cuda_ipc",
            "ucxNetDevices": "mlx5_0:1,mlx5_1:1",
            "rdmaResources": {"rdma/rdma_shared_device_a": 1},
            "ipcLock": True,
            "hostNetwork": True,
        },
        "decode": {"resources": {"limits": {"memory": "64Gi"}}},
    }
    pods = worker_pods(rdma)
    assert set(pods) == {"prefill", "decode"}
    for name, pod in pods.items():
        container = pod["containers"][0]
        env = _env(container)
        assert env["UCX_TLS"] == "rc,sm,self,cuda_copy,cuda_ipc"
        assert env["UCX_NET_DEVICES"] == "mlx5_0:1,mlx5_1:1"
        for kind in ("limits", "requests"):
            assert container["resources"][kind]["rdma/rdma_shared_device_a"] == 1, (name, kind)
            assert container["resources"][kind]["nvidia.com/gpu"] == 1, (name, kind)
        assert container["securityContext"]["capabilities"] == {
            "drop": ["ALL"],
            "add": ["IPC_LOCK"],
        }
        assert pod["hostNetwork"] is True and pod["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert pods["decode"]["containers"][0]["resources"]["limits"]["memory"] == "64Gi"
    for other in containers(objects(chart, rdma)):
        if other["name"] not in pods:  # the router (and the OpenAI front) keep the defaults
            assert (
                "UCX_TLS" not in _env(other)
                and "add" not in other["securityContext"]["capabilities"]
            )


def test_a_host_kv_tier_is_rendered_only_where_a_role_asks_for_one(chart):
    def tiers(values):
        return {
            c["name"]: flag(c, "host-kv-cache-gb")
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert set(tiers({}).values()) == {None}
    assert tiers({"decode": {"hostKvCacheGb": 32}})["decode"] == "32"


def test_prefix_pulls_turn_on_the_router_and_every_worker_that_leases_prefixes(chart):
    def args(values):
        return {c["name"]: c["args"] for c in containers(objects(chart, values))}

    assert not any("--prefix-pulls" in a or "--kv-prefix-pulls" in a for a in args({}).values())
    on = args({"router": {"prefixPulls": True}, "both": {"replicas": 1}})
    assert "--prefix-pulls" in on["router"]
    assert "--kv-prefix-pulls" in on["prefill"] and "--kv-prefix-pulls" in on["both"]
    assert "--kv-prefix-pulls" not in on["decode"]  # a decode computes no prompt from its start


def test_the_router_announces_decodes_unless_the_chart_says_not(chart):
    from tandem.router.config import RouterConfig

    def router_args(values):
        return next(c["args"] for c in containers(objects(chart, values)) if c["name"] == "router")

    assert RouterConfig.announce_decode is True  # the chart's default is the router's
    assert "--no-announce-decode" not in router_args({})
    assert "--no-announce-decode" in router_args({"router": {"announceDecode": False}})
    with pytest.raises(helm.HelmValuesError):
        objects(chart, {"router": {"announceDecode": "no"}})
    assert RouterConfig.direct_handoff is True
    assert "--no-direct-handoff" not in router_args({})
    assert "--no-direct-handoff" in router_args({"router": {"directHandoff": False}})
    with pytest.raises(helm.HelmValuesError):
        objects(chart, {"router": {"directHandoff": 1}})


def test_every_component_spreads_across_nodes_unless_told_otherwise(chart):
    def spreads(values):
        return {
            o["metadata"]["name"].rsplit("-", 1)[-1]: o["spec"]["template"]["spec"].get(
                "topologySpreadConstraints"
            )
            for o in objects(chart, values)
            if o["kind"] in ("Deployment", "StatefulSet")
        }

    default = spreads({})
    assert set(default) == {"router", "prefill", "decode"}
    for component, constraints in default.items():
        (c,) = constraints
        assert c["topologyKey"] == "kubernetes.io/hostname"
        assert c["whenUnsatisfiable"] == "ScheduleAnyway"  # soft: a one-node cluster schedules
        # Each component spreads its own pods, not the release's.
        assert c["labelSelector"]["matchLabels"]["app.kubernetes.io/component"] == component
    zones = spreads(
        {
            "topologySpread": {
                "topologyKeys": ["kubernetes.io/hostname", "topology.kubernetes.io/zone"],
                "whenUnsatisfiable": "DoNotSchedule",
            }
        }
    )
    assert [c["topologyKey"] for c in zones["decode"]] == [
        "kubernetes.io/hostname",
        "topology.kubernetes.io/zone",
    ]
    own = [{"maxSkew": 2, "topologyKey": "rack", "whenUnsatisfiable": "DoNotSchedule"}]
    replaced = spreads({"decode": {"topologySpreadConstraints": own}})
    assert replaced["decode"] == own and replaced["prefill"] == default["prefill"]
    off = spreads({"topologySpread": {"enabled": False}})
    assert set(off.values()) == {None}


def test_the_openai_front_serves_the_router_with_the_key_from_its_secret(chart):
    assert not [o for o in objects(chart, {}) if "openai" in o["metadata"]["name"]]
    front = {
        "enabled": True,
        "replicas": 2,
        "servedModelName": "llama-3.1-8b",
        "toolCallParser": "llama3_json",
        "apiKey": {"secretName": "openai-key"},
    }
    docs = objects(chart, {**VALUE_SETS["disaggregated"], "openai": front})
    for doc in docs:
        if not doc["apiVersion"].startswith("monitoring.coreos.com/"):
            kubernetes_validate.validate(doc, KUBE_VERSION, strict=True)
    (deployment,) = [
        o for o in by_kind(docs, "Deployment") if o["metadata"]["name"].endswith("-openai")
    ]
    (service,) = [o for o in by_kind(docs, "Service") if o["metadata"]["name"].endswith("-openai")]
    assert deployment["spec"]["replicas"] == 2
    assert service["spec"]["ports"][0]["port"] == 8000
    (c,) = deployment["spec"]["template"]["spec"]["containers"]
    assert c["args"][:2] == ["serve", "openai"]
    assert flag(c, "target") == f"{RELEASE}-tandem-router:50051"
    assert flag(c, "served-model-name") == "llama-3.1-8b"
    assert flag(c, "tool-call-parser") == "llama3_json"
    (key,) = [e for e in c["env"] if e["name"] == "TANDEM_API_KEY"]
    assert key["valueFrom"]["secretKeyRef"] == {"name": "openai-key", "key": "api-key"}
    # Its /metrics (on the HTTP port): scraped by annotation, and by the ServiceMonitor through
    # the Service's metrics port.
    assert deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/port"] == "8000"
    (metrics,) = [p for p in service["spec"]["ports"] if p["name"] == "metrics"]
    assert metrics["targetPort"] == "http"
    assert not c.get("env") or "TANDEM_ADMIN_TOKEN" not in str(c["env"])  # no admin calls
    # Liveness: the process answers; readiness: it can route (the router's health).
    assert c["livenessProbe"]["httpGet"]["path"] == "/ping"
    assert c["readinessProbe"]["httpGet"]["path"] == "/health"
    # The workers admit the release's router and workers, not its front.
    (workers,) = [
        p
        for p in by_kind(docs, "NetworkPolicy")
        if p["metadata"]["name"] == f"{RELEASE}-tandem-workers"
    ]
    (peer,) = workers["spec"]["ingress"][0]["from"]
    assert peer["podSelector"]["matchExpressions"][0]["values"] == [
        "router",
        "prefill",
        "decode",
        "both",
    ]
    # A routerFrom that admits only some namespaces still admits the release's front.
    (policy,) = [
        p
        for p in by_kind(docs, "NetworkPolicy")
        if p["metadata"]["name"] == f"{RELEASE}-tandem-router"
    ]
    peers = policy["spec"]["ingress"][0]["from"]
    assert {"podSelector": {"matchLabels": {
        "app.kubernetes.io/name": "tandem",
        "app.kubernetes.io/instance": RELEASE,
        "app.kubernetes.io/component": "openai",
    }}} in peers  # fmt: skip


def test_worker_roles_scale_on_their_own_metrics_when_asked(chart):
    assert not [
        o for o in objects(chart, {}) if o["kind"] in ("ScaledObject", "HorizontalPodAutoscaler")
    ]
    keda = objects(
        chart, {"autoscaling": {"enabled": True}, "prefill": {"autoscaling": {"maxReplicas": 6}}}
    )
    scaled = {o["metadata"]["name"]: o["spec"] for o in by_kind(keda, "ScaledObject")}
    assert set(scaled) == {f"{RELEASE}-tandem-prefill", f"{RELEASE}-tandem-decode"}
    prefill, decode = scaled[f"{RELEASE}-tandem-prefill"], scaled[f"{RELEASE}-tandem-decode"]
    assert prefill["scaleTargetRef"] == {
        "apiVersion": "apps/v1",
        "kind": "StatefulSet",
        "name": f"{RELEASE}-tandem-prefill",
    }
    assert (prefill["minReplicaCount"], prefill["maxReplicaCount"]) == (1, 6)
    (trigger,) = decode["triggers"]
    assert trigger["metadata"]["query"] == (
        f'sum(tandem:kv_cache_usage_perc{{namespace="{NAMESPACE}", '
        f'service="{RELEASE}-tandem-decode"}})'
    )
    assert trigger["metadata"]["threshold"] == "0.75"
    assert "num_requests_waiting" in prefill["triggers"][0]["metadata"]["query"]
    hpa = objects(
        chart,
        {
            "autoscaling": {"enabled": True, "kind": "hpa"},
            "prefill": {"autoscaling": {"enabled": False}},
        },
    )
    (decode_hpa,) = by_kind(hpa, "HorizontalPodAutoscaler")
    kubernetes_validate.validate(decode_hpa, KUBE_VERSION, strict=True)
    assert (
        decode_hpa["spec"]["metrics"][0]["pods"]["metric"]["name"] == "tandem_kv_cache_usage_perc"
    )


def test_every_process_logs_in_the_values_log_format(chart):
    def formats(values):
        return {_env(c).get("TANDEM_LOG_FORMAT") for c in containers(objects(chart, values))}

    assert formats({}) == {"text"}
    assert formats({"logFormat": "json"}) == {"json"}


def test_every_process_traces_to_the_values_collector(chart):
    def endpoints(values):
        return {
            _env(c).get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT")
            for c in containers(objects(chart, values))
        }

    assert endpoints({}) == {None}
    url = "http://otel-collector.observability:4318"
    assert endpoints({"tracing": {"otlpEndpoint": url}, "openai": {"enabled": True}}) == {url}


def test_the_kv_load_failure_policy_is_recompute_unless_a_role_says_fail(chart):
    def policies(values):
        return {
            c["name"]: flag(c, "kv-load-failure-policy")
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert set(policies({}).values()) == {None}  # the code's default: recompute
    assert policies({"decode": {"kvLoadFailurePolicy": "fail"}})["decode"] == "fail"
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"decode": {"kvLoadFailurePolicy": "retry"}})


def test_the_room_wait_is_the_workers_default_unless_a_role_sets_it(chart):
    def waits(values):
        return {
            c["name"]: flag(c, "kv-room-wait-seconds")
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert set(waits({}).values()) == {None}
    assert waits({"decode": {"kvRoomWaitSeconds": 0}})["decode"] == "0"
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"decode": {"kvRoomWaitSeconds": -1}})


def test_the_early_reserve_is_on_unless_a_role_turns_it_off(chart):
    def off(values):
        return {
            c["name"]: "--no-kv-early-reserve" in c["args"]
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert not any(off({}).values()) and not any(off({"decode": {"kvEarlyReserve": True}}).values())
    assert off({"decode": {"kvEarlyReserve": False}})["decode"]
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"decode": {"kvEarlyReserve": "no"}})


def test_speculative_decoding_is_a_decode_value_rendered_as_its_json_flag(chart):
    def configs(values):
        return {
            c["name"]: flag(c, "speculative-config")
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert set(configs({}).values()) == {None}
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3}
    rendered = configs({"decode": {"speculativeConfig": spec}})
    assert rendered["prefill"] is None and json.loads(rendered["decode"]) == spec
    draft = {"method": "draft_model", "model": "/models/draft", "num_speculative_tokens": 3}
    assert json.loads(configs({"decode": {"speculativeConfig": draft}})["decode"]) == draft
    eagle3 = {"method": "eagle3", "model": "/models/eagle3-head", "num_speculative_tokens": 3}
    assert json.loads(configs({"decode": {"speculativeConfig": eagle3}})["decode"]) == eagle3
    for bad in (
        {"method": "eagle3", "num_speculative_tokens": 2},
        {"method": "eagle", "model": "/models/head", "num_speculative_tokens": 2},
        {"method": "ngram"},
        {"method": "draft_model", "num_speculative_tokens": 2},
    ):
        with pytest.raises(helm.HelmValuesError):
            render(chart, {"decode": {"speculativeConfig": bad}})


def test_deterministic_is_one_engine_value_for_every_worker(chart):
    def modes(values):
        return {
            c["name"]: "--deterministic" in c["args"]
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert set(modes({}).values()) == {False}
    assert set(modes({"engine": {"deterministic": True}}).values()) == {True}
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"engine": {"deterministic": "yes"}})


def test_prometheus_rule_alerts_on_handoffs_the_decodes_did_not_pull(chart):
    assert not by_kind(objects(chart, {}), "PrometheusRule")  # opt-in: it needs the CRD
    docs = objects(
        chart,
        {
            "metrics": {
                "prometheusRule": {"enabled": True, "recomputeShare": 0.2, "labels": {"a": "b"}}
            }
        },
    )
    (rule,) = by_kind(docs, "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["labels"]["a"] == "b"
    (group,) = rule["spec"]["groups"]
    (alert,) = group["rules"]
    expr = alert["expr"]
    decode_service = next(
        svc["metadata"]["name"]
        for svc in by_kind(docs, "Service")
        if svc["metadata"]["labels"]["app.kubernetes.io/component"] == "decode"
    )
    selector = f'namespace="{NAMESPACE}", service="{decode_service}"'
    assert f'tandem:kv_handoffs_total{{{selector}, outcome=~"recomputed|failed"}}[10m]' in expr
    assert f'tandem:kv_handoffs_total{{{selector}, outcome!=""}}[10m]' in expr
    assert expr.strip().endswith("> 0.2")
    assert alert["for"] == "15m" and alert["labels"]["severity"] == "warning"
    assert "{{ $value | humanizePercentage }}" in alert["annotations"]["description"]
    assert not by_kind(
        objects(chart, {"metrics": {"enabled": False, "prometheusRule": {"enabled": True}}}),
        "PrometheusRule",
    )


def test_a_cluster_without_a_decode_capable_worker_does_not_render(chart):
    with pytest.raises(helm.HelmRenderError, match="prefill and one that can decode"):
        render(chart, {"decode": {"replicas": 0}})


@pytest.mark.parametrize("case", VALUE_SETS)
def test_golden_render(chart, case):
    manifests = render(chart, VALUE_SETS[case])
    text = "".join(
        f"# Source: {path}\n{manifests[path].strip()}\n"
        for path in sorted(manifests)
        if manifests[path].strip()
    )
    text = RANDOM_TOKEN.sub(r'\1"<random>"', text)
    golden = GOLDEN_DIR / f"{case}.yaml"
    if os.environ.get("TANDEM_UPDATE_GOLDEN") == "1":
        golden.parent.mkdir(parents=True, exist_ok=True)
        golden.write_text(text)
    assert golden.is_file(), f"{golden} missing: run with TANDEM_UPDATE_GOLDEN=1"
    assert text == golden.read_text(), (
        f"{golden.name} differs from the render: review, then TANDEM_UPDATE_GOLDEN=1"
    )


def test_engine_process_is_a_role_value_rendered_as_its_flag(chart):
    def flags(values):
        return {
            c["name"]: "--engine-process" in c["args"]
            for c in containers(objects(chart, values))
            if c["name"] != "router"
        }

    assert set(flags({}).values()) == {False}
    rendered = flags({"decode": {"engineProcess": True}})
    assert rendered["decode"] and not rendered["prefill"]
    with pytest.raises(helm.HelmValuesError):
        render(chart, {"prefill": {"engineProcess": "yes"}})
