"""Guided decoding with xgrammar, as TensorRT-LLM's PyTorch backend does it
(_torch/pyexecutor/grammar_matcher.py, XGrammarMatcherFactory): one compiler over the served
tokenizer, a grammar compiled per request (JSON schema, any JSON, regex, EBNF grammar,
structural tag), and one matcher per sequence that masks the logits before each draw and
accepts each drawn token.

xgrammar is imported on first use: a worker without it serves every other request.
"""

from __future__ import annotations

import torch


def _xgrammar():
    try:
        import xgrammar
    except ImportError as exc:  # pragma: no cover - the Makefile installs it
        raise NotImplementedError(
            "guided_decoding needs the xgrammar package on the worker"
        ) from exc
    return xgrammar


class GuideCompiler:
    """Compiles guides for one tokenizer (compiled grammars are cached by xgrammar)."""

    def __init__(
        self,
        tokenizer_json: str,
        encoded_vocab: list[str],
        vocab_size: int,
        stop_token_ids: list[int],
    ):
        xgr = _xgrammar()
        metadata = xgr.TokenizerInfo._detect_metadata_from_hf(tokenizer_json)
        vocab_type = metadata["vocab_type"]
        if _has_byte_level_decoder(tokenizer_json):
            # xgrammar takes a ByteFallback step anywhere in the decoder for a SentencePiece
            # vocabulary; transformers' GGUF conversion of a byte-level BPE (SmolLM2's) lists
            # ByteFallback before its ByteLevel step, and read as byte-fallback its "Ġ" tokens
            # were no spaces: a regex or grammar with a space could never be written.
            vocab_type = xgr.VocabType.BYTE_LEVEL
        info = xgr.TokenizerInfo(
            encoded_vocab,
            vocab_type=vocab_type,
            vocab_size=vocab_size,
            stop_token_ids=list(stop_token_ids),
            add_prefix_space=metadata["add_prefix_space"],
        )
        self._compiler = xgr.GrammarCompiler(info, cache_enabled=True)
        # What rebuilds this compiler's grammars in another process (CompiledGrammar.deserialize_json).
        self.tokenizer_info_json = info.serialize_json()

    def compile(self, kind: str, value):
        """A compiled grammar for a guide; a guide xgrammar cannot compile is a ValueError."""
        try:
            if kind == "json_object":
                return self._compiler.compile_builtin_json_grammar()
            if kind == "json_schema":
                return self._compiler.compile_json_schema(value)
            if kind == "regex":
                return self._compiler.compile_regex(value)
            if kind == "grammar":
                return self._compiler.compile_grammar(value)
            if kind == "structural_tag":
                return self._compiler.compile_structural_tag(value)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise ValueError(f"guided_decoding.{kind} does not compile: {exc}") from exc
        raise ValueError(f"unknown guide {kind!r}")


def _has_byte_level_decoder(tokenizer_json: str) -> bool:
    import json

    decoder = json.loads(tokenizer_json).get("decoder") or {}
    steps = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(step.get("type") == "ByteLevel" for step in steps)


def new_matcher(compiled, output_token_ids: list[int]):
    """A matcher that has accepted the tokens already generated (a handoff, a migration)."""
    matcher = _xgrammar().GrammarMatcher(compiled)
    for token in output_token_ids:
        if not matcher.accept_token(token):
            raise ValueError(f"token {token} generated so far does not follow the guide")
    return matcher


def allowed_bitmask(matchers: list, vocab_size: int) -> torch.Tensor:
    """[rows, ceil(vocab/32)] int32 bits of the tokens each row may draw; a row without a matcher
    allows everything."""
    bitmask = _xgrammar().allocate_token_bitmask(len(matchers), vocab_size)
    for row, matcher in enumerate(matchers):
        if matcher is not None:
            matcher.fill_next_token_bitmask(bitmask, row)
    return bitmask


def unpack_bitmask(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The bool [rows, vocab] the int32 bitmask stands for (bit j of word i: token 32 * i + j)."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    return ((bitmask.unsqueeze(-1) >> bits) & 1).bool().view(bitmask.shape[0], -1)[:, :vocab_size]
