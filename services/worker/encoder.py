"""The encode-only worker: a BERT encoder and its pooling, behind the Encode RPC.

Each Encode call is one padded batch. The forward pass runs on one dedicated thread
(never on the event loop); one thread because concurrent forwards would only fight
over the same cores or GPU, while the loop keeps answering other RPCs.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
from dataclasses import dataclass

import torch
from google.protobuf import json_format

from tandem.engine.bert import load_bert
from tandem.engine.config import EngineConfig
from tandem.engine.pooling import PoolingConfig, pool
from tandem.text.tokenizer import Tokenizer
from tandem.v1 import llm_pb2, types_pb2

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MODEL_KWARGS = ("token_type_ids",)


@dataclass(frozen=True)
class EncodeBatch:
    """One Encode call, validated: what the encoder thread runs."""

    token_ids: list[list[int]]
    token_type_ids: list[list[int]] | None
    return_raw: bool


def _tensor(t: torch.Tensor) -> llm_pb2.Tensor:
    return llm_pb2.Tensor(shape=list(t.shape), values=t.reshape(-1).tolist())


def _token_type_ids(
    model_kwargs: dict, token_ids: list[list[int]], type_vocab_size: int
) -> list[list[int]] | None:
    unknown = sorted(set(model_kwargs) - set(MODEL_KWARGS))
    if unknown:
        raise ValueError(
            f"unsupported model_kwargs {unknown}; this encoder accepts {list(MODEL_KWARGS)}"
        )
    if "token_type_ids" not in model_kwargs:
        return None
    raw = model_kwargs["token_type_ids"]
    if isinstance(raw, list) and len(token_ids) == 1 and raw and not isinstance(raw[0], list):
        raw = [raw]  # one input may give its ids flat
    if (
        not isinstance(raw, list)
        or len(raw) != len(token_ids)
        or not all(isinstance(r, list) for r in raw)
    ):
        raise ValueError(f"token_type_ids must be a list of {len(token_ids)} lists, one per input")
    out = []
    for i, (types, ids) in enumerate(zip(raw, token_ids)):
        if len(types) != len(ids):
            raise ValueError(f"token_type_ids[{i}] has {len(types)} entries for {len(ids)} tokens")
        # JSON numbers arrive as floats (google.protobuf.Struct); only whole values in range are ids.
        if not all(
            isinstance(t, (int, float)) and t == int(t) and 0 <= t < type_vocab_size for t in types
        ):
            raise ValueError(f"token_type_ids[{i}] must be integers in [0, {type_vocab_size})")
        out.append([int(t) for t in types])
    return out


class EncoderRuntime:
    def __init__(self, engine_config: EngineConfig):
        model_dir = engine_config.model_dir
        self.device = torch.device(engine_config.device)
        dtype = None if engine_config.dtype == "auto" else _DTYPES[engine_config.dtype]
        self.tokenizer = Tokenizer.from_dir(model_dir)
        self.model, self.config = load_bert(model_dir, dtype=dtype, device=self.device)
        self.pooling = PoolingConfig.from_model_dir(model_dir)
        # A shorter max_model_len caps inputs; nothing longer than the position table can run.
        limit = self.config.max_position_embeddings
        self.max_model_len = min(engine_config.max_model_len or limit, limit)
        # A pooled embedding: one hidden vector per pooling mode, concatenated (pooling.pool).
        self.embedding_size = len(self.pooling.modes) * self.config.hidden_size
        self._thread = concurrent.futures.ThreadPoolExecutor(
            max_workers=1, thread_name_prefix="tandem-encoder"
        )
        self.num_requests = 0
        self.num_tokens = 0

    def token_ids(self, prompt: types_pb2.Prompt, add_special_tokens: bool) -> list[int]:
        kind = prompt.WhichOneof("kind")
        if kind == "text":
            if not prompt.text:
                raise ValueError("an input is empty text: give text or token ids")
            ids = self.tokenizer.encode(prompt.text, add_special_tokens)
        elif kind == "token_ids":
            ids = list(prompt.token_ids.ids)
        elif kind == "preprocessed":
            ids = list(prompt.preprocessed.prompt_token_ids)
        else:
            raise ValueError("an input is empty: set text, token_ids or preprocessed")
        if not ids:
            raise ValueError("an input has no tokens")
        bad = [t for t in ids if not 0 <= t < self.config.vocab_size]
        if bad:
            raise ValueError(
                f"token ids out of vocabulary [0, {self.config.vocab_size}): {bad[:8]}"
            )
        if len(ids) > self.max_model_len:
            raise ValueError(
                f"an input has {len(ids)} tokens; this encoder takes at most {self.max_model_len}"
            )
        return ids

    def prepare(self, request: llm_pb2.EncodeRequest) -> EncodeBatch:
        if not request.inputs:
            raise ValueError("inputs is empty: give at least one text or token-id list")
        add_special = request.add_special_tokens if request.HasField("add_special_tokens") else True
        token_ids = [self.token_ids(p, add_special) for p in request.inputs]
        kwargs = (
            json_format.MessageToDict(request.model_kwargs)
            if request.HasField("model_kwargs")
            else {}
        )
        return EncodeBatch(
            token_ids,
            _token_type_ids(kwargs, token_ids, self.config.type_vocab_size),
            request.return_raw_logits,
        )

    def run(self, batch: EncodeBatch) -> llm_pb2.EncodeResponse:
        """The forward pass and the answer; runs on the encoder thread."""
        lengths = [len(ids) for ids in batch.token_ids]
        max_len = max(lengths)
        input_ids = torch.full((len(lengths), max_len), self.config.pad_token_id, dtype=torch.long)
        token_types = torch.zeros_like(input_ids)
        mask = torch.zeros_like(input_ids)
        for i, ids in enumerate(batch.token_ids):
            input_ids[i, : len(ids)] = torch.tensor(ids)
            mask[i, : len(ids)] = 1
            if batch.token_type_ids is not None:
                token_types[i, : len(ids)] = torch.tensor(batch.token_type_ids[i])
        input_ids, token_types, mask = (t.to(self.device) for t in (input_ids, token_types, mask))
        hidden = self.model(input_ids, mask, token_types)
        # Padding rows are zeroed so the raw batch does not depend on what the pad positions computed.
        hidden = hidden.masked_fill(mask.unsqueeze(-1) == 0, 0).float().cpu()
        self.num_requests += len(lengths)
        self.num_tokens += sum(lengths)
        if batch.return_raw:
            return llm_pb2.EncodeResponse(raw=_tensor(hidden))
        pooled = pool(hidden, mask.cpu(), self.pooling)
        return llm_pb2.EncodeResponse(
            outputs=[
                llm_pb2.EncoderOutput(
                    prompt_token_ids=ids,
                    logits=_tensor(hidden[i, : len(ids)]),
                    pooled=_tensor(pooled[i]),
                )
                for i, ids in enumerate(batch.token_ids)
            ]
        )

    async def encode(self, request: llm_pb2.EncodeRequest) -> llm_pb2.EncodeResponse:
        batch = self.prepare(request)
        return await asyncio.get_running_loop().run_in_executor(self._thread, self.run, batch)

    def warm_up(self) -> None:
        """One tiny batch so the first real request does not pay for lazy init."""
        self.run(EncodeBatch([[min(1, self.config.vocab_size - 1)] * 4], None, False))
        self.num_requests = self.num_tokens = 0

    def close(self) -> None:
        self._thread.shutdown(wait=False, cancel_futures=True)
