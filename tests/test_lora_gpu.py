"""LoRA on a GPU: the compiled Triton shrink/expand match the torch reference on 8B-shaped
projections, and a mixed batch decoded through the LoRA CUDA graphs gives the eager path's and
transformers + peft's greedy tokens.

Skipped without CUDA (CI has no GPU; the CPU runs the same code paths in test_lora_engine.py and,
through the interpreter, test_lora_kernels.py). Run it in its own pytest process: the interpreter
tests set TRITON_INTERPRET for the whole session.
"""

from __future__ import annotations

import random

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from lora_adapters import PeftOracle, write_adapter  # noqa: E402

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.lora_adapter import AdapterStore  # noqa: E402
from tandem.engine.sampling_options import SamplingOptions  # noqa: E402
from tandem.kernels import lora as reference  # noqa: E402
from tandem.kernels.lora import LoRAMetadata  # noqa: E402

# Llama-3.1-8B's projections: (in, slice widths); rank 16.
PROJECTIONS = {
    "qkv": (4096, (4096, 1024, 1024)),
    "o": (4096, (4096,)),
    "gate_up": (4096, (14336, 14336)),
    "down": (14336, (4096,)),
}


@pytest.mark.parametrize("num_tokens", [1, 32, 300])
@pytest.mark.parametrize("projection", PROJECTIONS)
def test_compiled_kernels_match_the_reference(projection, num_tokens):
    from tandem.kernels import lora_triton

    k_cols, widths = PROJECTIONS[projection]
    gen = torch.Generator(device="cuda").manual_seed(num_tokens)
    bounds = (0,) + tuple(int(b) for b in torch.tensor(widths).cumsum(0))
    x = torch.randn(num_tokens, k_cols, device="cuda", generator=gen).bfloat16()
    a_pool = (
        torch.randn(8, len(widths) * 16, k_cols, device="cuda", generator=gen) * k_cols**-0.5
    ).bfloat16()
    b_pool = (torch.randn(8, bounds[-1], 16, device="cuda", generator=gen) * 0.25).bfloat16()
    y = torch.randn(num_tokens, bounds[-1], device="cuda", generator=gen).bfloat16()
    slots = [random.Random(num_tokens + i).randrange(-1, 8) for i in range(num_tokens)]
    meta = LoRAMetadata.build(slots, 8, device="cuda")
    out, expected = y.clone(), y.clone()
    lora_triton.lora_expand(lora_triton.lora_shrink(x, a_pool, meta), b_pool, meta, out, bounds)
    reference.lora_expand(reference.lora_shrink(x, a_pool, meta), b_pool, meta, expected, bounds)
    torch.testing.assert_close(out.float(), expected.float(), atol=3e-2, rtol=2e-2)
    base = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base], y[base])


def test_lora_graphs_match_eager_and_peft(model_dirs, tmp_path):
    model_dir = model_dirs["llama"]
    paths = [
        write_adapter(model_dir, tmp_path / f"a{i}", seed=i, rank=4 * i, std=0.2) for i in (1, 2, 3)
    ]
    rng = random.Random(3)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(3, 40))]
        for i in range(8)
    }
    choice = {rid: i % 4 for i, rid in enumerate(prompts)}  # 3: the base model

    def run(**kwargs) -> tuple[dict, LLMEngine]:
        engine = LLMEngine(
            EngineConfig(str(model_dir), device="cuda", num_blocks=256, max_num_seqs=16, **kwargs)
        )
        store = AdapterStore(engine.model_config, 16, engine.runner.dtype, capacity=4)
        adapters = [store.load(f"a{i}", i, str(p)) for i, p in enumerate(paths)] + [None]
        for rid, ids in prompts.items():
            engine.add_request(
                rid,
                ids,
                SamplingOptions(max_tokens=16, eos_token_ids=(2,)),
                adapter=adapters[choice[rid]],
            )
        out = {rid: [] for rid in prompts}
        while engine.num_unfinished:
            for o in engine.step():
                out[o.request_id] += o.new_token_ids
        return out, engine

    graphed, engine = run()
    assert engine.runner.lora_graphs.is_captured
    assert graphed == run(enforce_eager=True)[0]
    oracle = PeftOracle(model_dir)
    for rid, ids in prompts.items():
        adapter = paths[choice[rid]] if choice[rid] < 3 else None
        assert graphed[rid] == oracle.greedy(ids, 16, adapter), rid
