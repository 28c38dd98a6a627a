"""The prefill side of a handoff: turns a finished context phase into the opaque
state the decode worker needs, and frees the leased KV when the decode side says
it has pulled it (a NIXL notification, or the ReleaseKv RPC)."""
from __future__ import annotations

import asyncio
import hashlib
import hmac
import itertools
import json
import logging
import random
import time
from array import array

from tandem.kvtransfer import KvTransceiver
from tandem.worker.engine_loop import EngineLoop
from tandem.v1 import worker_pb2

log = logging.getLogger("tandem.prefill")

RELEASE_PREFIX = b"release:"


def release_message(ctx_request_id: int) -> bytes:
    return RELEASE_PREFIX + str(ctx_request_id).encode()


def prompt_digest(prompt_token_ids: list[int], cache_salt: str | None) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update((cache_salt or "").encode() + b"\0")
    digest.update(array("q", prompt_token_ids).tobytes())
    return digest.digest()


def sign(handoff: worker_pb2.KvHandoff, key: bytes | None) -> bytes:
    """HMAC of the handoff without its signature; empty without a key (an open cluster trusts its clients)."""
    if not key:
        return b""
    unsigned = worker_pb2.KvHandoff()
    unsigned.CopyFrom(handoff)
    unsigned.signature = b""
    return hmac.new(key, unsigned.SerializeToString(deterministic=True), hashlib.sha256).digest()


class HandoffKeeper:
    def __init__(self, engine_loop: EngineLoop, transceiver: KvTransceiver, endpoint: str, layout: dict,
                 layout_hash: str, signing_key: bytes | None = None):
        self.signing_key = signing_key
        self.engine_loop = engine_loop
        self.transceiver = transceiver
        self.endpoint = endpoint
        self.layout_json = json.dumps(layout, sort_keys=True)
        self.layout_hash = layout_hash
        # ctx_request_id -> (engine request id, lease expiry). Random base: ids from a restarted
        # prefill never collide with leases the decode side may still name.
        self._leases: dict[int, tuple[str, float]] = {}
        self._ids = itertools.count(random.SystemRandom().randrange(1 << 40, 1 << 52))
        self._task: asyncio.Task | None = None

    def handoff(self, request_id: str, block_ids: list[int], prompt_token_ids: list[int],
                cache_salt: str | None, expires_at: float) -> tuple[int, bytes]:
        """Names the engine's lease (it expires at expires_at); returns (ctx_request_id, opaque_state)."""
        ctx_request_id = next(self._ids)
        self._leases[ctx_request_id] = (request_id, expires_at)
        state = worker_pb2.KvHandoff(
            version=1, ctx_endpoint=self.endpoint, agent_name=self.transceiver.agent_name,
            layout_hash=self.layout_hash, layout_json=self.layout_json, block_ids=block_ids,
            num_prompt_tokens=len(prompt_token_ids), ctx_request_id=ctx_request_id, lease_expires_at=expires_at,
            prompt_digest=prompt_digest(prompt_token_ids, cache_salt))
        state.signature = sign(state, self.signing_key)
        return ctx_request_id, state.SerializeToString()

    async def release(self, ctx_request_id: int) -> bool:
        lease = self._leases.pop(ctx_request_id, None)
        if lease is None:
            return False
        request_id, expires_at = lease
        return await self.engine_loop.call(lambda engine: engine.release_lease(request_id, expires_at))

    def start(self) -> None:
        self._task = asyncio.create_task(self._poll_forever())

    def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _poll_forever(self) -> None:
        """Without NIXL's progress thread, a decode's READ of our blocks progresses only while we
        poll: poll tightly while leases are out, lazily otherwise."""
        while True:
            try:
                for peer, message in self.transceiver.poll_notifications():
                    if message.startswith(RELEASE_PREFIX):
                        ctx_request_id = int(message[len(RELEASE_PREFIX):])
                        await self.release(ctx_request_id)
                    else:
                        log.warning("unexpected notification from %s: %r", peer, message[:64])
                now = time.time()
                for ctx_request_id in [c for c, (_, exp) in self._leases.items() if exp + 1.0 < now]:
                    self._leases.pop(ctx_request_id, None)  # the engine expired the blocks itself
            except Exception:  # noqa: BLE001 - the poller must outlive one bad message
                log.exception("handoff poller")
            await asyncio.sleep(0.0005 if self._leases else 0.02)
