"""Keeps a LocalCluster's processes running (what `tandem up` does while it serves).

A process that exits is started again with the same role on the same port, after a back-off
that doubles with each restart in the window; past max_restarts in the window it is left
down and the rest keep serving (the router routes around it). Meanwhile the router carries
the dead worker's streams on elsewhere (router/relay.py) and takes the worker back once
its health check passes. The router itself is restarted the same way; clients reconnect.
A router that exits cleanly (Shutdown) ends the cluster.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field

from tandem.testing.cluster import LocalCluster, Service


@dataclass(frozen=True)
class RestartPolicy:
    max_restarts: int = 5
    window_s: float = 600.0
    first_backoff_s: float = 0.5
    max_backoff_s: float = 30.0

    def __post_init__(self):
        if (
            self.max_restarts < 0
            or self.window_s <= 0
            or not 0 < self.first_backoff_s <= self.max_backoff_s
        ):
            raise ValueError(f"bad restart policy {self}")


@dataclass
class _Watch:
    restarts: deque = field(default_factory=deque)
    due_at: float | None = None  # when a dead process is started again
    given_up: bool = False


class Supervisor:
    def __init__(
        self,
        cluster: LocalCluster,
        policy: RestartPolicy = RestartPolicy(),
        say: Callable[[str], None] = print,
    ):
        self.cluster = cluster
        self.policy = policy
        self.say = say
        self._watches: dict[str, _Watch] = {}
        self.num_restarts = 0

    @property
    def router_gone(self) -> bool:
        """The router was shut down (exit code 0) or gave up: nothing serves any more."""
        router = self.cluster.router
        code = router.process.poll()
        return code == 0 or self._watch(router).given_up

    def poll(self, now: float | None = None) -> None:
        """One round: notices exits, starts again what is due."""
        now = time.monotonic() if now is None else now
        for service in self.cluster.services:
            watch = self._watch(service)
            if watch.given_up or service.process.poll() is None:
                continue
            if watch.due_at is None:
                self._schedule(service, watch, now)
            elif now >= watch.due_at:
                watch.due_at = None
                watch.restarts.append(now)
                self.num_restarts += 1
                self.cluster.restart(service)
                self.say(
                    f"tandem: restarted {service.name} on {service.address} (pid {service.process.pid})"
                )

    def _watch(self, service: Service) -> _Watch:
        return self._watches.setdefault(service.name, _Watch())

    def _schedule(self, service: Service, watch: _Watch, now: float) -> None:
        while watch.restarts and now - watch.restarts[0] > self.policy.window_s:
            watch.restarts.popleft()
        code = service.process.returncode
        if len(watch.restarts) >= self.policy.max_restarts:
            watch.given_up = True
            self.say(
                f"tandem: {service.name} on {service.address} exited ({code}) after {len(watch.restarts)} "
                f"restarts in {self.policy.window_s:.0f} s; leaving it down (log: {service.log_path})"
            )
            return
        backoff = min(
            self.policy.max_backoff_s, self.policy.first_backoff_s * 2 ** len(watch.restarts)
        )
        watch.due_at = now + backoff
        self.say(
            f"tandem: {service.name} on {service.address} exited ({code}); restarting it in {backoff:.1f} s "
            f"(log: {service.log_path})"
        )
