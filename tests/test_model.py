"""The engine's model against transformers' implementation of the same tiny checkpoints."""

from __future__ import annotations

import json
import random

import pytest
import torch
import transformers

from tandem.engine.checkpoints import tiny_model_dir, write_tiny_checkpoint
from tandem.engine.loader import allocate_kv_cache, load_model
from tandem.engine.model_config import ModelConfig
from tandem.kernels.attention_metadata import AttentionMetadata

MODEL_TYPES = ["llama", "qwen2", "qwen3"]
ATOL = 1e-4

transformers.logging.set_verbosity_error()


class PagedRunner:
    """Minimal engine: scattered block allocation, flat batches of (seq_id, new_tokens)."""

    def __init__(self, model, config, block_size: int, num_blocks: int = 96, seed: int = 0):
        self.model, self.block_size = model, block_size
        self.kv_cache = allocate_kv_cache(config, num_blocks, block_size, torch.float32)
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)  # non-contiguous tables exercise paging
        self.block_tables: dict[int, list[int]] = {}
        self.lengths: dict[int, int] = {}

    def step(self, batch: list[tuple[int, list[int]]]) -> torch.Tensor:
        """Runs the new tokens of each sequence; returns logits [num_new_tokens, vocab]."""
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq_id, tokens in batch:
            start = self.lengths.get(seq_id, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq_id, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            self.lengths[seq_id] = end
            input_ids += tokens
            positions += range(start, end)
            query_lens.append(len(tokens))
            seq_lens.append(end)
            tables.append(table)
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, self.block_size)
        hidden = self.model(torch.tensor(input_ids), torch.tensor(positions), meta, self.kv_cache)
        return self.model.compute_logits(hidden)


@pytest.fixture(scope="module", params=MODEL_TYPES)
def checkpoint(request, tmp_path_factory):
    model_dir = write_tiny_checkpoint(tmp_path_factory.mktemp(request.param), request.param, seed=1)
    model, config = load_model(model_dir)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    return model_dir, model, config, hf_model


def hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


def random_tokens(config: ModelConfig, length: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(4, config.vocab_size, (length,), generator=gen).tolist()


@pytest.mark.parametrize("block_size", [4, 16])
def test_prefill_logits_match_transformers(checkpoint, block_size):
    _, model, config, hf_model = checkpoint
    tokens = random_tokens(config, 37, seed=block_size)
    logits = PagedRunner(model, config, block_size).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_incremental_decode_matches_full_sequence(checkpoint):
    _, model, config, hf_model = checkpoint
    tokens = random_tokens(config, 20, seed=1)
    expected = hf_logits(hf_model, tokens)
    runner = PagedRunner(model, config, block_size=4)
    got = [runner.step([(0, tokens[:9])])]
    got += [runner.step([(0, [token])]) for token in tokens[9:]]
    torch.testing.assert_close(torch.cat(got), expected, atol=ATOL, rtol=0)


def test_chunked_prefill_matches_full_sequence(checkpoint):
    _, model, config, hf_model = checkpoint
    tokens = random_tokens(config, 30, seed=2)
    runner = PagedRunner(model, config, block_size=8)
    got = torch.cat([runner.step([(0, tokens[:13])]), runner.step([(0, tokens[13:])])])
    torch.testing.assert_close(got, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_mixed_batch_of_prefill_chunk_and_decodes(checkpoint):
    _, model, config, hf_model = checkpoint
    seqs = {
        seq_id: random_tokens(config, n, seed=10 + seq_id)
        for seq_id, n in enumerate([12, 9, 21, 15])
    }
    runner = PagedRunner(model, config, block_size=4)
    runner.step([(1, seqs[1][:-1]), (2, seqs[2][:-1]), (3, seqs[3][:6])])
    # One fresh prefill, two decodes and one continuing prefill chunk in a single step.
    logits = runner.step([(1, seqs[1][-1:]), (0, seqs[0]), (2, seqs[2][-1:]), (3, seqs[3][6:])])
    rows = torch.split(logits, [1, 12, 1, 9])
    torch.testing.assert_close(rows[0], hf_logits(hf_model, seqs[1])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(rows[1], hf_logits(hf_model, seqs[0]), atol=ATOL, rtol=0)
    torch.testing.assert_close(rows[2], hf_logits(hf_model, seqs[2])[-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(rows[3], hf_logits(hf_model, seqs[3])[6:], atol=ATOL, rtol=0)


@pytest.mark.parametrize("block_size", [4, 16])
def test_greedy_generation_matches_transformers(checkpoint, block_size):
    model_dir, model, config, hf_model = checkpoint
    tokenizer = transformers.AutoTokenizer.from_pretrained(model_dir)
    prompts = [
        "Hello world",
        "The quick brown fox jumps over the lazy dog and keeps running",
        "a",
        "def main(): return 42",
    ]
    prompt_ids = [tokenizer(p).input_ids for p in prompts]
    max_new_tokens = 16
    runner = PagedRunner(model, config, block_size)
    # All prompts prefilled in one step, then decoded together: continuous batching.
    logits = runner.step(list(enumerate(prompt_ids)))
    last_rows = torch.tensor([len(p) for p in prompt_ids]).cumsum(0) - 1
    generated = [[t] for t in logits[last_rows].argmax(-1).tolist()]
    for _ in range(max_new_tokens - 1):
        logits = runner.step([(i, [g[-1]]) for i, g in enumerate(generated)])
        for g, token in zip(generated, logits.argmax(-1).tolist()):
            g.append(token)
    for ids, ours in zip(prompt_ids, generated):
        with torch.no_grad():
            out = hf_model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                max_new_tokens=max_new_tokens,
                do_sample=False,
            )
        theirs = out[0, len(ids) :].tolist()
        # transformers stops at EOS; the engine here does not, so compare up to there.
        assert ours[: len(theirs)] == theirs
        if len(theirs) < max_new_tokens:
            assert theirs[-1] in config.eos_token_ids


def test_llama3_rope_scaling_matches_transformers(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, "llama", seed=3)
    raw = json.loads((model_dir / "config.json").read_text())
    # A short original context makes the scaling change every frequency band within 64 tokens.
    raw["rope_scaling"] = {
        "rope_type": "llama3",
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    }
    raw["rope_theta"] = 500000.0
    (model_dir / "config.json").write_text(json.dumps(raw))
    model, config = load_model(model_dir)
    assert config.rope_scaling["rope_type"] == "llama3"
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32
    ).eval()
    tokens = random_tokens(config, 80, seed=3)
    logits = PagedRunner(model, config, block_size=16).step([(0, tokens)])
    torch.testing.assert_close(logits, hf_logits(hf_model, tokens), atol=ATOL, rtol=0)


def test_bf16_load_runs(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, "qwen3", seed=0)
    model, config = load_model(model_dir, dtype=torch.bfloat16)
    runner = PagedRunner(model, config, block_size=4)
    runner.kv_cache = runner.kv_cache.to(torch.bfloat16)
    logits = runner.step([(0, random_tokens(config, 10, seed=0))])
    assert logits.dtype == torch.float32 and torch.isfinite(logits).all()


@pytest.mark.parametrize("model_type", MODEL_TYPES)
def test_checkpoint_is_deterministic(tmp_path, model_type):
    first = write_tiny_checkpoint(tmp_path / "a", model_type)
    second = write_tiny_checkpoint(tmp_path / "b", model_type)
    names = sorted(p.name for p in first.iterdir())
    assert names == sorted(p.name for p in second.iterdir())
    assert {
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "generation_config.json",
    } <= set(names)
    for name in names:
        assert (first / name).read_bytes() == (second / name).read_bytes(), name


def test_tokenizer_round_trips_and_adds_bos(tmp_path):
    tokenizer = transformers.AutoTokenizer.from_pretrained(write_tiny_checkpoint(tmp_path))
    text = "Hello, wörld! 日本語 tokens\n  x = 1"
    ids = tokenizer(text).input_ids
    assert ids[0] == tokenizer.bos_token_id == 1 and tokenizer.eos_token_id == 2
    assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_tiny_model_dir_is_created_once(tmp_path, monkeypatch):
    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    first = tiny_model_dir()
    assert first == tmp_path / "models" / "tiny-llama-v2"
    stamp = (first / "model.safetensors").stat().st_mtime_ns
    assert tiny_model_dir() == first
    assert (first / "model.safetensors").stat().st_mtime_ns == stamp
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama-v2"]
    assert ModelConfig.from_pretrained(first).model_type == "llama"


def test_unsupported_model_type_is_rejected(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, "llama")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "model_type": "gpt2"}))
    # tandem's own decoder (the transformers path takes it with model_impl auto or transformers).
    with pytest.raises(ValueError, match="unsupported model_type 'gpt2'"):
        ModelConfig.from_pretrained(model_dir, "tandem")
    del raw["hidden_size"]
    with pytest.raises(ValueError, match="hidden_size"):
        ModelConfig.from_dict(raw)
    with pytest.raises(ValueError, match="rope scaling type .mrope."):
        ModelConfig.from_dict(
            {**raw, "hidden_size": 64, "rope_scaling": {"rope_type": "mrope", "factor": 4.0}}
        )


def test_missing_and_unexpected_tensors_are_named(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_tiny_checkpoint(tmp_path, "llama")
    tensors = load_file(model_dir / "model.safetensors")
    tensors["model.layers.0.extra.weight"] = tensors.pop("model.layers.1.mlp.up_proj.weight")
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ValueError, match=r"model\.layers\.1\.mlp\.up_proj\.weight.*model\.layers\.0\.extra\.weight"
    ):
        load_model(model_dir)


def test_shape_mismatch_is_a_value_error(tmp_path):
    model_dir = write_tiny_checkpoint(tmp_path, "qwen2")
    raw = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**raw, "intermediate_size": 128}))
    with pytest.raises(ValueError, match="gate_proj"):
        load_model(model_dir)


def test_tiny_model_dir_survives_concurrent_first_use(tmp_path, monkeypatch):
    from concurrent.futures import ThreadPoolExecutor

    monkeypatch.setenv("TANDEM_HOME", str(tmp_path))
    with ThreadPoolExecutor(4) as pool:
        dirs = list(pool.map(lambda _: tiny_model_dir(), range(4)))
    assert len(set(dirs)) == 1
    assert [p.name for p in (tmp_path / "models").iterdir()] == ["tiny-llama-v2"]
    load_model(dirs[0])


def test_sharded_checkpoint_loads_like_single_file(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = write_tiny_checkpoint(tmp_path, "llama", seed=5)
    single, config = load_model(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[::2],
        "model-00002-of-00002.safetensors": names[1::2],
    }
    for file_name, shard_names in shards.items():
        save_file(
            {n: tensors[n] for n in shard_names}, model_dir / file_name, metadata={"format": "pt"}
        )
    (model_dir / "model.safetensors").unlink()
    weight_map = {n: f for f, shard_names in shards.items() for n in shard_names}
    (model_dir / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    sharded, _ = load_model(model_dir)
    for (name, a), (_, b) in zip(single.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name
