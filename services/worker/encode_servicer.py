"""The AsyncLLM service of an encode-only worker: Encode runs, the generative engine's RPCs refuse.

The seed raises RuntimeError for generation-side calls when encode_only=True; here that is
FAILED_PRECONDITION with a message naming the model, so a client can tell a wrong cluster
from a bad request.
"""

from __future__ import annotations

from tandem.common.errors import PreconditionError
from tandem.worker.servicer import WorkerLLMServicer


class EncodeOnlyLLMServicer(WorkerLLMServicer):
    def _refuse(self, method: str) -> PreconditionError:
        return PreconditionError(
            f"{method} is not available: this worker serves the encode-only model "
            f"{self.rt.config.engine.model_dir}; use Encode, or serve a generative model"
        )

    async def Encode(self, request, context):
        return await self.rt.encoder.encode(request)

    async def Generate(self, request, context):
        raise self._refuse("Generate")
        yield  # pragma: no cover - makes this a server-streaming handler like the one it overrides

    async def run_submitted(self, submit, stream, owner, handoff=None):
        raise self._refuse("Generate")

    async def Preprocess(self, request, context):
        raise self._refuse("Preprocess")

    async def GetKvCacheCapacity(self, request, context):
        raise self._refuse("GetKvCacheCapacity")

    async def GetKvCacheEvents(self, request, context):
        raise self._refuse("GetKvCacheEvents")

    async def StreamKvCacheEvents(self, request, context):
        raise self._refuse("StreamKvCacheEvents")
        yield  # pragma: no cover

    async def GetStats(self, request, context):
        raise self._refuse("GetStats")

    async def StreamStats(self, request, context):
        raise self._refuse("StreamStats")
        yield  # pragma: no cover

    async def PauseGeneration(self, request, context):
        raise self._refuse("PauseGeneration")

    async def CollectiveRpc(self, request, context):
        raise self._refuse("CollectiveRpc")

    async def Release(self, request, context):
        raise self._refuse("Release")

    async def Resume(self, request, context):
        raise self._refuse("Resume")

    async def UpdateWeights(self, request, context):
        raise self._refuse("UpdateWeights")
