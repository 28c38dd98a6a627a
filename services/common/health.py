"""The grpc.health.v1 service of a tandem process, naming the process that answers: the initial
metadata of every Check and Watch carries the server's instance id (`tandem-instance-id`, drawn
at random when the process starts). A Watch stream reopened on the same address may reach
another process (a restart, a hot swap over SO_REUSEPORT); its first reply then tells the router
so, answered from the event loop, without a state call that waits on the worker's engine.

Watch is grpcio-health-checking's, but for one thing: its watchers of a service share one
condition, which upstream deletes when any one of them leaves, so a watcher still open never
hears a later change (a drain's NOT_SERVING never reaches a second router, or a router whose
reopened stream started before the old one's handler ended). Here the condition goes only with
its last watcher (kept for each watched name, a client could grow the map without bound)."""

from __future__ import annotations

import collections

import grpc
from grpc_health.v1 import health, health_pb2

INSTANCE_ID_METADATA = "tandem-instance-id"
# The health service name a liveness probe asks for: SERVING while the process answers at all
# (started, draining included). The "" name and the served services' names are readiness: the
# process can serve (a router: a worker of each role it needs is ready).
LIVENESS_SERVICE = "tandem.liveness"


class InstanceHealthServicer(health.aio.HealthServicer):
    def __init__(self, instance_id: str):
        super().__init__()
        self.instance_id = instance_id
        self._metadata = ((INSTANCE_ID_METADATA, instance_id),)
        self._num_watchers: collections.Counter[str] = collections.Counter()

    async def Check(self, request, context):
        await context.send_initial_metadata(self._metadata)
        return await super().Check(request, context)

    async def Watch(self, request, context):
        # Before the first reply: a write would send empty initial metadata itself.
        await context.send_initial_metadata(self._metadata)
        service = request.service
        condition = self._server_watchers[service]  # set() notifies every watcher through it
        self._num_watchers[service] += 1
        last_status = None
        try:
            async with condition:
                while True:
                    status = self._server_status.get(
                        service, health_pb2.HealthCheckResponse.SERVICE_UNKNOWN
                    )
                    if (
                        status != last_status
                    ):  # (changes in between may be skipped: the last one counts)
                        await context.write(health_pb2.HealthCheckResponse(status=status))
                    last_status = status
                    await condition.wait()
        finally:
            self._num_watchers[service] -= 1
            if not self._num_watchers[service]:
                del self._num_watchers[service]
                self._server_watchers.pop(service, None)


def instance_id_of(metadata: grpc.aio.Metadata | None) -> str:
    """The instance id in a health answer's initial metadata; '' when it names none (a server
    that is not tandem's, or an older one)."""
    if metadata is None:
        return ""
    return metadata.get(INSTANCE_ID_METADATA, "")
