"""LoRA adapters in the engine (in process): random-weight PEFT adapters written by peft give
transformers + peft's greedy tokens on the tiny models, alone and mixed in one batch; the pool
loads on first use and evicts the least recently used unpinned adapter; the adapter salts the
prefix-cache hash; bad adapters are refused with a message."""

from __future__ import annotations

import json
import random

import pytest
import torch
from lora_adapters import PeftOracle, write_adapter

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.lora_adapter import AdapterNotFoundError, AdapterStore
from tandem.engine.sampling_options import SamplingOptions

# name: PEFT settings; together they cover fused slices, partial targets, rslora and per-module rank/alpha.
ADAPTERS = {
    "all8": dict(seed=1, rank=8, alpha=16, std=0.2),
    "qv4_rslora": dict(
        seed=2, rank=4, alpha=8, targets=("q_proj", "v_proj"), use_rslora=True, std=0.2
    ),
    "mlp16_patterns": dict(
        seed=3,
        rank=16,
        alpha=8,
        targets=("o_proj", "gate_proj", "up_proj", "down_proj"),
        std=0.2,
        rank_pattern={"down_proj": 2},
        alpha_pattern={"o_proj": 3},
    ),
}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def adapters(model_dirs, tmp_path_factory):
    root = tmp_path_factory.mktemp("adapters")
    return {
        (model, name): write_adapter(model_dirs[model], root / f"{model}-{name}", **settings)
        for model in ("llama", "qwen2", "qwen3")
        for name, settings in ADAPTERS.items()
    }


def _engine(model_dir, **kwargs) -> tuple[LLMEngine, AdapterStore]:
    config = dict(
        num_blocks=96, block_size=8, max_loras=4, max_lora_rank=16, max_num_batched_tokens=64
    )
    config.update(kwargs)
    engine = LLMEngine(EngineConfig(str(model_dir), **config))
    store = AdapterStore(
        engine.model_config, engine.config.max_lora_rank, engine.runner.dtype, capacity=8
    )
    return engine, store


def _prompts(seed: int, num: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[1] + [rng.randrange(4, 300) for _ in range(rng.randrange(5, 30))] for _ in range(num)]


def _run(engine, requests: dict[str, tuple[list[int], object]]) -> dict[str, list[int]]:
    """requests: id -> (prompt, adapter or None), all added before the first step."""
    greedy = SamplingOptions(max_tokens=MAX_TOKENS, eos_token_ids=(2,))
    for rid, (prompt, adapter) in requests.items():
        engine.add_request(rid, prompt, greedy, adapter=adapter)
    outputs = {rid: [] for rid in requests}
    while engine.num_unfinished:
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    return outputs


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_mixed_batch_of_three_adapters_and_the_base_equals_transformers_peft(
    model_dirs, adapters, model
):
    engine, store = _engine(model_dirs[model])
    prompts = _prompts(seed=7, num=2)
    loaded = {
        name: store.load(name, i + 1, str(adapters[model, name])) for i, name in enumerate(ADAPTERS)
    }
    requests = {
        f"{name}/{p}": (prompt, loaded[name])
        for name in ADAPTERS
        for p, prompt in enumerate(prompts)
    }
    requests |= {f"base/{p}": (prompt, None) for p, prompt in enumerate(prompts)}
    got = _run(engine, requests)
    oracle = PeftOracle(model_dirs[model])
    for rid, (prompt, adapter) in requests.items():
        path = None if adapter is None else adapters[model, rid.split("/")[0]]
        assert got[rid] == oracle.greedy(prompt, MAX_TOKENS, path), rid
    # The adapters changed the model (a no-op adapter would pass the comparison too).
    for p in range(len(prompts)):
        assert (
            len({tuple(got[f"{name}/{p}"]) for name in list(ADAPTERS) + ["base"]})
            == len(ADAPTERS) + 1
        )
    pool = engine.runner.lora_pool
    assert pool.num_loads == len(ADAPTERS) and pool.num_evictions == 0
    assert all(pool.num_pins(slot) == 0 for slot in range(pool.num_slots))


def test_each_request_of_a_mixed_batch_gets_the_tokens_it_gets_alone(model_dirs, adapters):
    """Chunked prefill (64-token budget), decode steps through the padded graph path, and a mix
    that changes as requests finish: every request's tokens equal its run alone."""
    engine, store = _engine(model_dirs["llama"])
    loaded = [
        store.load(name, i + 1, str(adapters["llama", name])) for i, name in enumerate(ADAPTERS)
    ]
    rng = random.Random(5)
    prompts = _prompts(seed=11, num=8)
    requests = {f"r{i}": (prompt, rng.choice(loaded + [None])) for i, prompt in enumerate(prompts)}
    assert {id(a) for _, a in requests.values()} == {id(a) for a in loaded + [None]}
    together = _run(engine, requests)
    for rid, request in requests.items():
        alone, _ = _engine(model_dirs["llama"])
        assert _run(alone, {rid: request}) == {rid: together[rid]}, rid


def test_the_pool_loads_on_first_use_and_evicts_the_least_recently_used_unpinned(
    model_dirs, adapters
):
    engine, store = _engine(model_dirs["llama"], max_loras=2)
    a, b, c = (
        store.load(name, i + 1, str(adapters["llama", name])) for i, name in enumerate(ADAPTERS)
    )
    pool = engine.runner.lora_pool
    prompt = _prompts(seed=1, num=1)[0]

    def running() -> set[str]:
        return {s.request_id for s in engine.scheduler.running}

    for rid, adapter, max_tokens in (("a", a, 2), ("b", b, 12), ("c", c, 2)):
        engine.add_request(
            rid, prompt, SamplingOptions(max_tokens=max_tokens, ignore_eos=True), adapter=adapter
        )
    engine.step()
    # Both slots are pinned by running sequences: c waits, and a base request goes ahead of it.
    engine.add_request("base", prompt, SamplingOptions(max_tokens=12, ignore_eos=True))
    engine.step()
    assert running() == {"a", "b", "base"} and pool.resident == [a, b] and pool.num_loads == 2
    while "c" not in running():
        engine.step()
    assert (
        "a" not in running() and pool.resident == [c, b] and pool.num_evictions == 1
    )  # a's slot, unpinned
    while engine.num_unfinished:
        engine.step()
    # c ended before b: c is the least recently used, and a coming back takes its slot.
    engine.add_request("a-again", prompt, SamplingOptions(max_tokens=2), adapter=a)
    while engine.num_unfinished:
        engine.step()
    assert pool.resident == [a, b] and pool.num_loads == 4 and pool.num_evictions == 2


def test_an_adapter_salts_the_prefix_cache(model_dirs, adapters):
    engine, store = _engine(model_dirs["llama"])
    a = store.load("all8", 1, str(adapters["llama", "all8"]))
    b = store.load("qv4_rslora", 2, str(adapters["llama", "qv4_rslora"]))
    prompt = _prompts(seed=3, num=1)[0] * 3  # several full blocks
    greedy = SamplingOptions(max_tokens=2, ignore_eos=True)
    cached = {}
    for rid, adapter in (("a", a), ("b", b), ("base", None), ("a2", a)):
        seq = engine.add_request(rid, prompt, greedy, adapter=adapter)
        while engine.num_unfinished:
            engine.step()
        cached[rid] = seq.num_cached_prompt_tokens
    assert cached["a"] == cached["b"] == cached["base"] == 0
    assert cached["a2"] == (len(prompt) - 1) // 8 * 8  # the same adapter reuses its own KV
    stored = [e for e in engine.block_manager.drain_events() if e["type"] == "stored"]
    by_lora = {}
    for event in stored:
        for block in event["blocks"]:
            by_lora.setdefault(block["lora_id"], set()).add(block["block_hash"])
    assert set(by_lora) == {1, 2, None}
    assert (
        not (by_lora[1] & by_lora[2])
        and not (by_lora[1] & by_lora[None])
        and not (by_lora[2] & by_lora[None])
    )


def test_bad_adapters_are_refused_with_a_message(model_dirs, adapters, tmp_path):
    _, store = _engine(model_dirs["llama"], max_lora_rank=4)
    with pytest.raises(ValueError, match="rank 8 .*exceeds --max-lora-rank 4"):
        store.load("all8", 1, str(adapters["llama", "all8"]))
    with pytest.raises(AdapterNotFoundError, match="'gone'.*no adapter_config.json"):
        store.load("gone", 2, str(tmp_path / "missing"))
    ok = store.load("qv4", 3, str(adapters["llama", "qv4_rslora"]))
    with pytest.raises(ValueError, match="lora_int_id 3 is LoRA adapter 'qv4'"):
        store.load("other", 3, str(adapters["llama", "all8"]))
    assert store.load("qv4", 3, str(adapters["llama", "qv4_rslora"])) is ok and store.num_reads == 1
    dora = write_adapter(model_dirs["llama"], tmp_path / "dora", seed=4, rank=4, use_dora=True)
    with pytest.raises(ValueError, match="DoRA is not supported"):
        store.load("dora", 4, str(dora))
    huge = tmp_path / "huge"
    huge.mkdir()
    (huge / "adapter_config.json").write_text("{}")
    with open(huge / "adapter_model.safetensors", "wb") as f:
        f.truncate(64 << 20)  # never read: the size alone refuses it
    with pytest.raises(ValueError, match="larger than any LoRA of rank <= 4"):
        store.load("huge", 6, str(huge))
    head = write_adapter(
        model_dirs["llama"], tmp_path / "head", seed=5, rank=4, targets=("q_proj", "lm_head")
    )
    with pytest.raises(ValueError, match="lm_head.*not a LoRA factor"):
        store.load("head", 5, str(head))
    # The engine of a worker without a pool refuses adapters.
    no_lora, _ = _engine(model_dirs["llama"], max_loras=0)
    with pytest.raises(Exception, match="--max-loras 0"):
        no_lora.add_request("x", [1, 2, 3], SamplingOptions(max_tokens=1), adapter=ok)


def test_peft_keys_map_onto_the_fused_slices(model_dirs, adapters):
    """q/k/v land in their slices of qkv_proj, scaled by alpha / r; an untargeted slice stays zero."""
    from safetensors.torch import load_file

    _, store = _engine(model_dirs["llama"])
    path = adapters["llama", "qv4_rslora"]
    adapter = store.load("qv4", 1, str(path))
    tensors = load_file(str(path / "adapter_model.safetensors"))
    config = json.loads((path / "adapter_config.json").read_text())
    a, b = adapter.weights["qkv_proj"]
    module = store.modules["qkv_proj"]
    q_lo, q_hi, k_hi, v_hi = module.slice_bounds
    rank, r_max = config["r"], store.max_rank
    scaling = config["lora_alpha"] / rank**0.5  # use_rslora
    prefix = "base_model.model.model.layers.1.self_attn"
    torch.testing.assert_close(a[1, :rank], tensors[f"{prefix}.q_proj.lora_A.weight"])
    torch.testing.assert_close(
        a[1, 2 * r_max : 2 * r_max + rank], tensors[f"{prefix}.v_proj.lora_A.weight"]
    )
    assert not a[1, r_max : 2 * r_max].any() and not b[1, q_hi:k_hi].any()  # k is not targeted
    torch.testing.assert_close(
        b[1, k_hi:v_hi, :rank], tensors[f"{prefix}.v_proj.lora_B.weight"] * scaling
    )
    assert set(adapter.weights) == {"qkv_proj"}


def test_smollm2_under_two_adapters_and_none_equals_transformers_peft(tmp_path):
    """The real small chat model (the default, dequantized from its GGUF file) with random adapters
    small enough to keep it fluent, in one batch with the base model."""
    from transformers import AutoTokenizer

    from tandem.engine.checkpoints import default_model_dir

    model_dir = default_model_dir()
    oracle = PeftOracle(model_dir)
    paths = {
        "all": write_adapter(
            model_dir, tmp_path / "all", seed=1, rank=8, alpha=16, std=0.06, base=oracle.base
        ),
        "attn": write_adapter(
            model_dir,
            tmp_path / "attn",
            seed=2,
            rank=16,
            alpha=16,
            std=0.1,
            base=oracle.base,
            targets=("q_proj", "k_proj", "v_proj", "o_proj"),
        ),
    }
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    prompt = tokenizer(text, add_special_tokens=False)["input_ids"]
    engine, store = _engine(model_dir, num_blocks=32, block_size=16, max_num_batched_tokens=256)
    requests = {
        name: (prompt, store.load(name, i + 1, str(path)))
        for i, (name, path) in enumerate(paths.items())
    }
    requests["base"] = (prompt, None)
    got = _run(engine, requests)
    for name, (_, adapter) in requests.items():
        assert got[name] == oracle.greedy(prompt, MAX_TOKENS, paths.get(name)), name
    assert len({tuple(tokens) for tokens in got.values()}) == 3
