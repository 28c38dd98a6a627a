from tandem.v1 import internal_pb2 as _internal_pb2
from tandem.v1 import types_pb2 as _types_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Role(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    ROLE_UNSPECIFIED: _ClassVar[Role]
    ROLE_PREFILL: _ClassVar[Role]
    ROLE_DECODE: _ClassVar[Role]
    ROLE_BOTH: _ClassVar[Role]
ROLE_UNSPECIFIED: Role
ROLE_PREFILL: Role
ROLE_DECODE: Role
ROLE_BOTH: Role

class SessionRequest(_message.Message):
    __slots__ = ("submits", "cancels", "handoffs")
    SUBMITS_FIELD_NUMBER: _ClassVar[int]
    CANCELS_FIELD_NUMBER: _ClassVar[int]
    HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    submits: _containers.RepeatedCompositeFieldContainer[SessionSubmit]
    cancels: _containers.RepeatedScalarFieldContainer[int]
    handoffs: _containers.RepeatedCompositeFieldContainer[SessionHandoff]
    def __init__(self, submits: _Optional[_Iterable[_Union[SessionSubmit, _Mapping]]] = ..., cancels: _Optional[_Iterable[int]] = ..., handoffs: _Optional[_Iterable[_Union[SessionHandoff, _Mapping]]] = ...) -> None: ...

class SessionHandoff(_message.Message):
    __slots__ = ("tag", "kv_params")
    TAG_FIELD_NUMBER: _ClassVar[int]
    KV_PARAMS_FIELD_NUMBER: _ClassVar[int]
    tag: int
    kv_params: _internal_pb2.KvParams
    def __init__(self, tag: _Optional[int] = ..., kv_params: _Optional[_Union[_internal_pb2.KvParams, _Mapping]] = ...) -> None: ...

class SessionSubmit(_message.Message):
    __slots__ = ("tag", "request", "client", "split", "timeout_s", "prefix_source", "awaits_handoff", "hand_off_to")
    TAG_FIELD_NUMBER: _ClassVar[int]
    REQUEST_FIELD_NUMBER: _ClassVar[int]
    CLIENT_FIELD_NUMBER: _ClassVar[int]
    SPLIT_FIELD_NUMBER: _ClassVar[int]
    TIMEOUT_S_FIELD_NUMBER: _ClassVar[int]
    PREFIX_SOURCE_FIELD_NUMBER: _ClassVar[int]
    AWAITS_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    HAND_OFF_TO_FIELD_NUMBER: _ClassVar[int]
    tag: int
    request: _internal_pb2.EngineRequest
    client: str
    split: bool
    timeout_s: float
    prefix_source: PrefixSource
    awaits_handoff: bool
    hand_off_to: str
    def __init__(self, tag: _Optional[int] = ..., request: _Optional[_Union[_internal_pb2.EngineRequest, _Mapping]] = ..., client: _Optional[str] = ..., split: _Optional[bool] = ..., timeout_s: _Optional[float] = ..., prefix_source: _Optional[_Union[PrefixSource, _Mapping]] = ..., awaits_handoff: _Optional[bool] = ..., hand_off_to: _Optional[str] = ...) -> None: ...

class PrefixSource(_message.Message):
    __slots__ = ("address", "num_blocks")
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    address: str
    num_blocks: int
    def __init__(self, address: _Optional[str] = ..., num_blocks: _Optional[int] = ...) -> None: ...

class SessionFailure(_message.Message):
    __slots__ = ("tag", "code", "details", "retry_pushback_ms", "refused", "reason")
    TAG_FIELD_NUMBER: _ClassVar[int]
    CODE_FIELD_NUMBER: _ClassVar[int]
    DETAILS_FIELD_NUMBER: _ClassVar[int]
    RETRY_PUSHBACK_MS_FIELD_NUMBER: _ClassVar[int]
    REFUSED_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    tag: int
    code: int
    details: str
    retry_pushback_ms: int
    refused: bool
    reason: str
    def __init__(self, tag: _Optional[int] = ..., code: _Optional[int] = ..., details: _Optional[str] = ..., retry_pushback_ms: _Optional[int] = ..., refused: _Optional[bool] = ..., reason: _Optional[str] = ...) -> None: ...

class EngineOutputs(_message.Message):
    __slots__ = ("stream_id", "outputs", "ended", "failed", "max_request_bytes", "max_requests", "takes_handoffs")
    STREAM_ID_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    ENDED_FIELD_NUMBER: _ClassVar[int]
    FAILED_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUEST_BYTES_FIELD_NUMBER: _ClassVar[int]
    MAX_REQUESTS_FIELD_NUMBER: _ClassVar[int]
    TAKES_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    stream_id: str
    outputs: _containers.RepeatedCompositeFieldContainer[_internal_pb2.EngineOutput]
    ended: _containers.RepeatedScalarFieldContainer[int]
    failed: _containers.RepeatedCompositeFieldContainer[SessionFailure]
    max_request_bytes: int
    max_requests: int
    takes_handoffs: bool
    def __init__(self, stream_id: _Optional[str] = ..., outputs: _Optional[_Iterable[_Union[_internal_pb2.EngineOutput, _Mapping]]] = ..., ended: _Optional[_Iterable[int]] = ..., failed: _Optional[_Iterable[_Union[SessionFailure, _Mapping]]] = ..., max_request_bytes: _Optional[int] = ..., max_requests: _Optional[int] = ..., takes_handoffs: _Optional[bool] = ...) -> None: ...

class WorkerStateRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class WorkerState(_message.Message):
    __slots__ = ("role", "kv_layout_hash", "num_total_blocks", "num_free_blocks", "num_active_requests", "num_prompt_tokens_computed", "num_generated_tokens", "num_steps", "num_leased_blocks", "kv_bytes_received", "paused", "weight_bytes", "kv_cache_bytes", "weights_source", "weights_version", "num_leases", "lease_endings", "num_waiting_for_remote_kv", "num_leases_opened", "lora_adapters", "num_ignored_notifications", "num_unconfirmed_handoffs", "num_sessions", "instance_id", "kv_pull_links", "kv_handoff_outcomes", "num_queued_prompt_tokens", "engine_core_pid", "prefix_pull_outcomes", "num_prefix_leases_opened", "leases_prefixes", "num_prefix_leases_trimmed")
    class LeaseEndingsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class KvHandoffOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
    class PrefixPullOutcomesEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: str
        value: int
        def __init__(self, key: _Optional[str] = ..., value: _Optional[int] = ...) -> None: ...
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
    NUM_LEASES_FIELD_NUMBER: _ClassVar[int]
    LEASE_ENDINGS_FIELD_NUMBER: _ClassVar[int]
    NUM_WAITING_FOR_REMOTE_KV_FIELD_NUMBER: _ClassVar[int]
    NUM_LEASES_OPENED_FIELD_NUMBER: _ClassVar[int]
    LORA_ADAPTERS_FIELD_NUMBER: _ClassVar[int]
    NUM_IGNORED_NOTIFICATIONS_FIELD_NUMBER: _ClassVar[int]
    NUM_UNCONFIRMED_HANDOFFS_FIELD_NUMBER: _ClassVar[int]
    NUM_SESSIONS_FIELD_NUMBER: _ClassVar[int]
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    KV_PULL_LINKS_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    NUM_QUEUED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    ENGINE_CORE_PID_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_OUTCOMES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_LEASES_OPENED_FIELD_NUMBER: _ClassVar[int]
    LEASES_PREFIXES_FIELD_NUMBER: _ClassVar[int]
    NUM_PREFIX_LEASES_TRIMMED_FIELD_NUMBER: _ClassVar[int]
    role: Role
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
    num_leases: int
    lease_endings: _containers.ScalarMap[str, int]
    num_waiting_for_remote_kv: int
    num_leases_opened: int
    lora_adapters: _containers.RepeatedCompositeFieldContainer[_types_pb2.LoRARequest]
    num_ignored_notifications: int
    num_unconfirmed_handoffs: int
    num_sessions: int
    instance_id: str
    kv_pull_links: _containers.RepeatedCompositeFieldContainer[KvPullLink]
    kv_handoff_outcomes: _containers.ScalarMap[str, int]
    num_queued_prompt_tokens: int
    engine_core_pid: int
    prefix_pull_outcomes: _containers.ScalarMap[str, int]
    num_prefix_leases_opened: int
    leases_prefixes: bool
    num_prefix_leases_trimmed: int
    def __init__(self, role: _Optional[_Union[Role, str]] = ..., kv_layout_hash: _Optional[str] = ..., num_total_blocks: _Optional[int] = ..., num_free_blocks: _Optional[int] = ..., num_active_requests: _Optional[int] = ..., num_prompt_tokens_computed: _Optional[int] = ..., num_generated_tokens: _Optional[int] = ..., num_steps: _Optional[int] = ..., num_leased_blocks: _Optional[int] = ..., kv_bytes_received: _Optional[int] = ..., paused: _Optional[bool] = ..., weight_bytes: _Optional[int] = ..., kv_cache_bytes: _Optional[int] = ..., weights_source: _Optional[str] = ..., weights_version: _Optional[int] = ..., num_leases: _Optional[int] = ..., lease_endings: _Optional[_Mapping[str, int]] = ..., num_waiting_for_remote_kv: _Optional[int] = ..., num_leases_opened: _Optional[int] = ..., lora_adapters: _Optional[_Iterable[_Union[_types_pb2.LoRARequest, _Mapping]]] = ..., num_ignored_notifications: _Optional[int] = ..., num_unconfirmed_handoffs: _Optional[int] = ..., num_sessions: _Optional[int] = ..., instance_id: _Optional[str] = ..., kv_pull_links: _Optional[_Iterable[_Union[KvPullLink, _Mapping]]] = ..., kv_handoff_outcomes: _Optional[_Mapping[str, int]] = ..., num_queued_prompt_tokens: _Optional[int] = ..., engine_core_pid: _Optional[int] = ..., prefix_pull_outcomes: _Optional[_Mapping[str, int]] = ..., num_prefix_leases_opened: _Optional[int] = ..., leases_prefixes: _Optional[bool] = ..., num_prefix_leases_trimmed: _Optional[int] = ...) -> None: ...

class KvPullLink(_message.Message):
    __slots__ = ("peer", "same_host", "device_pools", "num_pulls", "num_bytes", "seconds", "last_gbps", "mean_gbps", "num_below_floor", "best_gbps", "num_judged")
    PEER_FIELD_NUMBER: _ClassVar[int]
    SAME_HOST_FIELD_NUMBER: _ClassVar[int]
    DEVICE_POOLS_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLS_FIELD_NUMBER: _ClassVar[int]
    NUM_BYTES_FIELD_NUMBER: _ClassVar[int]
    SECONDS_FIELD_NUMBER: _ClassVar[int]
    LAST_GBPS_FIELD_NUMBER: _ClassVar[int]
    MEAN_GBPS_FIELD_NUMBER: _ClassVar[int]
    NUM_BELOW_FLOOR_FIELD_NUMBER: _ClassVar[int]
    BEST_GBPS_FIELD_NUMBER: _ClassVar[int]
    NUM_JUDGED_FIELD_NUMBER: _ClassVar[int]
    peer: str
    same_host: bool
    device_pools: bool
    num_pulls: int
    num_bytes: int
    seconds: float
    last_gbps: float
    mean_gbps: float
    num_below_floor: int
    best_gbps: float
    num_judged: int
    def __init__(self, peer: _Optional[str] = ..., same_host: _Optional[bool] = ..., device_pools: _Optional[bool] = ..., num_pulls: _Optional[int] = ..., num_bytes: _Optional[int] = ..., seconds: _Optional[float] = ..., last_gbps: _Optional[float] = ..., mean_gbps: _Optional[float] = ..., num_below_floor: _Optional[int] = ..., best_gbps: _Optional[float] = ..., num_judged: _Optional[int] = ...) -> None: ...

class ReleaseKvRequest(_message.Message):
    __slots__ = ("ctx_request_id", "disagg_request_id")
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    DISAGG_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: int
    disagg_request_id: int
    def __init__(self, ctx_request_id: _Optional[int] = ..., disagg_request_id: _Optional[int] = ...) -> None: ...

class ReleaseKvResponse(_message.Message):
    __slots__ = ("released",)
    RELEASED_FIELD_NUMBER: _ClassVar[int]
    released: bool
    def __init__(self, released: _Optional[bool] = ...) -> None: ...

class HandOffRequest(_message.Message):
    __slots__ = ("disagg_request_id", "kv_params")
    DISAGG_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    KV_PARAMS_FIELD_NUMBER: _ClassVar[int]
    disagg_request_id: int
    kv_params: _internal_pb2.KvParams
    def __init__(self, disagg_request_id: _Optional[int] = ..., kv_params: _Optional[_Union[_internal_pb2.KvParams, _Mapping]] = ...) -> None: ...

class HandOffResponse(_message.Message):
    __slots__ = ("num_taken",)
    NUM_TAKEN_FIELD_NUMBER: _ClassVar[int]
    num_taken: int
    def __init__(self, num_taken: _Optional[int] = ...) -> None: ...

class ConfirmLeaseRequest(_message.Message):
    __slots__ = ("ctx_request_id", "pulled")
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PULLED_FIELD_NUMBER: _ClassVar[int]
    ctx_request_id: int
    pulled: bool
    def __init__(self, ctx_request_id: _Optional[int] = ..., pulled: _Optional[bool] = ...) -> None: ...

class ConfirmLeaseResponse(_message.Message):
    __slots__ = ("confirmed",)
    CONFIRMED_FIELD_NUMBER: _ClassVar[int]
    confirmed: bool
    def __init__(self, confirmed: _Optional[bool] = ...) -> None: ...

class LeasePrefixRequest(_message.Message):
    __slots__ = ("token_ids", "cache_salt")
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CACHE_SALT_FIELD_NUMBER: _ClassVar[int]
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cache_salt: str
    def __init__(self, token_ids: _Optional[_Iterable[int]] = ..., cache_salt: _Optional[str] = ...) -> None: ...

class LeasePrefixResponse(_message.Message):
    __slots__ = ("num_blocks", "opaque_state")
    NUM_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_STATE_FIELD_NUMBER: _ClassVar[int]
    num_blocks: int
    opaque_state: bytes
    def __init__(self, num_blocks: _Optional[int] = ..., opaque_state: _Optional[bytes] = ...) -> None: ...

class StopSequencesRequest(_message.Message):
    __slots__ = ("request_id", "indices")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    INDICES_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    indices: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, request_id: _Optional[str] = ..., indices: _Optional[_Iterable[int]] = ...) -> None: ...

class StopSequencesResponse(_message.Message):
    __slots__ = ("found",)
    FOUND_FIELD_NUMBER: _ClassVar[int]
    found: bool
    def __init__(self, found: _Optional[bool] = ...) -> None: ...

class KvHandoff(_message.Message):
    __slots__ = ("version", "ctx_endpoint", "agent_name", "layout_hash", "layout_json", "block_ids", "num_prompt_tokens", "ctx_request_id", "lease_expires_at", "prompt_digest", "signature", "lora_request", "lora_fingerprint", "weights_id")
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
    LORA_REQUEST_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINT_FIELD_NUMBER: _ClassVar[int]
    WEIGHTS_ID_FIELD_NUMBER: _ClassVar[int]
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
    lora_request: _types_pb2.LoRARequest
    lora_fingerprint: str
    weights_id: str
    def __init__(self, version: _Optional[int] = ..., ctx_endpoint: _Optional[str] = ..., agent_name: _Optional[str] = ..., layout_hash: _Optional[str] = ..., layout_json: _Optional[str] = ..., block_ids: _Optional[_Iterable[int]] = ..., num_prompt_tokens: _Optional[int] = ..., ctx_request_id: _Optional[int] = ..., lease_expires_at: _Optional[float] = ..., prompt_digest: _Optional[bytes] = ..., signature: _Optional[bytes] = ..., lora_request: _Optional[_Union[_types_pb2.LoRARequest, _Mapping]] = ..., lora_fingerprint: _Optional[str] = ..., weights_id: _Optional[str] = ...) -> None: ...

class SubscribeKvBlocksRequest(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class KvBlocksUpdate(_message.Message):
    __slots__ = ("snapshot", "stored", "removed", "tokens_per_block", "lora_fingerprints")
    class LoraFingerprintsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: str
        def __init__(self, key: _Optional[int] = ..., value: _Optional[str] = ...) -> None: ...
    SNAPSHOT_FIELD_NUMBER: _ClassVar[int]
    STORED_FIELD_NUMBER: _ClassVar[int]
    REMOVED_FIELD_NUMBER: _ClassVar[int]
    TOKENS_PER_BLOCK_FIELD_NUMBER: _ClassVar[int]
    LORA_FINGERPRINTS_FIELD_NUMBER: _ClassVar[int]
    snapshot: bool
    stored: _containers.RepeatedScalarFieldContainer[int]
    removed: _containers.RepeatedScalarFieldContainer[int]
    tokens_per_block: int
    lora_fingerprints: _containers.ScalarMap[int, str]
    def __init__(self, snapshot: _Optional[bool] = ..., stored: _Optional[_Iterable[int]] = ..., removed: _Optional[_Iterable[int]] = ..., tokens_per_block: _Optional[int] = ..., lora_fingerprints: _Optional[_Mapping[int, str]] = ...) -> None: ...
