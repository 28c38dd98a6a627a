"""Mixture-of-experts models (Mixtral, Qwen3-MoE, Qwen2-MoE) against transformers' implementation
of the same tiny checkpoints, which transformers itself writes (moe_checkpoints.py): logits of the
engine's model, greedy tokens served aggregated and split, routing and tensor-parallel cuts."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
import transformers
from conftest import run_to_completion
from moe_checkpoints import MOE_MODEL_TYPES, write_tiny_moe_checkpoint
from test_model import PagedRunner, hf_logits, random_tokens

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.loader import hf_parameter_slices, load_model
from tandem.engine.model_config import ModelConfig
from tandem.engine.moe import SparseMoeBlock
from tandem.engine.parallel import TensorParallel, check_divisible
from tandem.engine.sampling_options import SamplingOptions
from tandem.kernels.moe import route

ATOL = 1e-4

transformers.logging.set_verbosity_error()


@pytest.fixture(scope="module")
def moe_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe")
    return {t: write_tiny_moe_checkpoint(root / t, t, seed=1) for t in MOE_MODEL_TYPES}


@pytest.fixture(scope="module")
def hf_models(moe_dirs):
    return {
        t: transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
        for t, d in moe_dirs.items()
    }


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_prefill_and_decode_logits_match_transformers(moe_dirs, hf_models, model_type):
    model, config = load_model(moe_dirs[model_type])
    tokens = random_tokens(config, 30, seed=4)
    runner = PagedRunner(model, config, block_size=4)
    got = [runner.step([(0, tokens[:21])])]
    got += [runner.step([(0, [token])]) for token in tokens[21:]]
    torch.testing.assert_close(
        torch.cat(got), hf_logits(hf_models[model_type], tokens), atol=ATOL, rtol=0
    )


# Windows of 8 tokens on the layers transformers slides: Mixtral as Mistral (every layer),
# Qwen3-MoE every layer (its config has no max_window_layers), Qwen2-MoE by its own rule (every
# other layer below max_window_layers, from the saved layer_types or, without them, derived).
_WINDOWED = {
    "mixtral": ({"sliding_window": 8}, (8, 8)),
    "qwen3_moe": (
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
        (8,) * 3,
    ),
    "qwen2_moe": (
        {"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 2},
        (8, 0),
    ),
}


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_sliding_windows_match_transformers(tmp_path, model_type):
    overrides, windows = _WINDOWED[model_type]
    model_dir = write_tiny_moe_checkpoint(tmp_path / model_type, model_type, seed=2, **overrides)
    if model_type == "qwen2_moe":  # as an older config.json: the windowed layers are derived
        path = model_dir / "config.json"
        path.write_text(json.dumps({**json.loads(path.read_text()), "layer_types": None}))
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model, config = load_model(model_dir)
    assert config.layer_windows == windows
    tokens = random_tokens(config, 30, seed=5)
    runner = PagedRunner(model, config, block_size=4)
    got = [runner.step([(0, tokens[:21])])]
    got += [runner.step([(0, [token])]) for token in tokens[21:]]
    torch.testing.assert_close(
        torch.cat(got), hf_logits(hf_model.eval(), tokens), atol=ATOL, rtol=0
    )


def test_config_reads_each_familys_routing(moe_dirs):
    mixtral = ModelConfig.from_pretrained(moe_dirs["mixtral"]).moe
    assert (mixtral.num_experts, mixtral.num_experts_per_tok, mixtral.norm_topk_prob) == (
        6,
        2,
        True,
    )
    assert mixtral.moe_intermediate_size == 96 and mixtral.float32_routing_weights
    qwen3 = ModelConfig.from_pretrained(moe_dirs["qwen3_moe"])
    assert qwen3.qk_norm and qwen3.moe.sparse_layers == (1, 2) and qwen3.moe.norm_topk_prob
    qwen2 = ModelConfig.from_pretrained(moe_dirs["qwen2_moe"])
    assert qwen2.moe.shared_expert_intermediate_size == 80 and not qwen2.moe.norm_topk_prob
    assert qwen2.attention_bias and not qwen2.has_o_proj_bias
    assert "MoE: 4 experts, top-2 on 2 of 2 layers, a shared expert" in qwen2.describe_path()
    odd = dataclasses.replace(qwen2, moe=dataclasses.replace(qwen2.moe, moe_intermediate_size=31))
    with pytest.raises(ValueError, match="moe_intermediate_size=31"):
        check_divisible(odd, 2)
    model, _ = load_model(moe_dirs["qwen3_moe"])
    assert not isinstance(model.layers[0].mlp, SparseMoeBlock)  # mlp_only_layers
    assert isinstance(model.layers[1].mlp, SparseMoeBlock)


def test_route_matches_transformers_routers():
    from transformers.models.mixtral.modeling_mixtral import MixtralTopKRouter
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(13, 16, generator=gen)
    for norm in (False, True):
        config = transformers.Qwen3MoeConfig(
            hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm
        )
        router = Qwen3MoeTopKRouter(config)
        router.weight.data = torch.randn(8, 16, generator=gen)
        _, weights, ids = router(hidden)
        got_weights, got_ids = route(hidden @ router.weight.T, 3, norm)
        assert torch.equal(got_ids, ids)
        torch.testing.assert_close(got_weights, weights)
    mixtral = MixtralTopKRouter(
        transformers.MixtralConfig(hidden_size=16, num_local_experts=8, num_experts_per_tok=2)
    )
    mixtral.weight.data = torch.randn(8, 16, generator=gen)
    _, weights, ids = mixtral(hidden)
    got_weights, got_ids = route(hidden @ mixtral.weight.T, 2, True)
    assert torch.equal(got_ids, ids)
    torch.testing.assert_close(got_weights, weights)


def test_weight_update_slices_cover_every_expert(moe_dirs):
    model, config = load_model(moe_dirs["qwen2_moe"])
    slices = hf_parameter_slices(model)
    block = "model.layers.1.mlp"
    assert slices[f"{block}.experts.3.up_proj.weight"] == (
        "layers.1.mlp.experts.gate_up_proj",
        (2 * 3 + 1) * 32,
        (2 * 3 + 2) * 32,
    )
    assert slices[f"{block}.experts.2.down_proj.weight"] == (
        "layers.1.mlp.experts.down_proj",
        2 * 64,
        3 * 64,
    )
    assert slices[f"{block}.shared_expert.up_proj.weight"][1:] == (80, 160)


def test_fp8_experts_are_refused_before_any_read(moe_dirs):
    with pytest.raises(ValueError, match="FP8 weights are not supported for mixtral's experts"):
        load_model(moe_dirs["mixtral"], quantization="fp8")


class _PartialSum(TensorParallel):
    """A rank whose all-reduce leaves its partial result: the test adds the ranks' results up."""

    def all_reduce(self, x):
        return x


@pytest.mark.parametrize("model_type", MOE_MODEL_TYPES)
def test_tensor_parallel_expert_shards_sum_to_the_full_block(moe_dirs, model_type):
    full, config = load_model(moe_dirs[model_type])
    layer = config.moe.sparse_layers[-1]
    x = torch.randn(11, config.hidden_size, generator=torch.Generator().manual_seed(5))
    want = full.layers[layer].mlp(x)
    partial = []
    for rank in range(2):
        shard, _ = load_model(moe_dirs[model_type], tp=_PartialSum(rank, 2))
        # The rank read its slices of the experts, not the whole checkpoint.
        assert shard.checkpoint_bytes_read < 0.65 * full.checkpoint_bytes_read
        block = shard.layers[layer].mlp
        assert block.experts.intermediate_size == config.moe.moe_intermediate_size // 2
        partial.append(block(x))
    torch.testing.assert_close(sum(partial), want, atol=1e-5, rtol=1e-5)


@pytest.mark.timeout(120)
def test_tp2_engine_gives_transformers_greedy_tokens(moe_dirs, hf_models):
    """Two ranks (gloo, one follower process), each a slice of every expert and of the shared
    expert: Qwen2-MoE's greedy tokens equal transformers'."""
    engine = LLMEngine(
        EngineConfig(
            str(moe_dirs["qwen2_moe"]),
            block_size=4,
            num_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=24,
            tensor_parallel_size=2,
            max_loras=0,
        )
    )
    try:
        prompts = {f"r{i}": random_tokens(engine.model_config, 6 + 9 * i, seed=i) for i in range(3)}
        got = run_to_completion(engine, prompts, SamplingOptions(max_tokens=8, ignore_eos=True))
    finally:
        engine.close()
    for rid, ids in prompts.items():
        assert got[rid] == _hf_greedy(hf_models["qwen2_moe"], ids, 8), rid


def _hf_greedy(hf_model, ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' argmax tokens, one full forward each, past any EOS (as ignore_eos)."""
    tokens = list(ids)
    with torch.no_grad():
        for _ in range(max_new_tokens):
            tokens.append(int(hf_model(torch.tensor([tokens])).logits[0, -1].argmax()))
    return tokens[len(ids) :]


def _prompts(config: ModelConfig) -> list[list[int]]:
    return [[1] + random_tokens(config, n, seed=n) for n in (3, 17, 29)]


def test_engine_with_chunked_prefill_gives_transformers_greedy_tokens(moe_dirs, hf_models):
    """Mixtral in one engine: a 16-token budget chunks the prompts, decodes batch together."""
    engine = LLMEngine(
        EngineConfig(
            str(moe_dirs["mixtral"]),
            block_size=4,
            num_blocks=64,
            max_num_seqs=4,
            max_num_batched_tokens=16,
        )
    )
    prompts = dict(enumerate(_prompts(engine.model_config)))
    got = run_to_completion(engine, prompts, SamplingOptions(max_tokens=10, ignore_eos=True))
    for rid, ids in prompts.items():
        assert got[rid] == _hf_greedy(hf_models["mixtral"], ids, 10), rid


@pytest.mark.timeout(150)
@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_served_split_and_aggregated_give_transformers_greedy_tokens(
    moe_dirs, hf_models, model_type
):
    """Behind a router: prefill + decode (the KV moved by NIXL) and an aggregated worker, a
    16-token budget chunking the longer prompts."""
    from tandem.client import LLM, SamplingParams
    from tandem.testing.cluster import LocalCluster, client_kwargs_for

    model_dir = moe_dirs[model_type]
    prompts = _prompts(ModelConfig.from_pretrained(model_dir))
    expected = [_hf_greedy(hf_models[model_type], p, 8) for p in prompts]
    engine_args = ["--model", str(model_dir), "--num-blocks", "64", "--block-size", "4"]
    engine_args += ["--max-num-batched-tokens", "16"]
    with LocalCluster(
        roles=["prefill", "decode", "both"], engine_args=engine_args, metrics=False
    ) as cluster:
        for address in (cluster.address, cluster.workers[2].address):
            with LLM(address, **client_kwargs_for(address)) as llm:
                outs = [
                    llm.generate(p, SamplingParams(max_tokens=8, ignore_eos=True)) for p in prompts
                ]
            assert [list(out.outputs[0].token_ids) for out in outs] == expected, address
            if address == cluster.address:  # the router split each request
                decode = cluster.workers[1].address
                assert all(out.metrics.served_by[-1] == decode for out in outs)
                assert all(out.metrics.kv_transfer_bytes > 0 for out in outs)


def test_deterministic_mode_keeps_a_tokens_moe_output_whatever_its_batch(moe_dirs):
    from tandem.kernels.batch_invariant import batch_invariant

    model, config = load_model(moe_dirs["qwen3_moe"])
    block = model.layers[1].mlp
    x = torch.randn(45, config.hidden_size, generator=torch.Generator().manual_seed(6))
    with batch_invariant(), torch.inference_mode():
        batched = block(x)
        for row in (0, 17, 44):
            assert torch.equal(block(x[row : row + 1]), batched[row : row + 1]), row


def test_lora_adapters_on_attention_equal_transformers_peft(moe_dirs, tmp_path):
    """A MoE model takes adapters on q/k/v/o (its dense layer 0 included); one on the experts'
    projections is refused when loaded."""
    from lora_adapters import PeftOracle, write_adapter

    from tandem.engine.lora_adapter import AdapterStore

    model_dir = moe_dirs["qwen3_moe"]
    targets = ("q_proj", "k_proj", "v_proj", "o_proj")
    path = write_adapter(model_dir, tmp_path / "qkvo", seed=3, rank=4, targets=targets, std=0.2)
    engine = LLMEngine(
        EngineConfig(str(model_dir), num_blocks=64, block_size=4, max_loras=2, max_lora_rank=8)
    )
    store = AdapterStore(engine.model_config, 8, engine.runner.dtype, capacity=2)
    adapter = store.load("qkvo", 1, str(path))
    greedy = SamplingOptions(max_tokens=6, eos_token_ids=(2,))
    requests = {}
    for i, prompt in enumerate(_prompts(engine.model_config)[:2]):
        requests[f"lora{i}"] = (prompt, path)
        requests[f"base{i}"] = (prompt, None)
        engine.add_request(f"lora{i}", prompt, greedy, adapter=adapter)
        engine.add_request(f"base{i}", prompt, greedy)
    got = {rid: [] for rid in requests}
    while engine.num_unfinished:
        for out in engine.step():
            got[out.request_id].extend(out.new_token_ids)
    oracle = PeftOracle(model_dir)
    for rid, (prompt, adapter_path) in requests.items():
        assert got[rid] == oracle.greedy(prompt, 6, adapter_path), rid
    assert got["lora0"] != got["base0"] or got["lora1"] != got["base1"]
    mlp = ("gate_proj", "up_proj")
    experts = write_adapter(model_dir, tmp_path / "mlp", seed=4, targets=mlp, std=0.2)
    with pytest.raises(ValueError, match="mlp.*is not a LoRA factor"):
        store.load("mlp", 2, str(experts))


def test_config_as_qwen_publishes_it_and_its_refusals():
    from tandem.engine.moe_config import parse_moe

    raw = {
        "num_hidden_layers": 6,
        "num_experts": 128,  # Qwen's own configs: num_experts, not num_local_experts
        "num_experts_per_tok": 8,
        "moe_intermediate_size": 768,
        "norm_topk_prob": True,
        "decoder_sparse_step": 2,
        "mlp_only_layers": [3],
    }
    moe = parse_moe("qwen3_moe", raw)
    assert (moe.num_experts, moe.num_experts_per_tok, moe.sparse_layers) == (128, 8, (1, 5))
    assert not moe.has_shared_expert and parse_moe("qwen3", raw) is None
    with pytest.raises(ValueError, match="num_experts_per_tok=9 must be between 1 and"):
        parse_moe("qwen3_moe", {**raw, "num_experts": 8, "num_experts_per_tok": 9})
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        parse_moe("qwen2_moe", {**raw, "moe_intermediate_size": None})
