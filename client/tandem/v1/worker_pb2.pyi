from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class WorkerStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("role", "kv_layout_hash", "num_total_blocks", "num_free_blocks", "num_active_requests", "num_prompt_tokens_computed", "num_generated_tokens", "num_steps", "num_leased_blocks", "kv_bytes_received", "paused", "weight_bytes", "kv_cache_bytes", "weights_source", "weights_version")
    ROLE_FIELD_NUMBER: _ClassVar[int]
    KV_LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    NUM_TOTAL_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_FREE_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_ACTIVE_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_COMPUTED_FIELD_NUMBER: _ClassVar[int]
    NUM_GENERATED_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_STEPS_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    KV_BYTES_RECEIVED_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    WEIGHT_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_BYTES_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_SOURCE_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_VERSION_FIELD_NUMBER: _ClassVar[int]
    role: str
    kv_layout_hash: str
    num_total_blocks: int
    num_free_blocks: int
    num_active_requests: int
    num_prompt_tokens_computed: int
    num_generated_tokens: int
    num_steps: int
    num_leased_blocks: int
    kv_bytes_received: int
    paused: bool
    weight_bytes: int
    kv_cache_bytes: int
    weights_source: str
    weights_version: int
    def __init__(self, role: _Optional[str] = ..., kv_layout_hash: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_leased_blocks: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., paused: _Optional[bool] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., weights_source: _Optional[str] = ..., weights_version: _Optional[int] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("ctx_request_id",)
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: int
    def __init__(self, ctx_request_id: _Optional[int] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class KvHandoff(_message.Message):
    __slots__ = ("version", "ctx_endpoint", "agent_name", "layout_hash", "layout_json", "block_ids", "num_prompt_tokens", "ctx_request_id", "lease_expires_at", "prompt_digest", "signature")
    VERSION_FIELD_NUMBER: _ClassVar[int]
    CTX_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    AGENT_NAME_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_HASH_FIELD_NUMBER: _ClassVar[int]
    LAYOUT_JSON_FIELD_NUMBER: _ClassVar[int]
    BLOCK_IDS_FIELD_NUMBER: _ClassVar[int]
    NUM_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    LEASE_EXPIRES_AT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_DIGEST_FIELD_NUMBER: _ClassVar[int]
    SIGNATURE_FIELD_NUMBER: _ClassVar[int]
    version: int
    ctx_endpoint: str
    agent_name: str
    layout_hash: str
    layout_json: str
    block_ids: _containers.RepeatedScalarFieldContainer[int]
    num_prompt_tokens: int
    ctx_request_id: int
    lease_expires_at: float
    prompt_digest: bytes
    signature: bytes
    def __init__(self, version: _Optional[int] = ..., ctx_endpoint: _Optional[str] = ..., agent_name: _Optional[str] = ..., layout_hash: _Optional[str] = ..., layout_json: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., ctx_request_id: _Optional[int] = ..., lease_expires_at: _Optional[float] = ..., prompt_digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ...) -> None: ...
