"""A request's guided_decoding compiled for the engine (off the event loop and off the engine
thread: a JSON schema compiles in tens of milliseconds, the tokenizer's tables once per worker)."""

from __future__ import annotations

import asyncio
import threading

from tandem.engine.guided import GuideCompiler
from tandem.v1 import types_pb2


class Guides:
    def __init__(self, runtime):
        self.rt = runtime
        self._compiler: GuideCompiler | None = None
        self._lock = threading.Lock()

    async def compile(self, params: types_pb2.SamplingParams):
        """The compiled grammar of params.guided_decoding, or None when it sets no guide."""
        if not params.HasField("guided_decoding"):
            return None
        kind = params.guided_decoding.WhichOneof("guide")
        if kind is None or (kind == "json_object" and not params.guided_decoding.json_object):
            return None
        compiled = await asyncio.to_thread(
            self._compile, kind, getattr(params.guided_decoding, kind)
        )
        self.rt.core.send_guide_info(self._compiler.tokenizer_info_json)
        return compiled

    def _compile(self, kind: str, value):
        with self._lock:
            if self._compiler is None:
                backend = self.rt.tokenizer.backend
                vocab = backend.get_vocab(with_added_tokens=True)
                encoded = [""] * (max(vocab.values()) + 1)
                for token, index in vocab.items():
                    encoded[index] = token
                self._compiler = GuideCompiler(
                    backend.to_str(),
                    encoded,
                    self.rt.core.facts.model_config.vocab_size,
                    list(self.rt.eos_token_ids),
                )
        return self._compiler.compile(kind, value)
