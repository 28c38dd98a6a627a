"""Where the router finds its workers: a static list (--workers), or DNS names re-resolved every
few seconds (--workers-dns: a Kubernetes headless service per role answers with one address per
ready pod, so `kubectl scale` adds and drops workers with no re-render). The resolver is
pluggable: real DNS by default (getaddrinfo), or a hosts file with ports (tests on loopback,
where workers differ by port, not by address)."""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path

from tandem.common.roles import Role

log = logging.getLogger("tandem.router.discovery")

# host, port -> the worker addresses ("ip:port") the name stands for now.
Resolver = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class DnsTarget:
    host: str
    port: int
    # The role the name's workers are expected to have (None: any); each worker reports its own.
    role: Role | None = None

    def __str__(self) -> str:
        return f"{self.role.label + '=' if self.role else ''}{self.host}:{self.port}"


def parse_dns_targets(specs: tuple[str, ...]) -> list[DnsTarget]:
    """'prefill=tandem-prefill.ns.svc:50052' or 'tandem-workers:50052' -> DnsTarget."""
    targets = []
    for spec in specs:
        role_name, sep, address = spec.rpartition("=")
        host, colon, port = address.rpartition(":")
        if not colon or not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise ValueError(f"--workers-dns entry {spec!r} is not [ROLE=]HOST:PORT")
        targets.append(DnsTarget(host, int(port), Role.parse(role_name) if sep else None))
    return targets


def _join(ip: str, port: int) -> str:
    return f"[{ip}]:{port}" if ":" in ip else f"{ip}:{port}"


async def resolve_dns(host: str, port: int) -> list[str]:
    """Every address the name has now (a headless service: one per ready pod), through the
    system resolver (getaddrinfo, off the loop)."""
    infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return sorted({_join(info[4][0], port) for info in infos})


def hosts_file_resolver(path: str | Path) -> Resolver:
    """A resolver reading `NAME HOST:PORT` lines (# comments) from path at every call: a name
    stands for every address listed for it. For loopback clusters, where workers differ by port."""
    path = Path(path)

    async def resolve(host: str, port: int) -> list[str]:
        found = []
        for line in path.read_text().splitlines():
            fields = line.split("#", 1)[0].split()
            if len(fields) == 2 and fields[0] == host:
                found.append(fields[1])
        if not found:
            raise socket.gaierror(socket.EAI_NONAME, f"{host} is not in {path}")
        return sorted(found)

    return resolve


class DnsDiscovery:
    """Re-resolves the targets every interval_s and hands the pool the union of their addresses.
    A name that fails to resolve keeps its last answer (a DNS hiccup drops no worker); one that
    resolves to nothing (scaled to zero) has no workers."""

    def __init__(
        self,
        targets: list[DnsTarget],
        set_addresses: Callable[[set[str]], None],
        interval_s: float = 5.0,
        resolver: Resolver = resolve_dns,
    ):
        self.targets = targets
        self.set_addresses = set_addresses
        self.interval_s = interval_s
        self.resolver = resolver
        self._last: dict[DnsTarget, list[str]] = {}

    async def refresh(self) -> set[str]:
        for target in self.targets:
            try:
                self._last[target] = await self.resolver(target.host, target.port)
            except (OSError, UnicodeError) as exc:
                log.warning(
                    "resolving %s failed (%s); keeping its %d workers",
                    target,
                    exc,
                    len(self._last.get(target, [])),
                )
        addresses = {a for found in self._last.values() for a in found}
        self.set_addresses(addresses)
        return addresses

    async def run(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.interval_s)
