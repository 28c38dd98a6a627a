"""The grpc.health.v1 service of a tandem process, naming the process that answers: the initial
metadata of every Check and Watch carries the server's instance id (`tandem-instance-id`, drawn
at random when the process starts). A Watch stream reopened on the same address may reach
another process (a restart, a hot swap over SO_REUSEPORT); its first reply then tells the router
so, answered from the event loop, without a state call that waits on the worker's engine."""
from __future__ import annotations

import grpc
from grpc_health.v1 import health

INSTANCE_ID_METADATA = "tandem-instance-id"


class InstanceHealthServicer(health.aio.HealthServicer):
    def __init__(self, instance_id: str):
        super().__init__()
        self.instance_id = instance_id
        self._metadata = ((INSTANCE_ID_METADATA, instance_id),)

    async def Check(self, request, context):
        await context.send_initial_metadata(self._metadata)
        return await super().Check(request, context)

    async def Watch(self, request, context):
        # Before the first reply: a write would send empty initial metadata itself.
        await context.send_initial_metadata(self._metadata)
        await super().Watch(request, context)


def instance_id_of(metadata: grpc.aio.Metadata | None) -> str:
    """The instance id in a health answer's initial metadata; '' when it names none (a server
    that is not tandem's, or an older one)."""
    if metadata is None:
        return ""
    return metadata.get(INSTANCE_ID_METADATA, "")
