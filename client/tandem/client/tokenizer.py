"""The served model's tokenizer, as the client's `tokenizer` property returns it."""
from __future__ import annotations

import json
from typing import Optional

from tandem.v1 import llm_pb2, types_pb2


class RemoteTokenizer:
    """encode/decode with the served model's tokenizer. Uses the `tokenizers` library on the
    shipped tokenizer.json when it is installed, else the server's Preprocess/Detokenize RPCs."""

    def __init__(self, llm, files: llm_pb2.TokenizerFiles):
        self._llm = llm
        self.files: dict[str, bytes] = dict(files.files)
        self.eos_token_ids: list[int] = list(files.eos_token_ids)
        self.bos_token_id: Optional[int] = files.bos_token_id if files.HasField("bos_token_id") else None
        self._local = None
        try:
            from tokenizers import Tokenizer
            if "tokenizer.json" in self.files:
                self._local = Tokenizer.from_str(self.files["tokenizer.json"].decode())
                # As on the server: no fixed-length padding or silent truncation from tokenizer.json.
                self._local.no_padding()
                self._local.no_truncation()
        except ImportError:
            pass

    @property
    def eos_token_id(self) -> Optional[int]:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def config(self) -> dict:
        raw = self.files.get("tokenizer_config.json")
        return json.loads(raw) if raw else {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._local is not None:
            return self._local.encode(text, add_special_tokens=add_special_tokens).ids
        params = types_pb2.SamplingParams(add_special_tokens=add_special_tokens)
        out = self._llm._call("Preprocess", llm_pb2.PreprocessRequest(prompt=types_pb2.Prompt(text=text),
                                                                      sampling_params=params))
        return list(out.prompt_token_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._local is not None:
            return self._local.decode(token_ids, skip_special_tokens=skip_special_tokens)
        out = self._llm._call("Detokenize", llm_pb2.DetokenizeRequest(token_ids=token_ids,
                                                                      skip_special_tokens=skip_special_tokens))
        return out.text

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}
