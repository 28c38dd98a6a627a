"""Runs a rendered Helm release's pods under Docker the way a one-node kubelet would, offline.

Every pod's container gets its exact image, command, args, env, securityContext and volumes. A
"node" is one network namespace (a holder container) whose /etc/hosts resolves every Service and
pod DNS name, so the chart's own addresses work unchanged: one node (the default) is a
`--network none` namespace where every name is 127.0.0.1; several are namespaces on an internal
Docker bridge, each with its own address, every name resolving to the address of the node its
pods run on, so calls and KV transfers between nodes cross a real (virtual) network over TCP.
What a real cluster adds is out of reach here and refused loudly rather than faked: kube-proxy
port translation (a Service port must equal its target port; a Service's pods on one node),
PVC/hostPath/configMap volumes, GPUs.
Probes are polled from inside the namespace as kubelet does; termination runs the preStop hook,
sends SIGTERM and waits terminationGracePeriodSeconds before a SIGKILL.
"""

from __future__ import annotations

import base64
import json
import random
import re
import threading
import time
from dataclasses import dataclass, field

import docker
import requests
from container_harness import CONTAINER_PREFIX, logs, remove

PROBE_SCRIPT = r"""
import json, sys, time
import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
port, service, timeout = int(sys.argv[1]), sys.argv[2], float(sys.argv[3])
with grpc.insecure_channel(f"127.0.0.1:{port}") as channel:
    try:
        status = health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout).status
        print(health_pb2.HealthCheckResponse.ServingStatus.Name(status))
    except grpc.RpcError as exc:
        print(exc.code().name)
"""


@dataclass
class Pod:
    name: str
    spec: dict
    container: object | None = None
    ready_after_s: float | None = None

    @property
    def main(self) -> dict:
        (container,) = self.spec["containers"]
        return container


@dataclass
class Release:
    """The pods and DNS names of a rendered release (a list of manifests)."""

    pods: list[Pod] = field(default_factory=list)
    dns_names: set[str] = field(default_factory=set)
    # Each DNS name's pods (a Service's selected ones, a StatefulSet pod's own name).
    dns_pods: dict[str, list[str]] = field(default_factory=dict)

    @classmethod
    def from_manifests(
        cls, docs: list[dict], namespace: str, cluster_domain: str = "cluster.local"
    ) -> Release:
        release = cls()
        suffixes = ("", f".{namespace}", f".{namespace}.svc", f".{namespace}.svc.{cluster_domain}")
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        pods_of = {}
        for workload in workloads:
            name, spec = workload["metadata"]["name"], workload["spec"]
            pods_of[name] = []
            for i in range(spec["replicas"]):
                pod = Pod(f"{name}-{i}", spec["template"]["spec"])
                release.pods.append(pod)
                pods_of[name].append(pod.name)
                if workload["kind"] == "StatefulSet":
                    dns = f"{pod.name}.{spec['serviceName']}.{namespace}.svc.{cluster_domain}"
                    release.dns_names.add(dns)
                    release.dns_pods[dns] = [pod.name]
        for svc in (d for d in docs if d["kind"] == "Service"):
            name = svc["metadata"]["name"]
            _check_ports_map_one_to_one(svc, workloads)
            selected = [
                pod
                for w in workloads
                if svc["spec"]["selector"].items()
                <= w["spec"]["template"]["metadata"]["labels"].items()
                for pod in pods_of[w["metadata"]["name"]]
            ]
            for suffix in suffixes:
                release.dns_names.add(name + suffix)
                release.dns_pods[name + suffix] = selected
        return release


def _check_ports_map_one_to_one(svc: dict, workloads: list[dict]) -> None:
    selector = svc["spec"]["selector"]
    for workload in workloads:
        template = workload["spec"]["template"]
        if not selector.items() <= template["metadata"]["labels"].items():
            continue
        named = {
            p["name"]: p["containerPort"]
            for c in template["spec"]["containers"]
            for p in c.get("ports", [])
        }
        for port in svc["spec"]["ports"]:
            target = named.get(port["targetPort"], port["targetPort"])
            if port["port"] != target:
                raise ValueError(
                    f"Service {svc['metadata']['name']} maps {port['port']} to {target}: one network "
                    "namespace has no kube-proxy to translate ports"
                )


def _tmpfs_options(volume: dict, read_only: bool) -> str:
    empty_dir = volume.get("emptyDir")
    if empty_dir is None:
        raise ValueError(
            f"volume {volume['name']}: only emptyDir volumes run here, got {sorted(volume)}"
        )
    options = ["ro"] if read_only else []
    if empty_dir.get("sizeLimit"):
        match = re.fullmatch(r"(\d+)([KMGT])i?", str(empty_dir["sizeLimit"]))
        if not match:
            raise ValueError(
                f"volume {volume['name']}: cannot read sizeLimit {empty_dir['sizeLimit']!r}"
            )
        options.append(f"size={match.group(1)}{match.group(2)}")
    return ",".join(options)


def rendered_secrets(docs: list[dict]) -> dict[str, dict[str, str]]:
    """The Secrets the chart renders itself (its generated cluster token), as the API server stores them."""
    found = {}
    for doc in docs:
        if doc["kind"] == "Secret":
            data = {k: base64.b64decode(v).decode() for k, v in (doc.get("data") or {}).items()}
            found[doc["metadata"]["name"]] = data | dict(doc.get("stringData") or {})
    return found


def _environment(container: dict, secrets: dict[str, dict[str, str]]) -> dict[str, str]:
    env = {}
    for item in container.get("env", []):
        if "value" in item:
            env[item["name"]] = str(item["value"])
        elif "secretKeyRef" in item.get("valueFrom", {}):
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            raise ValueError(f"env {item['name']}: only value and secretKeyRef run here")
    return env


def docker_run_kwargs(pod: Pod, network_of: str, secrets: dict[str, dict[str, str]]) -> dict:
    """The docker run of a pod's one container, inside the namespace of container `network_of`."""
    spec, container = pod.spec, pod.main
    pod_sc, sc = spec.get("securityContext", {}), container.get("securityContext", {})
    uid, gid = (
        sc.get("runAsUser", pod_sc.get("runAsUser")),
        sc.get("runAsGroup", pod_sc.get("runAsGroup")),
    )
    if sc.get("runAsNonRoot", pod_sc.get("runAsNonRoot")) and not uid:
        raise ValueError(f"{pod.name}: runAsNonRoot without runAsUser is not checked here")
    if (sc.get("seccompProfile") or pod_sc.get("seccompProfile", {})).get(
        "type", "RuntimeDefault"
    ) != "RuntimeDefault":
        raise ValueError(
            f"{pod.name}: only the RuntimeDefault seccomp profile (Docker's default) runs here"
        )
    if "nvidia.com/gpu" in json.dumps(container.get("resources", {})):
        raise ValueError(f"{pod.name}: asks for GPUs; render the CPU values to run it here")
    volumes = {v["name"]: v for v in spec.get("volumes", [])}
    tmpfs = {
        m["mountPath"]: _tmpfs_options(volumes[m["name"]], m.get("readOnly", False))
        for m in container.get("volumeMounts", [])
    }
    caps = sc.get("capabilities", {})
    return dict(
        image=container["image"],
        entrypoint=container.get("command"),
        command=container.get("args"),
        environment=_environment(container, secrets),
        user=f"{uid}:{gid}" if uid else None,
        group_add=[str(pod_sc["fsGroup"])] if "fsGroup" in pod_sc else None,
        read_only=bool(sc.get("readOnlyRootFilesystem")),
        cap_drop=caps.get("drop"),
        cap_add=caps.get("add"),
        security_opt=["no-new-privileges"] if sc.get("allowPrivilegeEscalation") is False else None,
        tmpfs=tmpfs,
        network_mode=f"container:{network_of}",
        name=f"{CONTAINER_PREFIX}-{pod.name}",
        detach=True,
    )


class PodRunner:
    """Starts, probes and terminates a Release's pods; `with` removes every container (and the
    network) it made. nodes: pod name -> node name (default: every pod on one node); the first
    node's namespace is where exec() runs (a client pod's place)."""

    def __init__(
        self,
        client: docker.DockerClient,
        image: str,
        release: Release,
        secrets: dict[str, dict[str, str]],
        nodes: dict[str, str] | None = None,
    ):
        self.client, self.image, self.release, self.secrets = client, image, release, secrets
        self.node_of = {pod.name: (nodes or {}).get(pod.name, "node-0") for pod in release.pods}
        self.holders: dict[str, object] = {}  # node name -> its namespace's holder container
        self.addresses: dict[str, str] = {}  # node name -> its address on the bridge
        self.network = None

    @property
    def holder(self):
        return next(iter(self.holders.values()))

    def __enter__(self) -> PodRunner:
        nodes = list(dict.fromkeys(self.node_of[pod.name] for pod in self.release.pods))
        if len(nodes) == 1:
            self.holders[nodes[0]] = self._holder(nodes[0], network_mode="none")
        else:
            self.network, subnet = self._bridge()
            for i, node in enumerate(nodes):
                self.addresses[node] = f"{subnet}.{10 + i}"
            for node in nodes:
                self.holders[node] = self._holder(node)
        for pod in self.release.pods:
            holder = self.holders[self.node_of[pod.name]]
            pod.container = self.client.containers.run(
                **docker_run_kwargs(pod, holder.id, self.secrets)
            )
        return self

    def _bridge(self):
        """An internal bridge network (no way out) on a free /24: (network, its first 3 octets)."""
        for third in random.sample(range(16, 250), 20):
            subnet = f"172.30.{third}"
            try:
                network = self.client.networks.create(
                    f"{CONTAINER_PREFIX}-nodes",
                    driver="bridge",
                    internal=True,
                    ipam=docker.types.IPAMConfig(
                        pool_configs=[docker.types.IPAMPool(subnet=f"{subnet}.0/24")]
                    ),
                )
                return network, subnet
            except docker.errors.APIError as exc:
                if "overlap" not in str(exc).lower():
                    raise
        raise RuntimeError("no free 172.30.x.0/24 subnet for the nodes' bridge")

    def _resolve(self, name: str) -> str:
        if not self.addresses:
            return "127.0.0.1"
        nodes = {self.node_of[pod] for pod in self.release.dns_pods.get(name, [])}
        if len(nodes) != 1:
            raise ValueError(f"{name} resolves to pods on {sorted(nodes) or 'no'} nodes; one here")
        return self.addresses[nodes.pop()]

    def _holder(self, node: str, network_mode: str | None = None):
        """The node's network namespace: a container that sleeps, with the release's names."""
        api = self.client.api
        host_config = api.create_host_config(
            network_mode=network_mode or self.network.name,
            read_only=True,
            cap_drop=["ALL"],
            extra_hosts={name: self._resolve(name) for name in sorted(self.release.dns_names)},
        )
        networking = (
            None
            if network_mode
            else api.create_networking_config(
                {self.network.name: api.create_endpoint_config(ipv4_address=self.addresses[node])}
            )
        )
        created = api.create_container(
            self.image,
            entrypoint=["sleep", "infinity"],
            user="10001:10001",
            name=f"{CONTAINER_PREFIX}-netns-{node}",
            host_config=host_config,
            networking_config=networking,
        )
        api.start(created["Id"])
        return self.client.containers.get(created["Id"])

    def __exit__(self, *exc) -> None:
        for pod in self.release.pods:
            if pod.container is not None:
                remove(pod.container)
        for holder in self.holders.values():
            remove(holder)
        if self.network is not None:
            self.network.remove()

    def exec_on(self, node: str, argv: list[str]) -> str:
        """A command inside a node's network namespace."""
        result = self.holders[node].exec_run(argv)
        if result.exit_code != 0:
            raise RuntimeError(
                f"{argv[:3]} failed ({result.exit_code}): {result.output.decode(errors='replace')}"
            )
        return result.output.decode()

    def exec(self, argv: list[str]) -> str:
        """A command inside the first node's network namespace (as a client pod there would run it)."""
        return self.exec_on(next(iter(self.holders)), argv)

    def probe(self, probe: dict, pod: Pod | None = None) -> bool:
        """The probe from inside pod's node (kubelet probes the pod's own address)."""
        grpc_probe = probe["grpc"]
        argv = [
            "python3",
            "-c",
            PROBE_SCRIPT,
            str(grpc_probe["port"]),
            grpc_probe.get("service", ""),
            str(probe.get("timeoutSeconds", 1)),
        ]
        holder = self.holders[self.node_of[pod.name]] if pod is not None else self.holder
        return holder.exec_run(argv).output.decode().strip() == "SERVING"

    def wait_ready(self, timeout: float) -> None:
        """Kubelet's order: the startup probe every periodSeconds until it passes (failureThreshold
        failures fail the pod), then the readiness probe. Pods are probed side by side."""
        started = time.monotonic()
        errors: list[str] = []

        def run_probes(pod: Pod) -> None:
            startup, readiness = pod.main["startupProbe"], pod.main["readinessProbe"]
            for _ in range(startup.get("failureThreshold", 3)):
                time.sleep(
                    startup.get("initialDelaySeconds", 0)
                    if _ == 0
                    else startup.get("periodSeconds", 10)
                )
                if self.exited(pod) or time.monotonic() - started > timeout:
                    break
                if self.probe(startup, pod):
                    if self.probe(readiness, pod):
                        pod.ready_after_s = time.monotonic() - started
                    return
            errors.append(f"{pod.name} never passed its startup probe:\n{logs(pod.container)}")

        threads = [threading.Thread(target=run_probes, args=(pod,)) for pod in self.release.pods]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout + 30)
        missing = [p.name for p in self.release.pods if p.ready_after_s is None]
        if errors or missing:
            raise AssertionError(f"pods not ready: {missing}\n" + "\n".join(errors))

    def exited(self, pod: Pod) -> bool:
        pod.container.reload()
        return pod.container.status == "exited"

    def terminate(self, pod: Pod) -> tuple[int, float]:
        """Kubelet's pod deletion: the preStop hook, then SIGTERM, then SIGKILL once the grace is
        over. Returns (exit code, seconds from the start of the deletion to the exit)."""
        started = time.monotonic()
        grace = pod.spec.get("terminationGracePeriodSeconds", 30)
        hook = pod.main.get("lifecycle", {}).get("preStop", {}).get("exec")
        if hook is not None:
            pod.container.exec_run(hook["command"])
        pod.container.kill(signal="SIGTERM")
        try:
            code = pod.container.wait(timeout=max(1.0, grace - (time.monotonic() - started)))[
                "StatusCode"
            ]
        except requests.exceptions.RequestException:  # the grace is over: kubelet kills
            pod.container.kill()
            code = pod.container.wait(timeout=30)["StatusCode"]
        return code, time.monotonic() - started
