"""RequestOutput helpers shared by workers and the router (no torch)."""
from __future__ import annotations

from tandem.v1 import types_pb2


def merge_outputs(messages: list[types_pb2.RequestOutput]) -> types_pb2.RequestOutput:
    """Folds a request's streamed messages into one (non-streaming Generate)."""
    merged = types_pb2.RequestOutput()
    by_index: dict[int, types_pb2.CompletionOutput] = {}
    for msg in messages:
        outputs = list(msg.outputs)
        msg.ClearField("outputs")
        merged.MergeFrom(msg)
        for out in outputs:
            target = by_index.setdefault(out.index, types_pb2.CompletionOutput(index=out.index))
            text, ids, lps = target.text + out.text, list(target.token_ids) + list(out.token_ids), list(target.logprobs) + list(out.logprobs)
            target.MergeFrom(out)
            target.text = text
            del target.token_ids[:]
            target.token_ids.extend(ids)
            del target.logprobs[:]
            target.logprobs.extend(lps)
    merged.outputs.extend(by_index[i] for i in sorted(by_index))
    return merged
