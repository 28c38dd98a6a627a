"""Runs a rendered Helm release's pods under Docker the way a one-node kubelet would, offline.

Every pod's container gets its exact image, command, args, env, securityContext and volumes; all
pods share one network namespace (a `--network none` holder container) whose /etc/hosts resolves
every Service and pod DNS name to 127.0.0.1, so the chart's own addresses work unchanged. What a
real cluster adds is out of reach here and refused loudly rather than faked: kube-proxy port
translation (a Service port must equal its target port), PVC/hostPath/configMap volumes, GPUs.
Probes are polled from inside the namespace as kubelet does; termination runs the preStop hook,
sends SIGTERM and waits terminationGracePeriodSeconds before a SIGKILL.
"""

from __future__ import annotations

import base64
import json
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

    @classmethod
    def from_manifests(
        cls, docs: list[dict], namespace: str, cluster_domain: str = "cluster.local"
    ) -> Release:
        release = cls()
        suffixes = ("", f".{namespace}", f".{namespace}.svc", f".{namespace}.svc.{cluster_domain}")
        workloads = [d for d in docs if d["kind"] in ("Deployment", "StatefulSet")]
        for svc in (d for d in docs if d["kind"] == "Service"):
            name = svc["metadata"]["name"]
            release.dns_names |= {name + s for s in suffixes}
            _check_ports_map_one_to_one(svc, workloads)
        for workload in workloads:
            name, spec = workload["metadata"]["name"], workload["spec"]
            for i in range(spec["replicas"]):
                pod = Pod(f"{name}-{i}", spec["template"]["spec"])
                release.pods.append(pod)
                if workload["kind"] == "StatefulSet":
                    release.dns_names.add(
                        f"{pod.name}.{spec['serviceName']}.{namespace}.svc.{cluster_domain}"
                    )
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
    """Starts, probes and terminates a Release's pods; `with` removes every container it made."""

    def __init__(
        self,
        client: docker.DockerClient,
        image: str,
        release: Release,
        secrets: dict[str, dict[str, str]],
    ):
        self.client, self.image, self.release, self.secrets = client, image, release, secrets
        self.holder = None

    def __enter__(self) -> PodRunner:
        self.holder = self.client.containers.run(
            self.image,
            entrypoint=["sleep", "infinity"],
            network_mode="none",
            read_only=True,
            detach=True,
            extra_hosts={name: "127.0.0.1" for name in sorted(self.release.dns_names)},
            name=f"{CONTAINER_PREFIX}-netns",
            user="10001:10001",
            cap_drop=["ALL"],
        )
        for pod in self.release.pods:
            pod.container = self.client.containers.run(
                **docker_run_kwargs(pod, self.holder.id, self.secrets)
            )
        return self

    def __exit__(self, *exc) -> None:
        for pod in self.release.pods:
            if pod.container is not None:
                remove(pod.container)
        if self.holder is not None:
            remove(self.holder)

    def exec(self, argv: list[str]) -> str:
        """A command inside the pods' network namespace (as a client pod in the cluster would run it)."""
        result = self.holder.exec_run(argv)
        if result.exit_code != 0:
            raise RuntimeError(
                f"{argv[:3]} failed ({result.exit_code}): {result.output.decode(errors='replace')}"
            )
        return result.output.decode()

    def probe(self, probe: dict) -> bool:
        grpc_probe = probe["grpc"]
        argv = [
            "python3",
            "-c",
            PROBE_SCRIPT,
            str(grpc_probe["port"]),
            grpc_probe.get("service", ""),
            str(probe.get("timeoutSeconds", 1)),
        ]
        return self.holder.exec_run(argv).output.decode().strip() == "SERVING"

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
                if self.probe(startup):
                    if self.probe(readiness):
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
