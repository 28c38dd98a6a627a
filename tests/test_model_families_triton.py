"""The families' engines on the Triton kernels (paged attention with windows and soft-caps, the
fused norms, rope and KV store; on the CPU through TRITON_INTERPRET): greedy tokens equal to
transformers', with prompts chunked past the window and several requests per step; and the
--deterministic schedule keeps the window."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from conftest import run_to_completion  # noqa: E402
from test_model_families import hf_greedy  # noqa: E402
from tiny_families import write_family_checkpoint  # noqa: E402

for _name in ("tandem.kernels.paged_attention_triton", "tandem.kernels.fused_triton"):
    if _name in sys.modules:  # decorated earlier without the interpreter
        importlib.reload(sys.modules[_name])

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampling_options import SamplingOptions  # noqa: E402

NUM_NEW = 6


def _prompts(vocab_size: int) -> dict[str, list[int]]:
    gen = torch.Generator().manual_seed(3)
    return {
        f"r{i}": [1] + torch.randint(4, vocab_size, (length,), generator=gen).tolist()
        for i, length in enumerate((22, 13))
    }


def _hf_greedy(model_dir, prompts: dict[str, list[int]]) -> dict[str, list[int]]:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        model_dir, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    return {rid: hf_greedy(hf_model, ids, NUM_NEW)[1] for rid, ids in prompts.items()}


def _engine_tokens(model_dir, prompts, **engine_kwargs) -> dict[str, list[int]]:
    config = EngineConfig(
        str(model_dir),
        block_size=8,
        num_blocks=48,
        max_num_batched_tokens=16,  # the prompts run in chunks, beside the others' decodes
        max_loras=0,
        **engine_kwargs,
    )
    options = SamplingOptions(max_tokens=NUM_NEW, ignore_eos=True)
    return run_to_completion(LLMEngine(config), prompts, options)


@pytest.mark.parametrize("family", ["gemma2"])
def test_triton_engine_gives_transformers_tokens(family, tmp_path, monkeypatch):
    model_dir = write_family_checkpoint(tmp_path, family)
    prompts = _prompts(len(transformers.AutoTokenizer.from_pretrained(model_dir)))
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    assert _engine_tokens(model_dir, prompts) == _hf_greedy(model_dir, prompts)


def test_deterministic_schedule_keeps_the_window(tmp_path):
    model_dir = write_family_checkpoint(tmp_path, "gemma2")
    prompts = _prompts(len(transformers.AutoTokenizer.from_pretrained(model_dir)))
    got = _engine_tokens(model_dir, prompts, deterministic=True)
    assert got == _hf_greedy(model_dir, prompts)
