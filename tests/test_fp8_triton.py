"""The Triton KV store, fused rope + store and paged attention on FP8 (e4m3) pools with per-layer
scales, against the torch reference, on the CPU through TRITON_INTERPRET."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401  (a missing triton must fail this module, not skip it)

from tandem.kernels import fused as fused_reference  # noqa: E402
from tandem.kernels import paged_attention as reference  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402

for _name in (
    "tandem.kernels.fp8_triton",
    "tandem.kernels.paged_attention_triton",
    "tandem.kernels.fused_triton",
):
    if _name in sys.modules:  # decorated earlier without the interpreter
        importlib.reload(sys.modules[_name])
from tandem.kernels import fp8 as fp8_reference  # noqa: E402
from tandem.kernels import fp8_triton, fused_triton  # noqa: E402
from tandem.kernels.paged_attention_triton import paged_attention_triton, store_kv_triton  # noqa: E402

FP8 = torch.float8_e4m3fn
SCALES = [(1.0, 1.0), (0.03, 0.01)]


def _batch(kv_scales, query_lens, seq_lens, dtype, seed, block_size=4, kv_heads=2, heads=4):
    head_dim = 32
    gen = torch.Generator().manual_seed(seed)
    tables, start = [], 1
    for s in seq_lens:
        n = -(-s // block_size)
        tables.append(list(range(start, start + n))[::-1])  # scattered, reversed
        start += n
    pool = torch.zeros(start, 2, block_size, kv_heads, head_dim, dtype=FP8)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    full = AttentionMetadata.build(seq_lens, seq_lens, tables, block_size)
    num = int(full.slot_mapping.shape[0])
    key = (torch.randn(num, kv_heads, head_dim, generator=gen) * 200 * kv_scales[0]).to(dtype)
    value = (torch.randn(num, kv_heads, head_dim, generator=gen) * 200 * kv_scales[1]).to(dtype)
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen) / (100 * kv_scales[0])
    return pool, meta, full.slot_mapping, key, value, query.to(dtype)


@pytest.mark.parametrize("kv_scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_store_kv_and_attention_on_fp8_blocks_match_the_reference(kv_scales, dtype):
    pool, meta, slots, key, value, query = _batch(kv_scales, [1, 6, 1], [9, 6, 21], dtype, seed=1)
    want_pool, got_pool = pool.clone(), pool.clone()
    reference.store_kv(key, value, want_pool, slots, kv_scales)
    store_kv_triton(key, value, got_pool, slots, kv_scales)
    # Every FP8 byte as torch's saturating round-to-nearest-even cast writes it.
    assert torch.equal(got_pool.view(torch.uint8), want_pool.view(torch.uint8))
    assert want_pool.float().abs().max() > 0
    scale = query.shape[-1] ** -0.5
    # Both read the same FP8 blocks; the oracle attends in float32 (as test_triton_kernels.py's).
    want = reference.paged_attention(query.float(), want_pool, meta, scale, kv_scales)
    for splits in (1, 3):
        got = paged_attention_triton(query, want_pool, meta, scale, kv_scales, num_kv_splits=splits)
        assert got.dtype == dtype
        # Values are ~200 * v_scale (e4m3's range): tolerances relative to that magnitude.
        tol = (2e-5 if dtype == torch.float32 else 2e-2) * 200 * kv_scales[1]
        torch.testing.assert_close(got.float(), want.float(), atol=tol, rtol=0)


@pytest.mark.parametrize("kv_scales", SCALES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_rope_store_kv_on_fp8_blocks_matches_the_reference(kv_scales, dtype):
    pool, meta, slots, key, value, _ = _batch(kv_scales, [7], [7], dtype, seed=2)
    query = torch.randn(key.shape[0], 4, 32).to(dtype)
    positions = torch.arange(key.shape[0])
    inv_freq = 1.0 / (10000 ** (torch.arange(0, 32, 2).float() / 32))
    cos_sin = fused_reference.rope_cos_sin(inv_freq, 64, dtype)
    want_pool, got_pool = pool.clone(), pool.clone()
    want_q = fused_reference.rope_store_kv(
        query, key, value, positions, cos_sin, want_pool, slots, kv_scales
    )
    got_q = fused_triton.rope_store_kv(
        query, key, value, positions, cos_sin, got_pool, slots, kv_scales
    )
    tol = 1e-5 if dtype == torch.float32 else 2e-2  # test_fused_kernels.py's
    torch.testing.assert_close(got_q, want_q, atol=tol, rtol=tol)
    assert torch.equal(got_pool[:, 1].view(torch.uint8), want_pool[:, 1].view(torch.uint8))
    if dtype == torch.float32:
        assert torch.equal(got_pool.view(torch.uint8), want_pool.view(torch.uint8))
    else:
        # The interpreter's bf16 rotation differs from torch's by an ulp at times (as in
        # test_fused_kernels.py), and an ulp can cross an e4m3 rounding boundary: one step.
        got, want = got_pool[:, 0].float(), want_pool[:, 0].float()
        assert ((got - want).abs() <= want.abs() * 2**-3).all()


def _greedy_tokens(model_dir, max_tokens: int, engines=None, **config) -> dict[str, list[int]]:
    """Three prompts' greedy tokens from the tiny model with the given engine settings (eager);
    the engine is appended to `engines` when given."""
    from conftest import run_to_completion

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    prompts = {f"r{i}": [1] + list(range(10 + 9 * i, 20 + 13 * i)) for i in range(3)}
    engine = LLMEngine(
        EngineConfig(
            str(model_dir), block_size=8, num_blocks=32, max_loras=0, enforce_eager=True, **config
        )
    )
    if engines is not None:
        engines.append(engine)
    return run_to_completion(
        engine, prompts, SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    )


def test_engine_on_an_fp8_pool_gives_the_same_tokens_through_either_backend(
    model_dirs, monkeypatch
):
    """The whole model (fused rope + FP8 store, attention over FP8 blocks) on the Triton kernels,
    interpreted, against the torch reference path: the same greedy tokens."""
    tokens = {}
    for backend in ("torch", "triton"):
        monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", backend)
        tokens[backend] = _greedy_tokens(model_dirs["llama"], 6, kv_cache_dtype="fp8")
    assert tokens["triton"] == tokens["torch"]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, cols, groups", [(1, 64, 1), (5, 300, 1), (7, 256, 2), (3, 2304, 3)])
def test_the_one_kernel_activation_quantizer_matches_the_torch_path_bit_for_bit(
    rows, cols, groups, dtype
):
    gen = torch.Generator().manual_seed(rows * cols + groups)
    x = torch.randn(rows, cols, generator=gen) * torch.logspace(-3, 2, cols)  # wide magnitudes
    x[0, : cols // groups] = 0.0  # an all-zero group: the smallest scale, zeros, never NaN
    x = x.to(dtype)
    want_q, want_scale = fp8_reference.quantize_rows(x, groups)
    got_q, got_scale = fp8_triton.quantize_rows(x, groups)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    # A row view with a wider stride (a slice of a fused projection's output) reads by its stride.
    wide = torch.cat([x, x], dim=1)[:, :cols]
    assert torch.equal(
        fp8_triton.quantize_rows(wide, groups)[0].view(torch.uint8), want_q.view(torch.uint8)
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, cols, groups", [(1, 64, 1), (5, 300, 1), (3, 2304, 3), (4, 512, 4)])
def test_swiglu_quantized_in_one_kernel_is_swiglu_then_the_quantizer_bit_for_bit(
    rows, cols, groups, dtype
):
    """The down projection's input: silu_mul_quantize_rows(gate_up) gives the bytes and scales of
    quantize_rows(silu_and_mul(gate_up)), the two kernels it replaces."""
    gen = torch.Generator().manual_seed(rows + cols + groups)
    gate_up = torch.randn(rows, 2 * cols, generator=gen) * 4
    gate_up[0, : cols // groups] = 0.0  # a group whose SwiGLU is all zeros
    gate_up = gate_up.to(dtype)
    want_q, want_scale = fp8_triton.quantize_rows(fused_triton.silu_and_mul(gate_up), groups)
    got_q, got_scale = fp8_triton.silu_mul_quantize_rows(gate_up, groups)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert got_q.shape == (rows, cols) and got_scale[0, 0] == 1e-12


@pytest.mark.parametrize("silu_mul", [False, True], ids=["rows", "swiglu"])
def test_a_group_wider_than_one_block_is_read_twice_to_the_same_bytes(monkeypatch, silu_mul):
    """Groups up to ONE_PASS_MAX columns are read once; wider ones in blocks, twice: both give
    the torch path's bytes (the limits made small here to run both on small shapes)."""
    gen = torch.Generator().manual_seed(7)
    x = (torch.randn(3, 2 * 200, generator=gen) * torch.logspace(-2, 2, 400)).bfloat16()
    quantize = fp8_triton.silu_mul_quantize_rows if silu_mul else fp8_triton.quantize_rows
    results = []
    for one_pass_max in (fp8_triton.ONE_PASS_MAX, 64):
        monkeypatch.setattr(fp8_triton, "ONE_PASS_MAX", one_pass_max)
        monkeypatch.setattr(fp8_triton, "TWO_PASS_BLOCK", 32)
        results.append(quantize(x, 2))
    source = fused_triton.silu_and_mul(x) if silu_mul else x
    want_q, want_scale = fp8_reference.quantize_rows(source, 2)
    for got_q, got_scale in results:
        assert torch.equal(got_scale, want_scale)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))


def test_the_dispatcher_quantizes_swiglu_in_the_quantizer_for_more_than_one_row(monkeypatch):
    """fp8_silu_mul_linear on the Triton backend: one kernel for SwiGLU and the quantization, then
    _scaled_mm: the product of silu_and_mul's output through the torch quantizer."""
    from tandem.kernels import dispatch

    gen = torch.Generator().manual_seed(3)
    gate_up = (torch.randn(6, 2 * 128, generator=gen) * 2).bfloat16()
    calls = []
    real = fp8_triton.silu_mul_quantize_rows
    monkeypatch.setattr(
        fp8_triton, "silu_mul_quantize_rows", lambda *a: calls.append(a[1]) or real(*a)
    )
    for groups in (1, 2):
        weight, scale = fp8_reference.quantize_rows(
            torch.randn(96, 128, generator=gen) / 12, groups
        )
        want = fp8_reference.fp8_linear(fused_triton.silu_and_mul(gate_up), weight, scale)
        monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
        got = dispatch.fp8_silu_mul_linear(gate_up, weight, scale)
        assert got.dtype == torch.bfloat16
        # The same FP8 activations and scales (the fused quantizer is bit for bit): the same product.
        assert torch.equal(got, want)
    assert calls == [1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows, cols", [(1, 64), (5, 300), (4, 2048)])
def test_the_norm_quantized_in_its_kernel_is_the_norm_then_the_quantizer_bit_for_bit(
    rows, cols, dtype
):
    """add_rms_norm_quantize: the residual sum as add_rms_norm writes it, and the normed rows'
    FP8 bytes and scales as quantize_rows gives them from add_rms_norm's output."""
    gen = torch.Generator().manual_seed(rows + cols)
    x = (torch.randn(rows, cols, generator=gen) * 3).to(dtype)
    residual = (torch.randn(rows, cols, generator=gen) * torch.logspace(-2, 1, cols)).to(dtype)
    weight = (torch.rand(cols, generator=gen) + 0.5).to(dtype)
    residual[0] = -x[0]  # a row whose sum is zero: the smallest scale, zeros
    normed, want_total = fused_triton.add_rms_norm(x, residual, weight, 1e-5)
    want_q, want_scale = fp8_triton.quantize_rows(normed, 1)
    got_q, got_scale, got_total = fused_triton.add_rms_norm_quantize(x, residual, weight, 1e-5)
    assert torch.equal(got_total, want_total)
    assert torch.equal(got_scale, want_scale)
    assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    assert got_scale[0, 0] == 1e-12
    assert rows == 1 or want_q[1:].float().abs().max() > 0


def test_the_norm_quantizes_for_an_fp8_projection_only_where_its_quantizer_would_run(monkeypatch):
    """dispatch.add_rms_norm_fp8 fuses on the Triton backend for more than one row and one scale
    a row, outside batch invariance; elsewhere None (the caller runs add_rms_norm), and an FP8
    projection of what it returns is the projection of add_rms_norm's rows."""
    from tandem.engine.linear import Fp8Linear, apply_linear, fp8_input
    from tandem.kernels import batch_invariant, dispatch

    gen = torch.Generator().manual_seed(9)
    x, residual = (torch.randn(2, 6, 64, generator=gen) * 2).bfloat16()
    weight = (torch.rand(64, generator=gen) + 0.5).bfloat16()
    proj = Fp8Linear(64, 48, bias=True, num_groups=1)  # (Qwen2's q/k/v have a bias)
    proj.weight.data, proj.weight_scale.data = fp8_reference.quantize_rows(
        torch.randn(48, 64, generator=gen) / 8, 1
    )
    proj.bias.data = torch.randn(48, generator=gen).bfloat16()
    blocked = Fp8Linear(64, 48, bias=False, num_groups=2)
    blocked.weight.data, blocked.weight_scale.data = fp8_reference.quantize_rows(
        torch.randn(48, 64, generator=gen) / 8, 2
    )
    # Which projections a norm may quantize for: FP8, one scale a row, no adapters in the step.
    assert fp8_input(proj, None) is proj
    assert fp8_input(proj, object()) is None  # a LoRA batch: the adapters read the bf16 rows
    assert fp8_input(blocked, None) is None
    assert fp8_input(torch.nn.Linear(64, 48), None) is None
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "torch")
    assert dispatch.add_rms_norm_fp8(x, residual, weight, 1e-5, proj.weight_scale) is None
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    assert dispatch.add_rms_norm_fp8(x[:1], residual[:1], weight, 1e-5, proj.weight_scale) is None
    assert dispatch.add_rms_norm_fp8(x, residual, weight, 1e-5, blocked.weight_scale) is None
    with batch_invariant.batch_invariant(True):
        assert dispatch.add_rms_norm_fp8(x, residual, weight, 1e-5, proj.weight_scale) is None
    rows, total = dispatch.add_rms_norm_fp8(x, residual, weight, 1e-5, proj.weight_scale)
    normed, want_total = dispatch.add_rms_norm(x, residual, weight, 1e-5)
    assert torch.equal(total, want_total)
    want = apply_linear(proj, normed)
    got = apply_linear(proj, rows)
    assert got.dtype == want.dtype == torch.bfloat16 and torch.equal(got, want)
    # Quantized rows reach only the projection they were made for, or fail saying so.
    for other in (blocked, torch.nn.Linear(64, 48)):
        with pytest.raises(TypeError, match="only the Fp8Linear fp8_input chose"):
            apply_linear(other, rows)


def test_an_fp8_engine_gives_the_same_tokens_with_the_norms_quantizing(model_dirs, monkeypatch):
    """--quantization fp8 on the Triton kernels (interpreted): the norms quantizing for the
    projections after them, or the projections' own quantizers, give the same greedy tokens;
    the fused norm ran in the prefill steps (more than one row)."""
    from tandem.kernels import dispatch

    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    fused = dispatch.add_rms_norm_fp8
    fused_for = set()  # the projections whose scales a norm quantized for

    def recorded(x, residual, weight, eps, weight_scale):
        result = fused(x, residual, weight, eps, weight_scale)
        if result is not None:
            fused_for.add(weight_scale.data_ptr())
        return result

    tokens, engines = {}, []
    for mode in ("apart", "fused"):
        monkeypatch.setattr(
            dispatch, "add_rms_norm_fp8", recorded if mode == "fused" else (lambda *a: None)
        )
        tokens[mode] = _greedy_tokens(model_dirs["llama"], 5, engines, quantization="fp8")
    assert tokens["fused"] == tokens["apart"]
    # Every layer's gate/up, and q/k/v from the second layer on (the first norm adds no residual).
    layers = engines[-1].runner.model.layers
    want = {layer.mlp.gate_up_proj.weight_scale.data_ptr() for layer in layers}
    want |= {layer.self_attn.qkv_proj.weight_scale.data_ptr() for layer in layers[1:]}
    assert fused_for == want


def test_the_deterministic_mode_keeps_swiglu_out_of_the_quantizer(monkeypatch):
    """--deterministic runs the batch-invariant row tiles: the fused quantizer is not called, and
    a strided gate_up (a view of a wider buffer) is read by its row stride."""
    from tandem.kernels import batch_invariant, dispatch

    gen = torch.Generator().manual_seed(5)
    wide = (torch.randn(5, 3 * 64, generator=gen) * 2).bfloat16()
    gate_up = wide[:, : 2 * 64]
    weight, scale = fp8_reference.quantize_rows(torch.randn(32, 64, generator=gen) / 8, 1)
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    want = fp8_reference.fp8_linear(fused_triton.silu_and_mul(gate_up), weight, scale)
    assert torch.equal(dispatch.fp8_silu_mul_linear(gate_up, weight, scale), want)
    monkeypatch.setattr(
        fp8_triton, "silu_mul_quantize_rows", lambda *a: pytest.fail("fused under batch invariance")
    )
    with batch_invariant.batch_invariant(True):
        got = dispatch.fp8_silu_mul_linear(gate_up, weight, scale)
    assert got.shape == (5, 32)


def test_the_activation_quantizer_refuses_what_it_cannot_read():
    with pytest.raises(ValueError, match="do not split into 3 scale groups"):
        fp8_triton.quantize_rows(torch.zeros(2, 8), 3)
    with pytest.raises(ValueError, match="K-contiguous"):
        fp8_triton.quantize_rows(torch.zeros(8, 2).t(), 1)
    with pytest.raises(ValueError, match=r"gate_up must be \[T, 2I\]"):
        fp8_triton.silu_mul_quantize_rows(torch.zeros(2, 7), 1)
    with pytest.raises(ValueError, match="do not split into 3 scale groups"):
        fp8_triton.silu_mul_quantize_rows(torch.zeros(2, 16), 3)
