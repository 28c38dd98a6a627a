"""The served model's tokenizer, as the client's `tokenizer` property returns it.

It offers what TensorRT-LLM's tokenizer wrapper (tensorrt_llm/tokenizer/tokenizer.py,
TransformersTokenizer) offers: encode/decode, special tokens and their ids, the vocabulary,
convert_ids_to_tokens, batch_decode and apply_chat_template with the model's template.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from tandem.client.chat_template import render_chat_template
from tandem.v1 import llm_pb2, types_pb2

SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "pad_token")


class RemoteTokenizer:
    """encode/decode with the served model's tokenizer. Uses the `tokenizers` library on the
    shipped tokenizer.json when it is installed, else the server's Preprocess/Detokenize RPCs."""

    def __init__(self, llm, files: llm_pb2.TokenizerFiles):
        self._llm = llm
        self.files: dict[str, bytes] = dict(files.files)
        self.eos_token_ids: list[int] = list(files.eos_token_ids)
        self.bos_token_id: int | None = (
            files.bos_token_id if files.HasField("bos_token_id") else None
        )
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

    def _json(self, name: str) -> dict:
        raw = self.files.get(name)
        return json.loads(raw) if raw else {}

    @property
    def config(self) -> dict:
        return self._json("tokenizer_config.json")

    # -- vocabulary (read from tokenizer.json: works without the `tokenizers` library) --
    @functools.cached_property
    def _vocab(self) -> dict[str, int]:
        vocab = self._json("tokenizer.json").get("model", {}).get("vocab") or {}
        if isinstance(vocab, list):  # Unigram models list [piece, score] pairs
            return {piece: i for i, (piece, _score) in enumerate(vocab)}
        return dict(vocab)

    @functools.cached_property
    def _added(self) -> dict[str, dict]:
        return {t["content"]: t for t in self._json("tokenizer.json").get("added_tokens", [])}

    @functools.cached_property
    def _id_to_token(self) -> dict[int, str]:
        return {i: t for t, i in self.get_vocab().items()}

    def get_vocab(self) -> dict[str, int]:
        return {**self._vocab, **self.get_added_vocab()}

    def get_added_vocab(self) -> dict[str, int]:
        return {content: t["id"] for content, t in self._added.items()}

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' vocab_size; len() counts all)."""
        return len(self._vocab)

    def __len__(self) -> int:
        return len(self.get_vocab())

    def convert_ids_to_tokens(self, ids: int | list[int], skip_special_tokens: bool = False):
        if isinstance(ids, int):
            return self._id_to_token.get(ids)
        special = set(self.all_special_ids) if skip_special_tokens else set()
        return [self._id_to_token.get(i) for i in ids if i not in special]

    def convert_tokens_to_ids(self, tokens: str | list[str]):
        vocab = self.get_vocab()
        unk = self.unk_token_id
        if isinstance(tokens, str):
            return vocab.get(tokens, unk)
        return [vocab.get(t, unk) for t in tokens]

    # -- special tokens --
    def _special_token(self, name: str) -> str | None:
        token = self.config.get(name) or self._json("special_tokens_map.json").get(name)
        return token.get("content") if isinstance(token, dict) else token

    bos_token = property(lambda self: self._special_token("bos_token"))
    eos_token = property(lambda self: self._special_token("eos_token"))
    unk_token = property(lambda self: self._special_token("unk_token"))
    pad_token = property(lambda self: self._special_token("pad_token"))

    @property
    def eos_token_id(self) -> int | None:
        return self.eos_token_ids[0] if self.eos_token_ids else None

    @property
    def pad_token_id(self) -> int | None:
        return self.get_vocab().get(self.pad_token) if self.pad_token else None

    @property
    def unk_token_id(self) -> int | None:
        return self.get_vocab().get(self.unk_token) if self.unk_token else None

    @property
    def special_tokens_map(self) -> dict[str, str]:
        return {name: token for name in SPECIAL_TOKEN_NAMES if (token := self._special_token(name))}

    @property
    def all_special_tokens(self) -> list[str]:
        named = list(self.special_tokens_map.values())
        return named + [
            t for t, spec in self._added.items() if spec.get("special") and t not in named
        ]

    @property
    def all_special_ids(self) -> list[int]:
        vocab = self.get_vocab()
        return [vocab[t] for t in self.all_special_tokens if t in vocab]

    @property
    def name_or_path(self) -> str:
        return self._llm._server_info().model

    @property
    def is_fast(self) -> bool:
        return "tokenizer.json" in self.files

    @property
    def clean_up_tokenization_spaces(self) -> bool:
        return bool(self.config.get("clean_up_tokenization_spaces", False))

    # -- text --
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        if self._local is not None:
            return self._local.encode(text, add_special_tokens=add_special_tokens).ids
        params = types_pb2.SamplingParams(add_special_tokens=add_special_tokens)
        out = self._llm._call(
            "Preprocess",
            llm_pb2.PreprocessRequest(prompt=types_pb2.Prompt(text=text), sampling_params=params),
        )
        return list(out.prompt_token_ids)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self._local is not None:
            return self._local.decode(token_ids, skip_special_tokens=skip_special_tokens)
        out = self._llm._call(
            "Detokenize",
            llm_pb2.DetokenizeRequest(token_ids=token_ids, skip_special_tokens=skip_special_tokens),
        )
        return out.text

    def batch_decode(
        self, sequences: list[list[int]], skip_special_tokens: bool = True
    ) -> list[str]:
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict:
        return {"input_ids": self.encode(text, add_special_tokens)}

    # -- chat --
    @property
    def chat_template(self) -> str | dict[str, str] | None:
        # Recent transformers save the template beside tokenizer_config.json rather than in it.
        if "chat_template.jinja" in self.files:
            return self.files["chat_template.jinja"].decode()
        template = self.config.get("chat_template")
        if isinstance(
            template, list
        ):  # transformers also writes named templates as [{name, template}]
            return {t["name"]: t["template"] for t in template}
        return template

    def get_chat_template(
        self, chat_template: str | None = None, tools: list[dict] | None = None
    ) -> str:
        """The template to render: the argument, else the model's (by name when it has several)."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template in templates:
                return templates[chat_template]
            if chat_template is None:
                name = "tool_use" if tools is not None and "tool_use" in templates else "default"
                if name not in templates:
                    raise ValueError(
                        f"the model has several chat templates and none is named 'default': pass one "
                        f"of {sorted(templates)} as chat_template"
                    )
                return templates[name]
        if chat_template is not None:
            return chat_template
        if not templates:
            raise ValueError(
                f"the model {self.name_or_path!r} has no chat template: pass chat_template="
            )
        return templates

    def apply_chat_template(
        self,
        conversation,
        tools: list[dict] | None = None,
        documents: list[dict] | None = None,
        chat_template: str | None = None,
        add_generation_prompt: bool = False,
        continue_final_message: bool | str = False,
        tokenize: bool = False,
        return_dict: bool = False,
        **kwargs: Any,
    ):
        """Renders the conversation with the model's chat template as transformers does; token ids
        (encoded without adding special tokens, as transformers does) when tokenize=True."""
        rendered = render_chat_template(
            self.get_chat_template(chat_template, tools),
            conversation,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            documents=documents,
            **{**self.special_tokens_map, **kwargs},
        )
        if not tokenize:
            return rendered
        texts = rendered if isinstance(rendered, list) else [rendered]
        ids = [self.encode(text, add_special_tokens=False) for text in texts]
        ids = ids if isinstance(rendered, list) else ids[0]
        return {"input_ids": ids} if return_dict else ids
