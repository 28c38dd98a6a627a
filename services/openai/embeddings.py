"""/v1/embeddings on a cluster serving an encoder (sentence-embedding) model, through Encode."""

from __future__ import annotations

import base64
import struct
import time
from typing import Literal

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, model_validator

from tandem.openai.errors import OpenAIError
from tandem.openai.front import Front, awaited_unless_gone, log_ignored

# OpenAI's own bounds: 2048 inputs a request; a text is bounded here by characters (the encoder
# refuses what passes its context, 512 tokens for MiniLM, with a message).
MAX_INPUTS = 2048
MAX_TEXT_CHARS = 1 << 16
MAX_TOKEN_IDS = 1 << 16


class EmbeddingRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str
    input: str | list[str] | list[int] | list[list[int]]
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = Field(None, ge=1)
    user: str | None = None
    # vLLM's extension.
    add_special_tokens: bool = True

    @property
    def ignored_fields(self) -> list[str]:
        return sorted(self.model_extra or {})

    @model_validator(mode="after")
    def _bounded(self):
        inputs = self.inputs
        if not inputs:
            raise ValueError("input must not be empty")
        if len(inputs) > MAX_INPUTS:
            raise ValueError(f"input has {len(inputs)} entries; at most {MAX_INPUTS}")
        for i, item in enumerate(inputs):
            if isinstance(item, str):
                if not item:
                    raise ValueError(f"input[{i}] is an empty string")
                if len(item) > MAX_TEXT_CHARS:
                    raise ValueError(
                        f"input[{i}] has {len(item)} characters; at most {MAX_TEXT_CHARS}"
                    )
            elif not item or len(item) > MAX_TOKEN_IDS:
                raise ValueError(f"input[{i}] must have 1 to {MAX_TOKEN_IDS} token ids")
        return self

    @property
    def inputs(self) -> list[str | list[int]]:
        """One entry per embedding: a text or a list of token ids."""
        if isinstance(self.input, str):
            return [self.input]
        if self.input and all(isinstance(t, int) for t in self.input):
            return [list(self.input)]
        return list(self.input)


def _encoded(values: list[float], encoding_format: str) -> list[float] | str:
    if encoding_format == "float":
        return values
    # OpenAI's base64: the float32 values, little-endian.
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode()


def _check_dimensions(requested: int | None, dimension: int) -> None:
    """dimensions must be the model's own (0: not known yet, nothing to check)."""
    if requested is not None and dimension and requested != dimension:
        raise OpenAIError(
            400,
            f"dimensions={requested}: this model's embeddings have {dimension} "
            "dimensions and it was not trained to be shortened (matryoshka); leave dimensions "
            f"out or give {dimension}",
            "dimensions",
        )


async def embeddings(front: Front, request: EmbeddingRequest, http: Request | None = None) -> dict:
    """http: the HTTP request, watched so that a client gone mid-encode cancels the Encode."""
    started, endpoint = time.monotonic(), "/v1/embeddings"
    model, adapter = await front.check_model(request.model)
    if adapter is not None:
        raise OpenAIError(400, f"`{model}` is a LoRA adapter: adapters do not embed", "model")
    info = await front.info()
    if not info.encode_only:
        raise OpenAIError(
            400,
            f"The model `{model}` does not support the embeddings API: it generates text. "
            "Serve an encoder (sentence-embedding) model, e.g. all-MiniLM-L6-v2, for /v1/embeddings.",
            "model",
        )
    log_ignored(endpoint, request)
    _check_dimensions(request.dimensions, info.embedding_size)  # before any work is done
    outs = await awaited_unless_gone(
        http,
        front.llm.encode_async(request.inputs, add_special_tokens=request.add_special_tokens),
    )
    num_tokens = sum(len(out.prompt_token_ids) for out in outs)
    front.observe(endpoint, started, num_tokens, 0)
    return {
        "object": "list",
        "data": [
            {
                "object": "embedding",
                "index": i,
                "embedding": _encoded(list(out.pooled), request.encoding_format),
            }
            for i, out in enumerate(outs)
        ],
        "model": model,
        "usage": {"prompt_tokens": num_tokens, "total_tokens": num_tokens},
    }
