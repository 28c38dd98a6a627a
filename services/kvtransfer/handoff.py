"""The handoff wire format: what a prefill worker puts in DisaggregatedParams.opaque_state
(a serialized KvHandoff), and how a decode worker verifies it before pulling anything.

A handoff names where the KV is (endpoint, NIXL agent, block ids), what it looks like (the
layout hash, and the layout itself so a mismatch can be named), which prompt it belongs to
(a digest over the token ids and cache_salt) and its lease, under an HMAC keyed by the cluster's
signing key that a client cannot forge: every handoff is signed and verified, so a client can
make a decode worker connect nowhere but to the prefill that signed it.

A verified handoff is not yet KV to trust: the lease may have ended (a replay, an expiry) and
its blocks been reused. The decode confirms the lease after its READ (Worker/ConfirmLease)
before it uses or caches what it read.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from array import array

from tandem.common.exceptions import IncompatibleHandoffError, PreconditionError
from tandem.engine.kv_layout import layout_hash
from tandem.v1 import types_pb2, worker_pb2

FORMAT_VERSION = 1


def prompt_digest(prompt_token_ids: list[int], cache_salt: str | None) -> bytes:
    digest = hashlib.blake2b(digest_size=16)
    digest.update((cache_salt or "").encode() + b"\0")
    digest.update(array("q", prompt_token_ids).tobytes())
    return digest.digest()


def sign(handoff: worker_pb2.KvHandoff, key: bytes) -> bytes:
    """HMAC of the handoff without its signature."""
    unsigned = worker_pb2.KvHandoff()
    unsigned.CopyFrom(handoff)
    unsigned.signature = b""
    return hmac.new(key, unsigned.SerializeToString(deterministic=True), hashlib.sha256).digest()


def describe_mismatch(ours: dict, theirs: dict) -> str:
    diffs = [
        f"{k}: prefill {theirs.get(k)!r} vs decode {ours.get(k)!r}"
        for k in sorted(set(ours) | set(theirs))
        if ours.get(k) != theirs.get(k)
    ]
    return "; ".join(diffs) or "layout hashes differ"


class HandoffFormat:
    """Builds and verifies the handoffs of one worker's KV layout."""

    def __init__(self, layout: dict, signing_key: bytes):
        if len(signing_key or b"") < 16:
            raise ValueError(
                "KV handoffs need a signing key of 16 bytes or more (derived from the cluster token)"
            )
        self.layout = layout
        self.layout_hash = layout_hash(layout)
        self.layout_json = json.dumps(layout, sort_keys=True)
        self.signing_key = signing_key

    def build(
        self,
        endpoint: str,
        agent_name: str,
        lease_id: int,
        block_ids: list[int],
        expires_at: float,
        prompt_token_ids: list[int],
        cache_salt: str | None,
        adapter=None,
        weights_id: str = "",
    ) -> bytes:
        """adapter: the LoRA adapter (engine.lora_adapter.LoRAAdapter) the KV was computed with, or
        None; weights_id: the weights it was computed with (KvHandoff.weights_id)."""
        state = worker_pb2.KvHandoff(
            version=FORMAT_VERSION,
            ctx_endpoint=endpoint,
            agent_name=agent_name,
            layout_hash=self.layout_hash,
            layout_json=self.layout_json,
            block_ids=block_ids,
            num_prompt_tokens=len(prompt_token_ids),
            ctx_request_id=lease_id,
            lease_expires_at=expires_at,
            prompt_digest=prompt_digest(prompt_token_ids, cache_salt),
            weights_id=weights_id,
        )
        if adapter is not None:
            state.lora_request.CopyFrom(
                types_pb2.LoRARequest(
                    lora_name=adapter.name, lora_int_id=adapter.int_id, lora_path=adapter.path
                )
            )
            state.lora_fingerprint = adapter.fingerprint
        state.signature = sign(state, self.signing_key)
        return state.SerializeToString()

    def parse(
        self, opaque_state: bytes, prompt_token_ids: list[int], cache_salt: str | None
    ) -> worker_pb2.KvHandoff:
        """The handoff of a generation_only request, refused (FAILED_PRECONDITION) when its signature
        does not verify (checked before anything it names is looked at), when its KV layout is not
        ours, or when it belongs to another prompt."""
        handoff = worker_pb2.KvHandoff()
        try:
            handoff.ParseFromString(opaque_state)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError
            raise ValueError(
                f"disaggregated_params.opaque_state is not a tandem KV handoff: {exc}"
            ) from None
        if handoff.version != FORMAT_VERSION or not handoff.ctx_endpoint or not handoff.block_ids:
            raise ValueError(
                "disaggregated_params.opaque_state is not a tandem KV handoff (version 1 with blocks and "
                "an endpoint); pass the context_only response's disaggregated_params unchanged"
            )
        if not hmac.compare_digest(handoff.signature, sign(handoff, self.signing_key)):
            raise PreconditionError(
                "the KV handoff's signature does not verify: pass the context_only response's "
                "disaggregated_params unchanged"
            )
        if handoff.layout_hash != self.layout_hash:
            theirs = json.loads(handoff.layout_json) if handoff.layout_json else {}
            raise IncompatibleHandoffError(
                f"KV handoff from {handoff.ctx_endpoint} is incompatible with this decode worker: "
                f"{describe_mismatch(self.layout, theirs)}"
            )
        if handoff.num_prompt_tokens != len(
            prompt_token_ids
        ) or handoff.prompt_digest != prompt_digest(prompt_token_ids, cache_salt):
            raise PreconditionError(
                "the KV handoff belongs to another prompt (or cache_salt): send generation_only "
                "with the context phase's prompt_token_ids and cache_salt"
            )
        return handoff
