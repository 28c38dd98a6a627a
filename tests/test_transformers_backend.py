"""The transformers model path (hf_model.py): architectures tandem has no decoder for run as
transformers' own modules over tandem's paged KV cache, and give transformers' greedy tokens.

Each checkpoint is tiny and random, built with transformers' own config and model classes and the
tiny tokenizer's vocabulary; its weights are redrawn with large variances (as tiny_families.py
does) so greedy decoding has no near-ties that float rounding could flip. The oracle is
transformers' `generate` on the same checkpoint with its own (SDPA) attention.
"""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
import transformers
from conftest import assert_all_blocks_free, run_to_completion, split_or_aggregated_client
from lora_adapters import write_adapter

from tandem.client import SamplingParams
from tandem.common.exceptions import PreconditionError
from tandem.engine.checkpoints import write_tiny_checkpoint
from tandem.engine.config import EngineConfig
from tandem.engine.hf_model import TransformersCausalLM, check_logits
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.loader import hf_parameter_slices, load_model
from tandem.engine.lora_adapter import AdapterStore
from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.tiny_tokenizer import BOS, EOS, PAD, SPECIAL_TOKENS
from tandem.testing.cluster import LocalCluster

transformers.logging.set_verbosity_error()

NUM_NEW = 16
_IDS = {
    "bos_token_id": SPECIAL_TOKENS.index(BOS),
    "eos_token_id": SPECIAL_TOKENS.index(EOS),
    "pad_token_id": SPECIAL_TOKENS.index(PAD),
}
_SIZES = {
    "hidden_size": 64,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "max_position_embeddings": 256,
    # Untied: with a tied head a tiny random model predicts its input token back, again and again.
    "tie_word_embeddings": False,
}

# name -> (config class, its arguments beyond _SIZES and _IDS): architectures tandem has no
# native decoder for, whose attention goes through transformers' attention interface.
ARCHITECTURES = {
    # Partial rotary (a quarter of each head), parallel attention and MLP residuals, LayerNorm.
    "gpt_neox": (
        transformers.GPTNeoXConfig,
        {
            "intermediate_size": 128,
            "rope_parameters": {
                "rope_type": "default",
                "rope_theta": 10000.0,
                "partial_rotary_factor": 0.25,
            },
        },
    ),
    # Grouped-query attention (4 query heads over 2 KV heads), biases everywhere, LayerNorm.
    "starcoder2": (
        transformers.Starcoder2Config,
        {"intermediate_size": 128, "num_key_value_heads": 2, "sliding_window": None},
    ),
    # Multi-query attention (one KV head), learned absolute positions.
    "gpt_bigcode": (transformers.GPTBigCodeConfig, {"n_inner": 128, "multi_query": True}),
    # The logits scaled after lm_head (logit_scale), parallel attention and MLP.
    "cohere": (
        transformers.CohereConfig,
        {"intermediate_size": 128, "num_key_value_heads": 2, "logit_scale": 0.5},
    ),
}


def _redraw(model: torch.nn.Module, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    embeddings = {model.get_input_embeddings().weight, model.get_output_embeddings().weight}
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.dim() == 1:  # norm weights around 1, biases around 0
                center = 1.0 if name.endswith("weight") else 0.0
                param.copy_(center + 0.1 * torch.randn(param.shape, generator=gen))
            elif any(param is e for e in embeddings) or "wpe" in name:
                param.copy_(torch.randn(param.shape, generator=gen))
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[1] ** -0.5)


def write_checkpoint(out_dir: Path, config_class, seed: int = 0, **extra) -> Path:
    """A tiny random checkpoint of config_class with the tiny tokenizer, in out_dir."""
    out = write_tiny_checkpoint(out_dir, "llama", seed=seed)  # the tokenizer files
    (out / "model.safetensors").unlink()
    vocab_size = len(transformers.AutoTokenizer.from_pretrained(out))
    config = config_class(**{**_SIZES, **_IDS, "vocab_size": vocab_size, **extra})
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _redraw(model, seed)
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module", params=list(ARCHITECTURES))
def architecture(request, tmp_path_factory) -> tuple[str, Path]:
    config_class, extra = ARCHITECTURES[request.param]
    return request.param, write_checkpoint(
        tmp_path_factory.mktemp(request.param), config_class, **extra
    )


def _prompts(vocab_size: int, seed: int, num: int = 6) -> dict[str, list[int]]:
    rng = random.Random(seed)
    return {
        f"r{i}": [1] + [rng.randrange(4, vocab_size) for _ in range(rng.randrange(3, 28))]
        for i in range(num)
    }


def _engine(model_dir: Path, **kwargs) -> LLMEngine:
    config = dict(block_size=4, num_blocks=64, max_num_seqs=4, max_num_batched_tokens=16)
    return LLMEngine(EngineConfig(str(model_dir), **{**config, **kwargs}))


_GREEDY = SamplingOptions(max_tokens=NUM_NEW, eos_token_ids=(SPECIAL_TOKENS.index(EOS),))


def test_config_reads_the_sizes(architecture):
    name, model_dir = architecture
    config = ModelConfig.from_pretrained(model_dir)
    hf = transformers.AutoConfig.from_pretrained(model_dir)
    assert (config.impl, config.model_type) == ("transformers", name)
    assert config.num_layers == 2 and config.num_heads == 4 and config.head_dim == 16
    assert config.num_kv_heads == {"gpt_bigcode": 1, "gpt_neox": 4}.get(name, 2)
    assert config.vocab_size == hf.vocab_size
    assert config.eos_token_ids == (SPECIAL_TOKENS.index(EOS),)
    assert config.describe_path().startswith(f"{name}: the transformers path")


def test_logits_the_head_scales_are_checked_at_load(architecture):
    """load checks compute_logits against transformers' whole forward: Cohere's logit_scale
    left out would be served wrong, so a config without it is refused."""
    name, model_dir = architecture
    model, config = load_model(model_dir)
    assert all(name.startswith("hf_model.") for name in model.state_dict())
    check_logits(model)
    if name == "cohere":
        model.config = dataclasses.replace(config, logits_scaling=1.0)
        with pytest.raises(ValueError, match="changes its logits after lm_head"):
            check_logits(model)


@pytest.mark.parametrize("num_blocks, budget", [(64, 16), (14, 7)])
def test_batched_chunked_greedy_matches_transformers(architecture, oracle, num_blocks, budget):
    """Six prompts of 4 to 28 tokens batched, their prefills cut in chunks of the step budget;
    with 14 blocks of 4 the pool runs out and sequences are preempted and recomputed."""
    _, model_dir = architecture
    ref = oracle(model_dir)
    prompts = _prompts(ref.model.config.vocab_size, seed=num_blocks + budget)
    engine = _engine(model_dir, num_blocks=num_blocks, max_num_batched_tokens=budget)
    assert isinstance(engine.runner.model, TransformersCausalLM)
    got = run_to_completion(engine, prompts, _GREEDY)
    for rid, ids in prompts.items():
        assert got[rid] == ref.greedy(ids, NUM_NEW), rid
    assert engine.block_manager.num_free_blocks == num_blocks
    if num_blocks < 64:
        assert engine.scheduler.num_preemptions > 0  # the pressure was real


def test_prefix_cache_hits_match_transformers(architecture, oracle):
    """A second prompt sharing four full blocks computes only its tail, over KV the first one
    stored in the pool; both continue as transformers does."""
    _, model_dir = architecture
    ref = oracle(model_dir)
    engine = _engine(model_dir)
    shared = [1] + list(range(10, 25))  # 16 tokens: 4 full blocks
    first = run_to_completion(engine, {"a": shared + [40, 41]}, _GREEDY)["a"]
    computed = engine.counters.num_prompt_tokens_computed
    second = run_to_completion(engine, {"b": shared + [50, 51, 52]}, _GREEDY)["b"]
    assert engine.counters.num_prompt_tokens_computed - computed == 3  # only the new tail
    assert first == ref.greedy(shared + [40, 41], NUM_NEW)
    assert second == ref.greedy(shared + [50, 51, 52], NUM_NEW)


@pytest.fixture(scope="module")
def served_neox(tmp_path_factory):
    config_class, extra = ARCHITECTURES["gpt_neox"]
    model_dir = write_checkpoint(tmp_path_factory.mktemp("served-neox"), config_class, **extra)
    engine_args = ["--model", str(model_dir), "--num-blocks", "64", "--block-size", "4"]
    engine_args += ["--max-num-batched-tokens", "16"]
    with LocalCluster(roles=["prefill", "decode", "both"], engine_args=engine_args) as cluster:
        yield model_dir, cluster


@pytest.mark.parametrize("which", ["split", "aggregated"])
def test_served_split_and_aggregated(served_neox, oracle, which):
    """Real processes: the prefill worker's KV (in tandem's pool, written by transformers'
    layers) handed off to the decode worker continues as transformers does, cold and over the
    prefix cache; each worker logs the path its model takes."""
    model_dir, cluster = served_neox
    for worker in cluster.workers:
        assert "model gpt_neox: the transformers path" in worker.log_path.read_text(
            errors="replace"
        )
    ref = oracle(model_dir)
    prompts = list(_prompts(ref.model.config.vocab_size, seed=3, num=3).values())
    expected = [ref.greedy(ids, 10) for ids in prompts]
    with split_or_aggregated_client(cluster, which) as llm:
        for attempt in ("cold", "prefix cached"):
            outs = llm.generate(prompts, SamplingParams(max_tokens=10), use_tqdm=False)
            assert [out.outputs[0].token_ids for out in outs] == expected, attempt
        assert_all_blocks_free(llm)


def test_model_impl_transformers_on_llama_matches_the_native_path(model_dirs, oracle):
    model_dir = model_dirs["llama"]
    ref = oracle(model_dir)
    prompts = _prompts(ref.model.config.vocab_size, seed=7)
    native = _engine(model_dir)
    forced = _engine(model_dir, model_impl="transformers")
    assert native.model_config.impl == "tandem"
    assert forced.model_config.impl == "transformers"
    assert isinstance(forced.runner.model, TransformersCausalLM)
    tokens = run_to_completion(forced, prompts, _GREEDY)
    assert tokens == run_to_completion(native, prompts, _GREEDY)
    assert tokens == {rid: ref.greedy(ids, NUM_NEW) for rid, ids in prompts.items()}


def test_ngram_drafts_verify_on_the_path(model_dirs):
    """Prompt lookup's drafts are verified in one forward of several rows per sequence (as a
    prefill chunk is): the tokens of plain decoding, in fewer steps."""
    model_dir = model_dirs["llama"]
    prompts = {"a": [1, 5, 6, 7, 5, 6, 7, 5, 6], "b": [1, 9, 10, 11, 9, 10, 11]}
    options = SamplingOptions(max_tokens=48, ignore_eos=True)
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    drafted = _engine(model_dir, model_impl="transformers", speculative_config=spec)
    plain = _engine(model_dir, model_impl="transformers")
    assert run_to_completion(drafted, prompts, options) == run_to_completion(
        plain, prompts, options
    )
    assert drafted.counters.num_accepted_draft_tokens > 0
    assert drafted.counters.num_steps < plain.counters.num_steps


def _config_only(out_dir: Path, config) -> Path:
    """A checkpoint directory with config.json only: the refusals come before any weight is read."""
    out_dir.mkdir(parents=True, exist_ok=True)
    config.save_pretrained(out_dir)
    return out_dir


def test_unsupported_architectures_are_refused_with_the_reason(tmp_path):
    tiny = {**_SIZES, **_IDS, "vocab_size": 64}
    cases = {
        # Attention computed inside the module, not through the attention interface.
        "stablelm": (transformers.StableLmConfig(**tiny), "_supports_attention_backend"),
        "sliding": (
            transformers.Starcoder2Config(**tiny, sliding_window=8),
            "plain causal attention only; this checkpoint has sliding_window=8",
        ),
        "t5": (transformers.T5Config(vocab_size=64), "not a decoder-only causal LM"),
    }
    for name, (config, reason) in cases.items():
        model_dir = _config_only(tmp_path / name, config)
        with pytest.raises(ValueError, match=reason):
            LLMEngine(EngineConfig(str(model_dir), num_blocks=8))
    # BERT's LM head has a causal-LM class and the attention interface, but attends both ways
    # unless is_decoder: refused when its modules say so.
    bert = transformers.BertLMHeadModel(transformers.BertConfig(**tiny, intermediate_size=128))
    bert.save_pretrained(tmp_path / "bert")
    with pytest.raises(ValueError, match="is not causal attention"):
        LLMEngine(EngineConfig(str(tmp_path / "bert"), num_blocks=8))
    # tandem's own decoder names the families it has.
    neox = _config_only(tmp_path / "neox", transformers.GPTNeoXConfig(**tiny))
    with pytest.raises(ValueError, match="unsupported model_type 'gpt_neox'"):
        LLMEngine(EngineConfig(str(neox), num_blocks=8, model_impl="tandem"))
    with pytest.raises(ValueError, match="model_impl must be one of"):
        EngineConfig(str(neox), model_impl="vllm")


def test_what_the_path_cannot_run_is_refused_at_start(model_dirs):
    llama = str(model_dirs["llama"])
    draft = json.dumps({"method": "draft_model", "model": llama, "num_speculative_tokens": 2})
    refused = {
        "--tensor-parallel-size": dict(tensor_parallel_size=2, max_loras=0),
        "--quantization fp8": dict(quantization="fp8"),
        "--kv-cache-dtype fp8": dict(kv_cache_dtype="fp8"),
        "--deterministic": dict(deterministic=True),
        "draft model": dict(speculative_config=draft),
    }
    for what, flags in refused.items():
        with pytest.raises(ValueError, match=f"transformers model path.*{what}"):
            LLMEngine(EngineConfig(llama, num_blocks=8, model_impl="transformers", **flags))


def test_lora_requests_and_ipc_updates_are_refused(model_dirs, tmp_path):
    """The path has no adapter pool (transformers' projections run no LoRA kernels): a request
    naming an adapter is refused, not run on the base model. Weights update from a checkpoint
    directory, not by IPC handles (whose names map onto tandem's fused parameters)."""
    model_dir = model_dirs["llama"]
    engine = _engine(model_dir, model_impl="transformers")
    with pytest.raises(PreconditionError, match="IPC handles is not supported"):
        hf_parameter_slices(engine.runner.model)
    assert isinstance(engine.runner.load_weights(str(model_dir)), TransformersCausalLM)
    assert engine.config.max_loras and engine.runner.lora_pool is None
    store = AdapterStore(ModelConfig.from_pretrained(model_dir), 16, torch.float32, capacity=2)
    adapter = store.load("a", 1, str(write_adapter(model_dir, tmp_path / "a", seed=1, rank=4)))
    with pytest.raises(PreconditionError, match="transformers path"):
        engine.add_request("x", [1, 2, 3], SamplingOptions(max_tokens=1), adapter=adapter)
