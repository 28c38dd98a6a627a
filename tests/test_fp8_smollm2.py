"""FP8 on the real default model, SmolLM2-135M-Instruct: how often FP8 weights (--quantization
fp8) and an FP8 KV pool (--kv-cache-dtype fp8) pick the model's own greedy token.

The baseline is the engine's greedy output in float32 on 16 chat prompts (32 tokens at most).
Each variant then replays those sequences in one forward (every step sees the baseline's prefix,
so one early difference does not decide all later steps) and its argmax is compared per step.
Measured here (433 steps): FP8 KV 0.947 (0.943 against a bfloat16 model and pool), FP8 weights
0.903, both 0.896. Free-running continuations diverge sooner: after their first differing token
the sequences part, and only 0.45 (FP8 KV) and 0.35 (FP8 weights) of the positions agree.
The issue's goal for FP8 KV, >= 0.95, is not met on this 135M model: its keys need more than
e4m3's 3 mantissa bits (per-layer scales calibrated on a text did not change it: 0.942-0.954).
"""

from __future__ import annotations

import pytest
import torch
from conftest import run_to_completion
from test_model import PagedRunner

from tandem.engine.checkpoints import default_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.loader import allocate_kv_cache, load_model
from tandem.engine.sampling_options import SamplingOptions

FP8 = torch.float8_e4m3fn
QUESTIONS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Hamlet?",
    "Translate 'good morning' to Spanish.",
    "What is 12 times 7?",
    "Describe a cat.",
    "Why is the sky blue?",
    "Name a famous painter.",
    "What does a CPU do?",
    "Give me a recipe for tea.",
    "What is gravity?",
    "Tell me a joke.",
    "How many days are in a leap year?",
    "What is the largest ocean?",
]


@pytest.fixture(scope="module")
def baseline():
    """(model_dir, prompts, the float32 engine's greedy tokens per prompt)."""
    from transformers import AutoTokenizer

    model_dir = default_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = {
        str(i): tokenizer.apply_chat_template(
            [{"role": "user", "content": q}],
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
        for i, q in enumerate(QUESTIONS)
    }
    config = EngineConfig(
        str(model_dir), block_size=16, num_blocks=256, max_num_seqs=16, max_loras=0
    )
    eos = SamplingOptions(max_tokens=32, eos_token_ids=(2,))
    return model_dir, prompts, run_to_completion(LLMEngine(config), prompts, eos)


def _agreement(baseline, model, config, pool_dtype) -> float:
    _, prompts, greedy = baseline
    agreeing = 0
    for rid, ids in prompts.items():
        runner = PagedRunner(model, config, 16)
        runner.kv_cache = allocate_kv_cache(config, 96, 16, pool_dtype)
        logits = runner.step([(0, ids + greedy[rid][:-1])])
        chosen = logits[len(ids) - 1 :].argmax(-1).tolist()
        agreeing += sum(a == b for a, b in zip(chosen, greedy[rid]))
    return agreeing / sum(map(len, greedy.values()))


def test_fp8_kv_cache_agrees_with_the_model_dtype_pool(baseline):
    model, config = load_model(baseline[0], dtype=torch.float32)  # as the engine runs it on CPU
    assert _agreement(baseline, model, config, torch.float32) == 1.0  # the replay is the greedy
    assert _agreement(baseline, model, config, FP8) >= 0.93  # measured 0.947


def test_quantization_fp8_weights_agree_with_float32(baseline):
    model, config = load_model(baseline[0], dtype=torch.float32, quantization="fp8")
    assert _agreement(baseline, model, config, torch.float32) >= 0.87  # measured 0.903
