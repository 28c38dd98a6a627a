"""Gemma 2/3, Phi-3, OLMo 2, Granite, sliding windows and rope scalings against transformers.

Each family's tiny checkpoint is built with transformers (tiny_families.py). The engine's model
runs the prompt in chunks over scattered KV blocks (test_model.PagedRunner), then decodes one
token a step; transformers runs the prompt whole, then decodes with its KV cache, as `generate`
does. Prompts are longer than every window, and the decodes of the phi3 (longrope), dynamic and
yarn checkpoints run past their original context length.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from test_model import PagedRunner
from tiny_families import FAMILIES, WINDOW, write_family_checkpoint

from tandem.engine.loader import load_model

PROMPT_LEN = 21
CHUNK = 6  # prefill chunks that straddle the window and the blocks
NUM_NEW = 15

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    model_dir = write_family_checkpoint(tmp_path_factory.mktemp(request.param), request.param)
    model, config = load_model(model_dir)
    # Eager attention: transformers' SDPA path drops Gemma 2's score soft-capping.
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return request.param, model, config, hf_model


def _prompt(vocab_size: int, seed: int) -> list[int]:
    gen = torch.Generator().manual_seed(seed)
    return [1] + torch.randint(4, vocab_size, (PROMPT_LEN - 1,), generator=gen).tolist()


def hf_greedy(
    hf_model, prompt: list[int], num_new: int = NUM_NEW
) -> tuple[torch.Tensor, list[int]]:
    """The prompt's logits and num_new greedy tokens, decoded over transformers' KV cache. Not
    `generate`: for Phi-3, transformers' generate drops the cache when a sequence grows past
    original_max_position_embeddings and runs it again with the long factors; its model, like
    tandem, keeps the keys it rotated (rope.py)."""
    cache = transformers.DynamicCache(config=hf_model.config)
    with torch.no_grad():
        out = hf_model(torch.tensor([prompt]), past_key_values=cache, use_cache=True)
        prompt_logits = out.logits[0].float()
        tokens = [int(prompt_logits[-1].argmax())]
        for _ in range(num_new - 1):
            out = hf_model(torch.tensor([[tokens[-1]]]), past_key_values=cache, use_cache=True)
            tokens.append(int(out.logits[0, -1].argmax()))
    return prompt_logits, tokens


def _tandem_greedy(model, config, prompt: list[int], block_size: int):
    runner = PagedRunner(model, config, block_size)
    logits = torch.cat(
        [runner.step([(0, prompt[i : i + CHUNK])]) for i in range(0, len(prompt), CHUNK)]
    )
    tokens = [int(logits[-1].argmax())]
    for _ in range(NUM_NEW - 1):
        tokens.append(int(runner.step([(0, [tokens[-1]])])[-1].argmax()))
    return logits, tokens


def test_config_reads_the_family(family):
    name, _, config, hf_model = family
    assert config.model_type == hf_model.config.model_type
    windows = {
        "mistral": (WINDOW, WINDOW),
        "phi3": (WINDOW, WINDOW),
        "qwen2_window": (0, WINDOW),  # from max_window_layers (1) on
        "gemma2": (WINDOW, 0),
        "gemma3_text": (WINDOW, 0),
    }
    assert config.layer_windows == windows.get(name, (0, 0))


@pytest.mark.parametrize("block_size", [5])
def test_chunked_prefill_and_decode_match_transformers(family, block_size):
    _, model, config, hf_model = family
    prompt = _prompt(config.vocab_size, seed=block_size)
    hf_logits, hf_tokens = hf_greedy(hf_model, prompt)
    logits, tokens = _tandem_greedy(model, config, prompt, block_size)
    torch.testing.assert_close(logits, hf_logits, atol=1e-4, rtol=0)
    assert tokens == hf_tokens


def test_batched_sequences_keep_to_themselves(family):
    """Two sequences in one step (a decode beside a prefill chunk) give what each gives alone,
    each within its own window where the family has one."""
    _, model, config, hf_model = family
    first, second = _prompt(config.vocab_size, seed=5), _prompt(config.vocab_size, seed=6)
    runner = PagedRunner(model, config, 8)
    runner.step([(0, first)])
    mixed = runner.step([(0, [7]), (1, second[:13])])
    mixed = torch.cat([mixed, runner.step([(1, second[13:])])])
    hf_first = _hf_logits(hf_model, first + [7])[-1]
    torch.testing.assert_close(mixed[0], hf_first, atol=1e-4, rtol=0)
    torch.testing.assert_close(mixed[1:], _hf_logits(hf_model, second), atol=1e-4, rtol=0)


def _hf_logits(hf_model, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(torch.tensor([tokens])).logits[0].float()


@pytest.mark.parametrize(
    "quantization_config, method",
    [
        ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm"}, "'awq'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}, "'gptq'"),
        ({"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}, "'bitsandbytes'"),
    ],
)
def test_quantized_checkpoint_is_refused_in_one_line_before_any_weight_is_read(
    tmp_path, quantization_config, method
):
    import json
    import time

    model_dir = write_family_checkpoint(tmp_path, "mistral")
    raw = json.loads((model_dir / "config.json").read_text())
    raw["quantization_config"] = quantization_config
    (model_dir / "config.json").write_text(json.dumps(raw))
    # Not a safetensors file at all: reading any weight would fail differently.
    (model_dir / "model.safetensors").write_bytes(b"\0" * 64)
    started = time.perf_counter()
    with pytest.raises(ValueError) as refused:
        load_model(model_dir)
    assert time.perf_counter() - started < 5
    message = str(refused.value)
    assert f"quant_method {method}: not supported" in message
    assert "\n" not in message and len(message) < 400


@pytest.mark.parametrize("name", ["phi3", "qwen2_window"])
def test_a_tp2_rank_reads_its_share_only(tmp_path, name):
    """Each rank of two reads about half the checkpoint's tensor bytes (safetensors slices), and
    what it builds equals the whole model's parameters cut by parallel.shard_parameter (Phi-3's
    fused qkv and gate_up, a tied embedding, q/k/v biases)."""
    from tandem.engine.parallel import TensorParallel, shard_parameter

    model_dir = write_family_checkpoint(tmp_path, name)
    whole, config = load_model(model_dir)
    whole_params = dict(whole.named_parameters())
    for rank in range(2):
        model, _ = load_model(model_dir, tp=TensorParallel(rank, 2))
        assert 0.45 * whole.checkpoint_bytes_read < model.checkpoint_bytes_read
        assert model.checkpoint_bytes_read < 0.56 * whole.checkpoint_bytes_read
        for param_name, param in model.named_parameters():
            want = shard_parameter(param_name, whole_params[param_name], config, rank, 2)
            assert torch.equal(param, want), param_name


@pytest.mark.parametrize("name", ["gemma2", "gemma3_text"])
def test_bf16_gemma_prefill_is_close_to_transformers_bf16(tmp_path, name):
    """In bfloat16 Gemma's norms round as transformers' do ((1 + w) in float32, then the cast)."""
    model_dir = write_family_checkpoint(tmp_path, name)
    model, config = load_model(model_dir, dtype=torch.bfloat16)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.bfloat16, attn_implementation="eager"
    ).eval()
    prompt = _prompt(config.vocab_size, seed=9)
    runner = PagedRunner(model, config, 8)
    runner.kv_cache = runner.kv_cache.to(torch.bfloat16)
    logits = runner.step([(0, prompt)])
    want = hf_model(torch.tensor([prompt])).logits[0].float()
    assert (logits.argmax(-1) == want.argmax(-1)).float().mean() >= 0.9
    torch.testing.assert_close(logits, want, atol=0.5, rtol=0.05)
