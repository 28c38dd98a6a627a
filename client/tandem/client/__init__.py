"""tandem's thin client: tensorrt_llm's LLM / AsyncLLM API over gRPC (grpcio + protobuf only)."""
from tandem.client.encode import EncoderOutput
from tandem.client.llm import LLM, AsyncLLM
from tandem.client.outputs import CompletionOutput, RequestMetrics
from tandem.client.params import (ConversationParams, DisaggregatedParams, KvCacheRetentionConfig, LoRARequest,
                                  PreprocessedInputs, PromptAdapterRequest, SamplingParams, SchedulingParams,
                                  TextPrompt, TokensPrompt)
from tandem.client.results import RequestOutput

__all__ = [
    "LLM", "AsyncLLM", "SamplingParams", "DisaggregatedParams", "SchedulingParams", "ConversationParams",
    "KvCacheRetentionConfig", "LoRARequest", "PromptAdapterRequest", "PreprocessedInputs", "TextPrompt",
    "TokensPrompt", "RequestOutput", "CompletionOutput", "RequestMetrics", "EncoderOutput",
]
