from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class RequestType(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    REQUEST_TYPE_CONTEXT_AND_GENERATION: _ClassVar[RequestType]
    REQUEST_TYPE_CONTEXT_ONLY: _ClassVar[RequestType]
    REQUEST_TYPE_GENERATION_ONLY: _ClassVar[RequestType]

class FinishReason(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    FINISH_REASON_UNSPECIFIED: _ClassVar[FinishReason]
    FINISH_REASON_STOP: _ClassVar[FinishReason]
    FINISH_REASON_LENGTH: _ClassVar[FinishReason]
    FINISH_REASON_CANCELLED: _ClassVar[FinishReason]
    FINISH_REASON_NOT_FINISHED: _ClassVar[FinishReason]
REQUEST_TYPE_CONTEXT_AND_GENERATION: RequestType
REQUEST_TYPE_CONTEXT_ONLY: RequestType
REQUEST_TYPE_GENERATION_ONLY: RequestType
FINISH_REASON_UNSPECIFIED: FinishReason
FINISH_REASON_STOP: FinishReason
FINISH_REASON_LENGTH: FinishReason
FINISH_REASON_CANCELLED: FinishReason
FINISH_REASON_NOT_FINISHED: FinishReason

class Prompt(_message.Message):
    __slots__ = ("text", "token_ids", "preprocessed")
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PREPROCESSED_FIELD_NUMBER: _ClassVar[int]
    text: str
    token_ids: TokenIds
    preprocessed: PreprocessedInputs
    def __init__(self, text: _Optional[str] = ..., token_ids: _Optional[_Union[TokenIds, _Mapping]] = ..., preprocessed: _Optional[_Union[PreprocessedInputs, _Mapping]] = ...) -> None: ...

class TokenIds(_message.Message):
    __slots__ = ("ids",)
    IDS_FIELD_NUMBER: _ClassVar[int]
    ids: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, ids: _Optional[_Iterable[int]] = ...) -> None: ...

class PreprocessedInputs(_message.Message):
    __slots__ = ("prompt_token_ids", "prompt", "sampling_params", "disaggregated_params")
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    SAMPLING_PARAMS_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    prompt: str
    sampling_params: SamplingParams
    disaggregated_params: DisaggregatedParams
    def __init__(self, prompt_token_ids: _Optional[_Iterable[int]] = ..., prompt: _Optional[str] = ..., sampling_params: _Optional[_Union[SamplingParams, _Mapping]] = ..., disaggregated_params: _Optional[_Union[DisaggregatedParams, _Mapping]] = ...) -> None: ...

class SamplingParams(_message.Message):
    __slots__ = ("max_tokens", "min_tokens", "temperature", "top_k", "top_p", "min_p", "seed", "n", "best_of", "stop", "stop_token_ids", "include_stop_str_in_output", "ignore_eos", "repetition_penalty", "presence_penalty", "frequency_penalty", "logprobs", "prompt_logprobs", "detokenize", "skip_special_tokens", "spaces_between_special_tokens", "end_id", "pad_id", "add_special_tokens", "truncate_prompt_tokens", "return_prompt_token_ids", "bad", "bad_token_ids", "embedding_bias", "use_beam_search", "top_p_min", "top_p_reset_ids", "top_p_decay", "beam_search_diversity_rate", "length_penalty", "early_stopping", "no_repeat_ngram_size", "beam_width_array", "return_context_logits", "return_generation_logits", "exclude_input_from_output", "return_encoder_output", "return_perf_metrics", "additional_model_outputs", "lookahead_config", "guided_decoding")
    MAX_TOKENS_FIELD_NUMBER: _ClassVar[int]
    MIN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TEMPERATURE_FIELD_NUMBER: _ClassVar[int]
    TOP_K_FIELD_NUMBER: _ClassVar[int]
    TOP_P_FIELD_NUMBER: _ClassVar[int]
    MIN_P_FIELD_NUMBER: _ClassVar[int]
    SEED_FIELD_NUMBER: _ClassVar[int]
    N_FIELD_NUMBER: _ClassVar[int]
    BEST_OF_FIELD_NUMBER: _ClassVar[int]
    STOP_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    INCLUDE_STOP_STR_IN_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    IGNORE_EOS_FIELD_NUMBER: _ClassVar[int]
    REPETITION_PENALTY_FIELD_NUMBER: _ClassVar[int]
    PRESENCE_PENALTY_FIELD_NUMBER: _ClassVar[int]
    FREQUENCY_PENALTY_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    DETOKENIZE_FIELD_NUMBER: _ClassVar[int]
    SKIP_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    SPACES_BETWEEN_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    END_ID_FIELD_NUMBER: _ClassVar[int]
    PAD_ID_FIELD_NUMBER: _ClassVar[int]
    ADD_SPECIAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    TRUNCATE_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    RETURN_PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    BAD_FIELD_NUMBER: _ClassVar[int]
    BAD_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    EMBEDDING_BIAS_FIELD_NUMBER: _ClassVar[int]
    USE_BEAM_SEARCH_FIELD_NUMBER: _ClassVar[int]
    TOP_P_MIN_FIELD_NUMBER: _ClassVar[int]
    TOP_P_RESET_IDS_FIELD_NUMBER: _ClassVar[int]
    TOP_P_DECAY_FIELD_NUMBER: _ClassVar[int]
    BEAM_SEARCH_DIVERSITY_RATE_FIELD_NUMBER: _ClassVar[int]
    LENGTH_PENALTY_FIELD_NUMBER: _ClassVar[int]
    EARLY_STOPPING_FIELD_NUMBER: _ClassVar[int]
    NO_REPEAT_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    BEAM_WIDTH_ARRAY_FIELD_NUMBER: _ClassVar[int]
    RETURN_CONTEXT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    RETURN_GENERATION_LOGITS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_INPUT_FROM_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RETURN_ENCODER_OUTPUT_FIELD_NUMBER: _ClassVar[int]
    RETURN_PERF_METRICS_FIELD_NUMBER: _ClassVar[int]
    ADDITIONAL_MODEL_OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    LOOKAHEAD_CONFIG_FIELD_NUMBER: _ClassVar[int]
    GUIDED_DECODING_FIELD_NUMBER: _ClassVar[int]
    max_tokens: int
    min_tokens: int
    temperature: float
    top_k: int
    top_p: float
    min_p: float
    seed: int
    n: int
    best_of: int
    stop: _containers.RepeatedScalarFieldContainer[str]
    stop_token_ids: _containers.RepeatedScalarFieldContainer[int]
    include_stop_str_in_output: bool
    ignore_eos: bool
    repetition_penalty: float
    presence_penalty: float
    frequency_penalty: float
    logprobs: int
    prompt_logprobs: int
    detokenize: bool
    skip_special_tokens: bool
    spaces_between_special_tokens: bool
    end_id: int
    pad_id: int
    add_special_tokens: bool
    truncate_prompt_tokens: int
    return_prompt_token_ids: bool
    bad: _containers.RepeatedScalarFieldContainer[str]
    bad_token_ids: _containers.RepeatedScalarFieldContainer[int]
    embedding_bias: _containers.RepeatedScalarFieldContainer[float]
    use_beam_search: bool
    top_p_min: float
    top_p_reset_ids: int
    top_p_decay: float
    beam_search_diversity_rate: float
    length_penalty: float
    early_stopping: int
    no_repeat_ngram_size: int
    beam_width_array: _containers.RepeatedScalarFieldContainer[int]
    return_context_logits: bool
    return_generation_logits: bool
    exclude_input_from_output: bool
    return_encoder_output: bool
    return_perf_metrics: bool
    additional_model_outputs: _containers.RepeatedScalarFieldContainer[str]
    lookahead_config: LookaheadDecodingConfig
    guided_decoding: GuidedDecodingParams
    def __init__(self, max_tokens: _Optional[int] = ..., min_tokens: _Optional[int] = ..., temperature: _Optional[float] = ..., top_k: _Optional[int] = ..., top_p: _Optional[float] = ..., min_p: _Optional[float] = ..., seed: _Optional[int] = ..., n: _Optional[int] = ..., best_of: _Optional[int] = ..., stop: _Optional[_Iterable[str]] = ..., stop_token_ids: _Optional[_Iterable[int]] = ..., include_stop_str_in_output: _Optional[bool] = ..., ignore_eos: _Optional[bool] = ..., repetition_penalty: _Optional[float] = ..., presence_penalty: _Optional[float] = ..., frequency_penalty: _Optional[float] = ..., logprobs: _Optional[int] = ..., prompt_logprobs: _Optional[int] = ..., detokenize: _Optional[bool] = ..., skip_special_tokens: _Optional[bool] = ..., spaces_between_special_tokens: _Optional[bool] = ..., end_id: _Optional[int] = ..., pad_id: _Optional[int] = ..., add_special_tokens: _Optional[bool] = ..., truncate_prompt_tokens: _Optional[int] = ..., return_prompt_token_ids: _Optional[bool] = ..., bad: _Optional[_Iterable[str]] = ..., bad_token_ids: _Optional[_Iterable[int]] = ..., embedding_bias: _Optional[_Iterable[float]] = ..., use_beam_search: _Optional[bool] = ..., top_p_min: _Optional[float] = ..., top_p_reset_ids: _Optional[int] = ..., top_p_decay: _Optional[float] = ..., beam_search_diversity_rate: _Optional[float] = ..., length_penalty: _Optional[float] = ..., early_stopping: _Optional[int] = ..., no_repeat_ngram_size: _Optional[int] = ..., beam_width_array: _Optional[_Iterable[int]] = ..., return_context_logits: _Optional[bool] = ..., return_generation_logits: _Optional[bool] = ..., exclude_input_from_output: _Optional[bool] = ..., return_encoder_output: _Optional[bool] = ..., return_perf_metrics: _Optional[bool] = ..., additional_model_outputs: _Optional[_Iterable[str]] = ..., lookahead_config: _Optional[_Union[LookaheadDecodingConfig, _Mapping]] = ..., guided_decoding: _Optional[_Union[GuidedDecodingParams, _Mapping]] = ...) -> None: ...

class LookaheadDecodingConfig(_message.Message):
    __slots__ = ("max_window_size", "max_ngram_size", "max_verification_set_size")
    MAX_WINDOW_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_NGRAM_SIZE_FIELD_NUMBER: _ClassVar[int]
    MAX_VERIFICATION_SET_SIZE_FIELD_NUMBER: _ClassVar[int]
    max_window_size: int
    max_ngram_size: int
    max_verification_set_size: int
    def __init__(self, max_window_size: _Optional[int] = ..., max_ngram_size: _Optional[int] = ..., max_verification_set_size: _Optional[int] = ...) -> None: ...

class GuidedDecodingParams(_message.Message):
    __slots__ = ("json_schema", "regex", "grammar", "json_object", "structural_tag")
    JSON_SCHEMA_FIELD_NUMBER: _ClassVar[int]
    REGEX_FIELD_NUMBER: _ClassVar[int]
    GRAMMAR_FIELD_NUMBER: _ClassVar[int]
    JSON_OBJECT_FIELD_NUMBER: _ClassVar[int]
    STRUCTURAL_TAG_FIELD_NUMBER: _ClassVar[int]
    json_schema: str
    regex: str
    grammar: str
    json_object: bool
    structural_tag: str
    def __init__(self, json_schema: _Optional[str] = ..., regex: _Optional[str] = ..., grammar: _Optional[str] = ..., json_object: _Optional[bool] = ..., structural_tag: _Optional[str] = ...) -> None: ...

class DisaggregatedParams(_message.Message):
    __slots__ = ("request_type", "first_gen_tokens", "ctx_request_id", "opaque_state", "draft_tokens", "disagg_request_id", "ctx_endpoint", "first_gen_log_probs", "finish_in_context")
    REQUEST_TYPE_FIELD_NUMBER: _ClassVar[int]
    FIRST_GEN_TOKENS_FIELD_NUMBER: _ClassVar[int]
    CTX_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    OPAQUE_STATE_FIELD_NUMBER: _ClassVar[int]
    DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    DISAGG_REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    CTX_ENDPOINT_FIELD_NUMBER: _ClassVar[int]
    FIRST_GEN_LOG_PROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_IN_CONTEXT_FIELD_NUMBER: _ClassVar[int]
    request_type: RequestType
    first_gen_tokens: _containers.RepeatedScalarFieldContainer[int]
    ctx_request_id: int
    opaque_state: bytes
    draft_tokens: _containers.RepeatedScalarFieldContainer[int]
    disagg_request_id: int
    ctx_endpoint: str
    first_gen_log_probs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_in_context: bool
    def __init__(self, request_type: _Optional[_Union[RequestType, str]] = ..., first_gen_tokens: _Optional[_Iterable[int]] = ..., ctx_request_id: _Optional[int] = ..., opaque_state: _Optional[bytes] = ..., draft_tokens: _Optional[_Iterable[int]] = ..., disagg_request_id: _Optional[int] = ..., ctx_endpoint: _Optional[str] = ..., first_gen_log_probs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_in_context: _Optional[bool] = ...) -> None: ...

class SchedulingParams(_message.Message):
    __slots__ = ("attention_dp_rank", "attention_dp_relax", "agent_hierarchy")
    ATTENTION_DP_RANK_FIELD_NUMBER: _ClassVar[int]
    ATTENTION_DP_RELAX_FIELD_NUMBER: _ClassVar[int]
    AGENT_HIERARCHY_FIELD_NUMBER: _ClassVar[int]
    attention_dp_rank: int
    attention_dp_relax: bool
    agent_hierarchy: str
    def __init__(self, attention_dp_rank: _Optional[int] = ..., attention_dp_relax: _Optional[bool] = ..., agent_hierarchy: _Optional[str] = ...) -> None: ...

class ConversationParams(_message.Message):
    __slots__ = ("conversation_id", "turn")
    CONVERSATION_ID_FIELD_NUMBER: _ClassVar[int]
    TURN_FIELD_NUMBER: _ClassVar[int]
    conversation_id: str
    turn: int
    def __init__(self, conversation_id: _Optional[str] = ..., turn: _Optional[int] = ...) -> None: ...

class TokenRangeRetentionConfig(_message.Message):
    __slots__ = ("token_start", "token_end", "priority", "duration_seconds")
    TOKEN_START_FIELD_NUMBER: _ClassVar[int]
    TOKEN_END_FIELD_NUMBER: _ClassVar[int]
    PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_start: int
    token_end: int
    priority: int
    duration_seconds: float
    def __init__(self, token_start: _Optional[int] = ..., token_end: _Optional[int] = ..., priority: _Optional[int] = ..., duration_seconds: _Optional[float] = ...) -> None: ...

class KvCacheRetentionConfig(_message.Message):
    __slots__ = ("token_range_retention_configs", "decode_retention_priority", "decode_duration_seconds")
    TOKEN_RANGE_RETENTION_CONFIGS_FIELD_NUMBER: _ClassVar[int]
    DECODE_RETENTION_PRIORITY_FIELD_NUMBER: _ClassVar[int]
    DECODE_DURATION_SECONDS_FIELD_NUMBER: _ClassVar[int]
    token_range_retention_configs: _containers.RepeatedCompositeFieldContainer[TokenRangeRetentionConfig]
    decode_retention_priority: int
    decode_duration_seconds: float
    def __init__(self, token_range_retention_configs: _Optional[_Iterable[_Union[TokenRangeRetentionConfig, _Mapping]]] = ..., decode_retention_priority: _Optional[int] = ..., decode_duration_seconds: _Optional[float] = ...) -> None: ...

class LoRARequest(_message.Message):
    __slots__ = ("lora_name", "lora_int_id", "lora_path", "lora_ckpt_source")
    LORA_NAME_FIELD_NUMBER: _ClassVar[int]
    LORA_INT_ID_FIELD_NUMBER: _ClassVar[int]
    LORA_PATH_FIELD_NUMBER: _ClassVar[int]
    LORA_CKPT_SOURCE_FIELD_NUMBER: _ClassVar[int]
    lora_name: str
    lora_int_id: int
    lora_path: str
    lora_ckpt_source: str
    def __init__(self, lora_name: _Optional[str] = ..., lora_int_id: _Optional[int] = ..., lora_path: _Optional[str] = ..., lora_ckpt_source: _Optional[str] = ...) -> None: ...

class PromptAdapterRequest(_message.Message):
    __slots__ = ("prompt_adapter_name", "prompt_adapter_id", "prompt_adapter_local_path", "prompt_adapter_num_virtual_tokens")
    PROMPT_ADAPTER_NAME_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ADAPTER_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ADAPTER_LOCAL_PATH_FIELD_NUMBER: _ClassVar[int]
    PROMPT_ADAPTER_NUM_VIRTUAL_TOKENS_FIELD_NUMBER: _ClassVar[int]
    prompt_adapter_name: str
    prompt_adapter_id: int
    prompt_adapter_local_path: str
    prompt_adapter_num_virtual_tokens: int
    def __init__(self, prompt_adapter_name: _Optional[str] = ..., prompt_adapter_id: _Optional[int] = ..., prompt_adapter_local_path: _Optional[str] = ..., prompt_adapter_num_virtual_tokens: _Optional[int] = ...) -> None: ...

class TokenLogprobs(_message.Message):
    __slots__ = ("logprobs", "ranks")
    class LogprobsEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: float
        def __init__(self, key: _Optional[int] = ..., value: _Optional[float] = ...) -> None: ...
    class RanksEntry(_message.Message):
        __slots__ = ("key", "value")
        KEY_FIELD_NUMBER: _ClassVar[int]
        VALUE_FIELD_NUMBER: _ClassVar[int]
        key: int
        value: int
        def __init__(self, key: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    RANKS_FIELD_NUMBER: _ClassVar[int]
    logprobs: _containers.ScalarMap[int, float]
    ranks: _containers.ScalarMap[int, int]
    def __init__(self, logprobs: _Optional[_Mapping[int, float]] = ..., ranks: _Optional[_Mapping[int, int]] = ...) -> None: ...

class LogitsRow(_message.Message):
    __slots__ = ("values",)
    VALUES_FIELD_NUMBER: _ClassVar[int]
    values: _containers.RepeatedScalarFieldContainer[float]
    def __init__(self, values: _Optional[_Iterable[float]] = ...) -> None: ...

class CompletionOutput(_message.Message):
    __slots__ = ("index", "text", "token_ids", "cumulative_logprob", "logprobs", "finish_reason", "stop_token_id", "stop_string", "disaggregated_params", "generation_logits", "perf_metrics")
    INDEX_FIELD_NUMBER: _ClassVar[int]
    TEXT_FIELD_NUMBER: _ClassVar[int]
    TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    CUMULATIVE_LOGPROB_FIELD_NUMBER: _ClassVar[int]
    LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    FINISH_REASON_FIELD_NUMBER: _ClassVar[int]
    STOP_TOKEN_ID_FIELD_NUMBER: _ClassVar[int]
    STOP_STRING_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    GENERATION_LOGITS_FIELD_NUMBER: _ClassVar[int]
    PERF_METRICS_FIELD_NUMBER: _ClassVar[int]
    index: int
    text: str
    token_ids: _containers.RepeatedScalarFieldContainer[int]
    cumulative_logprob: float
    logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    finish_reason: FinishReason
    stop_token_id: int
    stop_string: str
    disaggregated_params: DisaggregatedParams
    generation_logits: _containers.RepeatedCompositeFieldContainer[LogitsRow]
    perf_metrics: PerfMetrics
    def __init__(self, index: _Optional[int] = ..., text: _Optional[str] = ..., token_ids: _Optional[_Iterable[int]] = ..., cumulative_logprob: _Optional[float] = ..., logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., finish_reason: _Optional[_Union[FinishReason, str]] = ..., stop_token_id: _Optional[int] = ..., stop_string: _Optional[str] = ..., disaggregated_params: _Optional[_Union[DisaggregatedParams, _Mapping]] = ..., generation_logits: _Optional[_Iterable[_Union[LogitsRow, _Mapping]]] = ..., perf_metrics: _Optional[_Union[PerfMetrics, _Mapping]] = ...) -> None: ...

class RequestMetrics(_message.Message):
    __slots__ = ("time_to_first_token_s", "e2e_latency_s", "num_cached_prompt_tokens", "num_computed_prompt_tokens", "kv_transfer_bytes", "kv_transfer_s", "served_by", "kv_handoff", "prefix_pull")
    TIME_TO_FIRST_TOKEN_S_FIELD_NUMBER: _ClassVar[int]
    E2E_LATENCY_S_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    NUM_COMPUTED_PROMPT_TOKENS_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_BYTES_FIELD_NUMBER: _ClassVar[int]
    KV_TRANSFER_S_FIELD_NUMBER: _ClassVar[int]
    SERVED_BY_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_FIELD_NUMBER: _ClassVar[int]
    time_to_first_token_s: float
    e2e_latency_s: float
    num_cached_prompt_tokens: int
    num_computed_prompt_tokens: int
    kv_transfer_bytes: int
    kv_transfer_s: float
    served_by: _containers.RepeatedScalarFieldContainer[str]
    kv_handoff: KvHandoffMetrics
    prefix_pull: PrefixPullMetrics
    def __init__(self, time_to_first_token_s: _Optional[float] = ..., e2e_latency_s: _Optional[float] = ..., num_cached_prompt_tokens: _Optional[int] = ..., num_computed_prompt_tokens: _Optional[int] = ..., kv_transfer_bytes: _Optional[int] = ..., kv_transfer_s: _Optional[float] = ..., served_by: _Optional[_Iterable[str]] = ..., kv_handoff: _Optional[_Union[KvHandoffMetrics, _Mapping]] = ..., prefix_pull: _Optional[_Union[PrefixPullMetrics, _Mapping]] = ...) -> None: ...

class PrefixPullMetrics(_message.Message):
    __slots__ = ("outcome", "reason", "source", "num_pulled_blocks", "num_cached_blocks")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SOURCE_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    source: str
    num_pulled_blocks: int
    num_cached_blocks: int
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., source: _Optional[str] = ..., num_pulled_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ...) -> None: ...

class KvHandoffMetrics(_message.Message):
    __slots__ = ("outcome", "reason", "prefill", "decode", "num_pulled_blocks", "num_cached_blocks", "room_wait_s", "reserved_early", "from_prefill")
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    PREFILL_FIELD_NUMBER: _ClassVar[int]
    DECODE_FIELD_NUMBER: _ClassVar[int]
    NUM_PULLED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    NUM_CACHED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
    ROOM_WAIT_S_FIELD_NUMBER: _ClassVar[int]
    RESERVED_EARLY_FIELD_NUMBER: _ClassVar[int]
    FROM_PREFILL_FIELD_NUMBER: _ClassVar[int]
    outcome: str
    reason: str
    prefill: str
    decode: str
    num_pulled_blocks: int
    num_cached_blocks: int
    room_wait_s: float
    reserved_early: bool
    from_prefill: bool
    def __init__(self, outcome: _Optional[str] = ..., reason: _Optional[str] = ..., prefill: _Optional[str] = ..., decode: _Optional[str] = ..., num_pulled_blocks: _Optional[int] = ..., num_cached_blocks: _Optional[int] = ..., room_wait_s: _Optional[float] = ..., reserved_early: _Optional[bool] = ..., from_prefill: _Optional[bool] = ...) -> None: ...

class PerfMetrics(_message.Message):
    __slots__ = ("timing_metrics", "kv_cache_metrics", "speculative_decoding", "first_iter", "last_iter", "iter", "kv_handoff", "prefix_pull")
    class TimingMetrics(_message.Message):
        __slots__ = ("arrival_time", "first_scheduled_time", "first_token_time", "last_token_time", "kv_cache_transfer_start", "kv_cache_transfer_end", "kv_cache_size")
        ARRIVAL_TIME_FIELD_NUMBER: _ClassVar[int]
        FIRST_SCHEDULED_TIME_FIELD_NUMBER: _ClassVar[int]
        FIRST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
        LAST_TOKEN_TIME_FIELD_NUMBER: _ClassVar[int]
        KV_CACHE_TRANSFER_START_FIELD_NUMBER: _ClassVar[int]
        KV_CACHE_TRANSFER_END_FIELD_NUMBER: _ClassVar[int]
        KV_CACHE_SIZE_FIELD_NUMBER: _ClassVar[int]
        arrival_time: float
        first_scheduled_time: float
        first_token_time: float
        last_token_time: float
        kv_cache_transfer_start: float
        kv_cache_transfer_end: float
        kv_cache_size: int
        def __init__(self, arrival_time: _Optional[float] = ..., first_scheduled_time: _Optional[float] = ..., first_token_time: _Optional[float] = ..., last_token_time: _Optional[float] = ..., kv_cache_transfer_start: _Optional[float] = ..., kv_cache_transfer_end: _Optional[float] = ..., kv_cache_size: _Optional[int] = ...) -> None: ...
    class KvCacheMetrics(_message.Message):
        __slots__ = ("num_total_allocated_blocks", "num_new_allocated_blocks", "num_reused_blocks", "num_missed_blocks", "kv_cache_hit_rate")
        NUM_TOTAL_ALLOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        NUM_NEW_ALLOCATED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        NUM_REUSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        NUM_MISSED_BLOCKS_FIELD_NUMBER: _ClassVar[int]
        KV_CACHE_HIT_RATE_FIELD_NUMBER: _ClassVar[int]
        num_total_allocated_blocks: int
        num_new_allocated_blocks: int
        num_reused_blocks: int
        num_missed_blocks: int
        kv_cache_hit_rate: float
        def __init__(self, num_total_allocated_blocks: _Optional[int] = ..., num_new_allocated_blocks: _Optional[int] = ..., num_reused_blocks: _Optional[int] = ..., num_missed_blocks: _Optional[int] = ..., kv_cache_hit_rate: _Optional[float] = ...) -> None: ...
    class SpeculativeDecodingMetrics(_message.Message):
        __slots__ = ("acceptance_rate", "total_accepted_draft_tokens", "total_draft_tokens")
        ACCEPTANCE_RATE_FIELD_NUMBER: _ClassVar[int]
        TOTAL_ACCEPTED_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        TOTAL_DRAFT_TOKENS_FIELD_NUMBER: _ClassVar[int]
        acceptance_rate: float
        total_accepted_draft_tokens: int
        total_draft_tokens: int
        def __init__(self, acceptance_rate: _Optional[float] = ..., total_accepted_draft_tokens: _Optional[int] = ..., total_draft_tokens: _Optional[int] = ...) -> None: ...
    TIMING_METRICS_FIELD_NUMBER: _ClassVar[int]
    KV_CACHE_METRICS_FIELD_NUMBER: _ClassVar[int]
    SPECULATIVE_DECODING_FIELD_NUMBER: _ClassVar[int]
    FIRST_ITER_FIELD_NUMBER: _ClassVar[int]
    LAST_ITER_FIELD_NUMBER: _ClassVar[int]
    ITER_FIELD_NUMBER: _ClassVar[int]
    KV_HANDOFF_FIELD_NUMBER: _ClassVar[int]
    PREFIX_PULL_FIELD_NUMBER: _ClassVar[int]
    timing_metrics: PerfMetrics.TimingMetrics
    kv_cache_metrics: PerfMetrics.KvCacheMetrics
    speculative_decoding: PerfMetrics.SpeculativeDecodingMetrics
    first_iter: int
    last_iter: int
    iter: int
    kv_handoff: KvHandoffMetrics
    prefix_pull: PrefixPullMetrics
    def __init__(self, timing_metrics: _Optional[_Union[PerfMetrics.TimingMetrics, _Mapping]] = ..., kv_cache_metrics: _Optional[_Union[PerfMetrics.KvCacheMetrics, _Mapping]] = ..., speculative_decoding: _Optional[_Union[PerfMetrics.SpeculativeDecodingMetrics, _Mapping]] = ..., first_iter: _Optional[int] = ..., last_iter: _Optional[int] = ..., iter: _Optional[int] = ..., kv_handoff: _Optional[_Union[KvHandoffMetrics, _Mapping]] = ..., prefix_pull: _Optional[_Union[PrefixPullMetrics, _Mapping]] = ...) -> None: ...

class RequestOutput(_message.Message):
    __slots__ = ("request_id", "prompt", "prompt_token_ids", "outputs", "finished", "prompt_logprobs", "metrics", "disaggregated_params", "context_logits")
    REQUEST_ID_FIELD_NUMBER: _ClassVar[int]
    PROMPT_FIELD_NUMBER: _ClassVar[int]
    PROMPT_TOKEN_IDS_FIELD_NUMBER: _ClassVar[int]
    OUTPUTS_FIELD_NUMBER: _ClassVar[int]
    FINISHED_FIELD_NUMBER: _ClassVar[int]
    PROMPT_LOGPROBS_FIELD_NUMBER: _ClassVar[int]
    METRICS_FIELD_NUMBER: _ClassVar[int]
    DISAGGREGATED_PARAMS_FIELD_NUMBER: _ClassVar[int]
    CONTEXT_LOGITS_FIELD_NUMBER: _ClassVar[int]
    request_id: str
    prompt: str
    prompt_token_ids: _containers.RepeatedScalarFieldContainer[int]
    outputs: _containers.RepeatedCompositeFieldContainer[CompletionOutput]
    finished: bool
    prompt_logprobs: _containers.RepeatedCompositeFieldContainer[TokenLogprobs]
    metrics: RequestMetrics
    disaggregated_params: DisaggregatedParams
    context_logits: _containers.RepeatedCompositeFieldContainer[LogitsRow]
    def __init__(self, request_id: _Optional[str] = ..., prompt: _Optional[str] = ..., prompt_token_ids: _Optional[_Iterable[int]] = ..., outputs: _Optional[_Iterable[_Union[CompletionOutput, _Mapping]]] = ..., finished: _Optional[bool] = ..., prompt_logprobs: _Optional[_Iterable[_Union[TokenLogprobs, _Mapping]]] = ..., metrics: _Optional[_Union[RequestMetrics, _Mapping]] = ..., disaggregated_params: _Optional[_Union[DisaggregatedParams, _Mapping]] = ..., context_logits: _Optional[_Iterable[_Union[LogitsRow, _Mapping]]] = ...) -> None: ...
