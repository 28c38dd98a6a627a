"""The served model's tokenizer (the `tokenizers` library over tokenizer.json)."""
from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as HfTokenizer

# Files GetTokenizer ships so a client can rebuild the same tokenizer.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json",
                   "chat_template.jinja")


class Tokenizer:
    def __init__(self, model_dir: str | Path):
        self.model_dir = Path(model_dir)
        path = self.model_dir / "tokenizer.json"
        if not path.is_file():
            raise ValueError(f"{self.model_dir} has no tokenizer.json; tandem needs a fast (tokenizers) tokenizer")
        self._tok = HfTokenizer.from_file(str(path))
        # Some tokenizer.json files (sentence-transformers exports) pad and truncate every
        # encoding to a fixed length; the server checks lengths itself and pads batches as it needs.
        self._tok.no_padding()
        self._tok.no_truncation()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def files(self) -> dict[str, bytes]:
        return {name: (self.model_dir / name).read_bytes() for name in TOKENIZER_FILES
                if (self.model_dir / name).is_file()}


def generation_eos_ids(model_dir: str | Path) -> tuple[int, ...]:
    """eos ids from generation_config.json, which may list several (Llama 3)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return ()
    eos = json.loads(path.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (int(eos),)
