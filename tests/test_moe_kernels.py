"""The fused MoE Triton kernel (kernels/moe_triton.py) against its torch reference (kernels/moe.py),
on the CPU through TRITON_INTERPRET: random inputs of several shapes, fixed seeds. test_gpu_engine.py
runs the same comparison on a GPU; bench/moe.py times it."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import moe as reference  # noqa: E402

for _name in ("tandem.kernels.moe_triton", "tandem.kernels.fused_triton"):
    if _name in sys.modules:  # decorated earlier without the interpreter
        importlib.reload(sys.modules[_name])
from tandem.kernels import moe_triton  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (tokens, hidden, intermediate, experts, top_k, tile): a decode row, ragged H and I, more
# tokens than a tile, an expert count above the tokens, top-1, the default tile and others.
CASES = [
    (1, 64, 32, 8, 2, None),
    (7, 48, 40, 4, 2, None),
    (37, 64, 96, 6, 2, (16, 32, 32, 4)),
    (20, 32, 16, 16, 4, (32, 16, 16, 2)),
    (9, 40, 24, 3, 1, None),
    (12, 32, 16, 64, 8, None),  # Qwen3-MoE-like routing: many experts, top-8, few tokens each
]


def _inputs(tokens, hidden, inter, experts, top_k, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    weights, ids = reference.route(logits, top_k, renormalize=seed % 2 == 0)
    return x, w_gate_up, w_down, weights, ids


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("tokens, hidden, inter, experts, top_k, tile", CASES)
def test_fused_moe_matches_the_reference(tokens, hidden, inter, experts, top_k, tile, dtype):
    seed = tokens * 1000 + hidden + experts
    x, w_gate_up, w_down, weights, ids = _inputs(tokens, hidden, inter, experts, top_k, dtype, seed)
    if dtype == torch.bfloat16 and seed % 3 == 0:  # the Qwen families' weights in the model dtype
        weights = weights.to(dtype)
    got = moe_triton.fused_moe(x, w_gate_up, w_down, weights, ids, tile=tile)
    want = reference.fused_moe(x, w_gate_up, w_down, weights, ids)
    # float32 sums in another order; bf16: the k outputs of a token summed once, not one by one.
    tol = dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(got, want, **tol)


def test_tiles_cover_each_experts_pairs_once():
    gen = torch.Generator().manual_seed(3)
    ids = torch.stack([torch.randperm(8, generator=gen)[:3] for _ in range(29)])
    pairs, expert, start, end = moe_triton.align_tiles(ids, 8, block_m=4)
    flat = ids.reshape(-1)
    assert torch.equal(flat[pairs.long()], flat.sort(stable=True).values)
    covered = []
    for e, s, t in zip(expert.tolist(), start.tolist(), end.tolist()):
        rows = range(s, min(s + 4, t))
        assert all(flat[pairs[r]] == e for r in rows)
        covered += rows
    assert sorted(covered) == list(range(flat.numel()))


def test_empty_batch_and_bad_shapes():
    x, w_gate_up, w_down, weights, ids = _inputs(3, 16, 8, 4, 2, torch.float32, 0)
    empty = moe_triton.fused_moe(x[:0], w_gate_up, w_down, weights[:0], ids[:0])
    assert empty.shape == (0, 16)
    with pytest.raises(ValueError, match="w_down must be"):
        moe_triton.fused_moe(x, w_gate_up, w_down[:, :8], weights, ids)
    with pytest.raises(ValueError, match="share a dtype"):
        moe_triton.fused_moe(x, w_gate_up, w_down.double(), weights, ids)


def test_the_engines_moe_block_on_the_triton_backend(monkeypatch):
    """Qwen2-MoE's block (the flat expert parameters viewed as stacks, the shared expert) through
    the dispatcher's Triton path equals its torch path."""
    from tandem.engine.model_config import ModelConfig
    from tandem.engine.moe import SparseMoeBlock

    config = ModelConfig.from_dict(
        {
            "model_type": "qwen2_moe",
            "vocab_size": 100,
            "hidden_size": 48,
            "intermediate_size": 64,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "rms_norm_eps": 1e-6,
            "max_position_embeddings": 64,
            "num_experts": 6,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 24,
            "shared_expert_intermediate_size": 40,
        }
    )
    block = SparseMoeBlock(config, 1)
    gen = torch.Generator().manual_seed(4)
    with torch.no_grad():
        for param in block.parameters():
            param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    x = torch.randn(5, config.hidden_size, generator=gen)
    with torch.inference_mode():
        want = block(x)
        monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
        got = block(x)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_precompile_launches_every_row_tile():
    x, w_gate_up, w_down, _, _ = _inputs(1, 16, 8, 8, 2, torch.float32, 0)
    tiles = {moe_triton.tile_config(-(-n * 8 // 2) * 2, 8)[0] for n in (1, 17, 33)}
    assert tiles == {16, 32, 64}
    moe_triton.precompile_variants(w_gate_up, w_down, 2, torch.float32)
