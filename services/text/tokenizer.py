"""The served model's tokenizer (the `tokenizers` library over tokenizer.json)."""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer

# Files GetTokenizer ships so a client (or the router) can rebuild the same tokenizer.
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "generation_config.json",
    "chat_template.jinja",
)


class Tokenizer:
    def __init__(self, files: dict[str, bytes], name: str = ""):
        """files: the TOKENIZER_FILES present (at least tokenizer.json), by name."""
        if "tokenizer.json" not in files:
            raise ValueError(
                f"{name or 'the model'} has no tokenizer.json; tandem needs a fast (tokenizers) tokenizer"
            )
        self.name = name
        self._files = dict(files)
        self.backend = HfTokenizer.from_str(files["tokenizer.json"].decode())
        # Some tokenizer.json files (sentence-transformers exports) pad and truncate every
        # encoding to a fixed length; the server checks lengths itself and pads batches as it needs.
        self.backend.no_padding()
        self.backend.no_truncation()
        self.vocab_size = self.backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def from_dir(cls, model_dir: str | Path) -> Tokenizer:
        model_dir = Path(model_dir)
        files = {
            name: (model_dir / name).read_bytes()
            for name in TOKENIZER_FILES
            if (model_dir / name).is_file()
        }
        return cls(files, str(model_dir))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def encode_long(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """encode() for a long text, on a worker thread: tokenizers' encode_batch lets go of the
        GIL while it works (encode does not: a 3 MB prompt would hold every other thread,
        the event loop included, for seconds)."""
        return self.backend.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def files(self) -> dict[str, bytes]:
        return dict(self._files)

    def generation_eos_ids(self) -> tuple[int, ...]:
        """eos ids from generation_config.json, which may list several (Llama 3)."""
        raw = self._files.get("generation_config.json")
        eos = json.loads(raw).get("eos_token_id") if raw else None
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (int(eos),)
