"""EncoderOutput, as encode() returns it."""

from __future__ import annotations

from dataclasses import dataclass

from tandem.v1 import llm_pb2


def _tensor(msg: llm_pb2.Tensor):
    """A nested list of the tensor's values (torch is not a client dependency)."""
    values, shape = list(msg.values), list(msg.shape)
    if not shape:
        return values

    def build(offset: int, dims: list[int]):
        if len(dims) == 1:
            return values[offset : offset + dims[0]]
        step = 1
        for d in dims[1:]:
            step *= d
        return [build(offset + i * step, dims[1:]) for i in range(dims[0])]

    return build(0, shape)


@dataclass
class EncoderOutput:
    prompt_token_ids: list[int]
    logits: list
    pooled: list | None = None


def decode_encode_response(resp: llm_pb2.EncodeResponse, single: bool, return_raw_logits: bool):
    if return_raw_logits:
        return _tensor(resp.raw)
    outs = [
        EncoderOutput(
            list(o.prompt_token_ids),
            _tensor(o.logits),
            _tensor(o.pooled) if o.HasField("pooled") else None,
        )
        for o in resp.outputs
    ]
    return outs[0] if single else outs
