"""tandem's thin client: tensorrt_llm's LLM / AsyncLLM API over gRPC (grpcio + protobuf only)."""

from tandem.client.encode import EncoderOutput
from tandem.client.errors import (
    InvalidRequestError,
    RequestError,
    RequestTimeoutError,
    UnsupportedRequestError,
)
from tandem.client.llm import LLM, AsyncLLM
from tandem.client.outputs import CompletionOutput, Logprob, RequestMetrics
from tandem.client.params import (
    ConversationParams,
    DisaggregatedParams,
    KvCacheRetentionConfig,
    LoRARequest,
    PreprocessedInputs,
    PromptAdapterRequest,
    SchedulingParams,
    TextPrompt,
    TokensPrompt,
)
from tandem.client.perf_metrics import (
    KvCacheMetrics,
    RequestPerfMetrics,
    SpeculativeDecodingMetrics,
    TimingMetrics,
)
from tandem.client.results import RequestOutput
from tandem.client.sampling_params import (
    BatchedLogitsProcessor,
    GuidedDecodingParams,
    LogitsProcessor,
    SamplingParams,
)

__all__ = [
    "LLM",
    "AsyncLLM",
    "SamplingParams",
    "LogitsProcessor",
    "BatchedLogitsProcessor",
    "GuidedDecodingParams",
    "DisaggregatedParams",
    "SchedulingParams",
    "ConversationParams",
    "KvCacheRetentionConfig",
    "LoRARequest",
    "PromptAdapterRequest",
    "PreprocessedInputs",
    "TextPrompt",
    "TokensPrompt",
    "RequestOutput",
    "CompletionOutput",
    "Logprob",
    "RequestMetrics",
    "RequestPerfMetrics",
    "TimingMetrics",
    "KvCacheMetrics",
    "SpeculativeDecodingMetrics",
    "EncoderOutput",
    "RequestError",
    "InvalidRequestError",
    "UnsupportedRequestError",
    "RequestTimeoutError",
]
