"""Triton fused element-wise kernels against their torch references (kernels/fused.py), on the CPU
through TRITON_INTERPRET, on random inputs of several shapes; on a GPU too when there is one.

triton is a test dependency: if it does not import, collection errors and the run fails.
"""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401

from tandem.kernels import fused as reference  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402

if "tandem.kernels.fused_triton" in sys.modules:  # decorated earlier without the interpreter
    importlib.reload(sys.modules["tandem.kernels.fused_triton"])
from tandem.kernels import fused_triton  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def tolerance(dtype: torch.dtype) -> dict:
    # bf16: the interpreter's float32 -> bf16 cast may round differently from torch's by an ulp,
    # and a rounded intermediate carries that into the next step.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


def randn(*shape, dtype, gen, std=1.0):
    return (torch.randn(*shape, generator=gen) * std).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("shape", [(1, 64), (5, 96), (3, 4, 32)])
def test_rms_norm(shape, dtype):
    gen = torch.Generator().manual_seed(sum(shape))
    x = randn(*shape, dtype=dtype, gen=gen, std=3.0)
    weight = randn(shape[-1], dtype=dtype, gen=gen)
    torch.testing.assert_close(
        fused_triton.rms_norm(x, weight, 1e-6),
        reference.rms_norm(x, weight, 1e-6),
        **tolerance(dtype),
    )


def test_rms_norm_on_strided_heads_of_a_fused_projection():
    gen = torch.Generator().manual_seed(0)
    qkv = randn(7, 6 * 32, dtype=torch.float32, gen=gen)
    q = qkv[:, : 4 * 32].view(7, 4, 32)  # rows are strided: heads of one token, then the next token
    assert not q.is_contiguous()
    weight = randn(32, dtype=torch.float32, gen=gen)
    torch.testing.assert_close(
        fused_triton.rms_norm(q, weight, 1e-5),
        reference.rms_norm(q, weight, 1e-5),
        **tolerance(torch.float32),
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("num_tokens,hidden", [(1, 64), (9, 80), (33, 128)])
def test_add_rms_norm(num_tokens, hidden, dtype):
    gen = torch.Generator().manual_seed(num_tokens * hidden)
    x, residual = (
        randn(num_tokens, hidden, dtype=dtype, gen=gen),
        randn(num_tokens, hidden, dtype=dtype, gen=gen),
    )
    weight = randn(hidden, dtype=dtype, gen=gen)
    got_out, got_total = fused_triton.add_rms_norm(x, residual, weight, 1e-6)
    want_out, want_total = reference.add_rms_norm(x, residual, weight, 1e-6)
    torch.testing.assert_close(got_total, want_total, **tolerance(dtype))
    torch.testing.assert_close(got_out, want_out, **tolerance(dtype))


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("num_tokens,inner", [(1, 256), (6, 96), (17, 1100)])
def test_silu_and_mul(num_tokens, inner, dtype):
    gen = torch.Generator().manual_seed(inner)
    gate_up = randn(num_tokens, 2 * inner, dtype=dtype, gen=gen, std=2.0)
    torch.testing.assert_close(
        fused_triton.silu_and_mul(gate_up), reference.silu_and_mul(gate_up), **tolerance(dtype)
    )


ROPE_CASES = {
    # name: (num_heads, num_kv_heads, head_dim, block_size, [(query_len, seq_len), ...])
    "prefill": (4, 2, 32, 4, [(9, 9)]),
    "decode": (8, 2, 64, 16, [(1, 5), (1, 40), (1, 17)]),
    "mixed_mqa": (6, 1, 16, 8, [(3, 20), (1, 3)]),
}


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("case", ROPE_CASES)
def test_rope_store_kv(case, dtype):
    num_heads, num_kv_heads, head_dim, block_size, shape = ROPE_CASES[case]
    gen = torch.Generator().manual_seed(len(case))
    num_blocks = sum(triton.cdiv(s, block_size) for _, s in shape) + 2
    tables = [
        list(range(i * 8, i * 8 + triton.cdiv(s, block_size))) for i, (_, s) in enumerate(shape)
    ]
    num_blocks = max(max(t) for t in tables) + 1
    meta = AttentionMetadata.build([q for q, _ in shape], [s for _, s in shape], tables, block_size)
    meta.slot_mapping[1] = -1  # a token whose KV is not stored
    num_tokens = meta.slot_mapping.shape[0]
    positions = torch.cat([torch.arange(s - q, s) for q, s in shape])
    # q, k and v as views of one fused projection, as the model passes them.
    qkv = randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, dtype=dtype, gen=gen)
    q, k, v = qkv.split(
        [num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1
    )
    q, k, v = (
        q.view(num_tokens, num_heads, head_dim),
        k.view(num_tokens, num_kv_heads, head_dim),
        v.view(num_tokens, num_kv_heads, head_dim),
    )
    inv_freq = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
    cos_sin = reference.rope_cos_sin(inv_freq, 64, dtype)
    # A layer view of a two-layer cache, pre-filled so that skipped slots must stay untouched.
    want_cache = randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, dtype=dtype, gen=gen)
    got_cache = want_cache.clone()
    want_q = reference.rope_store_kv(
        q, k, v, positions, cos_sin, want_cache[:, 1], meta.slot_mapping
    )
    got_q = fused_triton.rope_store_kv(
        q, k, v, positions, cos_sin, got_cache[:, 1], meta.slot_mapping
    )
    torch.testing.assert_close(got_q, want_q, **tolerance(dtype))
    torch.testing.assert_close(got_cache, want_cache, **tolerance(dtype))
    assert torch.equal(got_cache[:, 0], want_cache[:, 0])  # the other layer


def test_launchers_reject_bad_inputs():
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        fused_triton.rms_norm(x, torch.ones(4), 1e-6)
    with pytest.raises(ValueError, match="must agree"):
        fused_triton.add_rms_norm(x, torch.randn(3, 8).bfloat16(), torch.ones(8), 1e-6)
    with pytest.raises(ValueError, match="gate_up"):
        fused_triton.silu_and_mul(torch.randn(3, 7))
    kv_layer = torch.zeros(4, 2, 4, 2, 16)
    q, k = torch.randn(2, 4, 16), torch.randn(2, 2, 16)
    cos_sin = torch.randn(8, 16)
    with pytest.raises(ValueError, match="disagree on T"):
        fused_triton.rope_store_kv(q, k, k, torch.arange(3), cos_sin, kv_layer, torch.arange(2))
    with pytest.raises(ValueError, match="cos_sin"):
        fused_triton.rope_store_kv(
            q, k, k, torch.arange(2), cos_sin.bfloat16(), kv_layer, torch.arange(2)
        )
