"""GGUF checkpoints on tiny models: converting a GGUF written from a known checkpoint gives
that checkpoint back; quantized tensors dequantize as transformers' GGUF loader does; the
converted directory is cached by content and safe to create from several processes at once."""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch
from safetensors.torch import load_file
from tiny_gguf import write_tiny_gguf
from tokenizers import Tokenizer

from tandem.engine.checkpoints import gguf_model_dir, resolve_model
from tandem.engine.gguf_convert import convert_gguf, hf_config
from tandem.engine.gguf_tokenizer import build_tokenizer
from tandem.engine.loader import load_model

TEXTS = [
    "Hello, world! The quick brown fox.",
    "  spaces\tand\nnewlines  ",
    "ünïcödé 日本語 🤖 x=1",
    "<s>already special</s>",
]


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_f32_gguf_converts_back_to_the_original_checkpoint(model_dirs, tmp_path, model):
    original = model_dirs[model]
    converted = convert_gguf(
        write_tiny_gguf(original, tmp_path / "tiny.gguf"), tmp_path / "converted"
    )
    want, got = (
        load_file(original / "model.safetensors"),
        load_file(converted / "model.safetensors"),
    )
    assert sorted(got) == sorted(want)
    for name in want:
        assert torch.equal(got[name], want[name]), name  # the rotary permutation is undone exactly
    config, original_config = (
        json.loads((d / "config.json").read_text()) for d in (converted, original)
    )
    for key in (
        "model_type",
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "rms_norm_eps",
        "rope_theta",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert config[key] == pytest.approx(original_config[key]), key
    ours, theirs = (Tokenizer.from_file(str(d / "tokenizer.json")) for d in (converted, original))
    for text in TEXTS:
        ids = theirs.encode(text).ids
        assert ours.encode(text).ids == ids
        assert ours.decode(ids, skip_special_tokens=False) == theirs.decode(
            ids, skip_special_tokens=False
        )
    template = json.loads((original / "tokenizer_config.json").read_text())["chat_template"]
    assert (
        json.loads((converted / "tokenizer_config.json").read_text())["chat_template"] == template
    )
    load_model(converted)


def test_quantized_gguf_dequantizes_like_transformers(model_dirs, tmp_path):
    from transformers import AutoModelForCausalLM

    path = write_tiny_gguf(model_dirs["llama"], tmp_path / "tiny-q8.gguf", quantization="Q8_0")
    ours = load_file(convert_gguf(path, tmp_path / "converted") / "model.safetensors")
    reference = AutoModelForCausalLM.from_pretrained(
        tmp_path, gguf_file=path.name, dtype=torch.float32
    ).state_dict()
    original = load_file(model_dirs["llama"] / "model.safetensors")
    for name, tensor in ours.items():
        # float16 on disk (a quantized file's own width): transformers' float32 values, rounded once.
        assert tensor.dtype == torch.float16, name
        assert torch.equal(tensor, reference[name].to(torch.float16)), name
        assert torch.allclose(tensor.float(), original[name], atol=0.05), name  # Q8_0 is close


def test_converted_directory_is_cached_by_content_and_race_free(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path / "home"))
    path = write_tiny_gguf(model_dirs["llama"], tmp_path / "tiny.gguf")
    with ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(lambda _: resolve_model(str(path)), range(4)))
    assert len(set(dirs)) == 1 and dirs[0].parent == tmp_path / "home" / "models" / "gguf"
    assert [p.name for p in dirs[0].parent.iterdir()] == [dirs[0].name]
    stamp = (dirs[0] / "model.safetensors").stat().st_mtime_ns
    assert (
        gguf_model_dir(path) == dirs[0]
        and (dirs[0] / "model.safetensors").stat().st_mtime_ns == stamp
    )
    other = write_tiny_gguf(model_dirs["qwen2"], tmp_path / "tiny.gguf")  # same name, other content
    assert gguf_model_dir(other) != dirs[0]


def test_bad_gguf_inputs_are_value_errors(model_dirs, tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        resolve_model(str(tmp_path / "missing.gguf"))
    (tmp_path / "fake.gguf").write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError, match="not a readable GGUF file"):
        convert_gguf(tmp_path / "fake.gguf", tmp_path / "out")
    assert resolve_model(str(model_dirs["llama"])) == model_dirs["llama"]
    with pytest.raises(ValueError, match="unsupported GGUF architecture 'gpt2'"):
        hf_config({"general.architecture": "gpt2"}, set())
    with pytest.raises(ValueError, match="no tokenizer"):
        hf_config({"general.architecture": "llama", "llama.block_count": 2}, set())
    with pytest.raises(ValueError, match="unsupported GGUF tokenizer model 'llama'"):
        build_tokenizer({"ggml.model": "llama", "ggml.tokens": ["a"]})
