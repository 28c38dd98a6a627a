"""TensorRT-LLM's reading of a SamplingParams message, shared by the router and the workers:
when a request decodes greedily, and the refusal of greedy decoding with several returns
(tensorrt_llm/sampling_params.py: SamplingParams.params_imply_greedy_decoding, _validate)."""

from __future__ import annotations

import os

from tandem.v1 import types_pb2


def _opt(msg, name: str):
    return getattr(msg, name) if msg.HasField(name) else None


def implies_greedy(params: types_pb2.SamplingParams) -> bool:
    """No temperature, top_p or top_k at all, or top_k=1, top_p=0 or temperature=0."""
    temperature, top_p, top_k = (
        _opt(params, "temperature"),
        _opt(params, "top_p"),
        _opt(params, "top_k"),
    )
    return (
        (temperature is None and top_p is None and top_k is None)
        or top_k == 1
        or top_p == 0.0
        or temperature == 0.0
    )


def check_several_returns(params: types_pb2.SamplingParams) -> None:
    """Greedy decoding returns one sequence: best_of (default n) > 1 is refused, as TensorRT-LLM
    refuses it, unless the server runs with TLLM_ALLOW_N_GREEDY_DECODING set."""
    n = _opt(params, "n") or 1
    best_of = _opt(params, "best_of") or n
    if (
        best_of > 1
        and not params.use_beam_search
        and implies_greedy(params)
        and not os.environ.get("TLLM_ALLOW_N_GREEDY_DECODING")
    ):
        raise ValueError(
            f"Greedy decoding in the LLM API does not allow multiple returns. Please set to best_of=1, got "
            f"best_of={best_of}. Please set to best_of=1 or set an environment variable "
            f"TLLM_ALLOW_N_GREEDY_DECODING=1 to allow best_of > 1 under the greedy decoding."
        )
