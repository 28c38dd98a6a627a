"""The one-row Triton GEMVs (kernels/gemv_triton.py) against their torch references (kernels/gemv.py),
on the CPU through TRITON_INTERPRET, random inputs of several shapes; and the dispatcher's choice.
test_gpu_engine.py runs them on a GPU inside the decode graphs; bench/gemv.py times them."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels import dispatch, fp8  # noqa: E402
from tandem.kernels import gemv as reference  # noqa: E402

if "tandem.kernels.gemv_triton" in sys.modules:  # decorated earlier without the interpreter
    importlib.reload(sys.modules["tandem.kernels.gemv_triton"])
from tandem.kernels import gemv_triton  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
# (N, K, tile): even and ragged K, N not a multiple of BLOCK_N, the default tile and others
CASES = [
    (64, 128, None),
    (37, 96, None),
    (130, 200, (4, 64, 4)),
    (9, 1024, (8, 256, 2)),
    (3, 50, (1, 32, 1)),
]


def _tolerance(dtype):
    # float32 sums in another order; bf16 outputs round once from float32, as cuBLAS's do.
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("N, K, tile", CASES)
def test_gemv_matches_linear(N, K, tile, dtype):
    gen = torch.Generator().manual_seed(N * K)
    x = torch.randn(1, K, generator=gen).to(dtype)
    weight = (torch.randn(N, K, generator=gen) * K**-0.5).to(dtype)
    bias = torch.randn(N, generator=gen).to(dtype)
    torch.testing.assert_close(
        gemv_triton.gemv(x, weight, tile=tile), reference.gemv(x, weight), **_tolerance(dtype)
    )
    torch.testing.assert_close(
        gemv_triton.gemv(x, weight, bias, tile=tile),
        reference.gemv(x, weight, bias),
        **_tolerance(dtype),
    )


@pytest.mark.parametrize("groups", [1, 2], ids=["row-scaled", "block-scaled"])
# (5, 1500): the FP8 default tile's 1024-wide steps over a ragged K.
@pytest.mark.parametrize("N, K, tile", CASES[:3] + [(9, 1024, (8, 256, 2)), (5, 1500, None)])
def test_fp8_gemv_matches_the_dequantized_product(N, K, tile, groups):
    gen = torch.Generator().manual_seed(N * K + groups)
    x = torch.randn(1, K, generator=gen).to(torch.bfloat16)
    weight, scale = fp8.quantize_rows(torch.randn(N, K, generator=gen) * K**-0.5, groups)
    bias = torch.randn(N, generator=gen).to(torch.bfloat16)
    tol = _tolerance(torch.bfloat16)
    got = gemv_triton.fp8_gemv(x, weight, scale, bias, tile=tile)
    torch.testing.assert_close(got, reference.fp8_gemv(x, weight, scale, bias), **tol)
    # The FP8 weight is what is read: the product with the unquantized weight is further off.
    gate_up = (torch.randn(1, 2 * K, generator=gen) * 3).to(torch.bfloat16)
    got = gemv_triton.fp8_silu_mul_gemv(gate_up, weight, scale, tile=tile)
    want = reference.fp8_silu_mul_gemv(gate_up, weight, scale)
    # As silu_mul_gemv's bf16 case: the interpreter rounds the activation its own way.
    assert (got.float() - want.float()).abs().max() <= 0.1 * want.float().abs().max()


def test_fp8_gemv_refuses_a_bad_scale_or_weight():
    weight, scale = fp8.quantize_rows(torch.randn(4, 8))
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        gemv_triton.fp8_gemv(torch.zeros(1, 8), weight, scale[:3])
    with pytest.raises(ValueError, match="weight_scale must be float32"):
        gemv_triton.fp8_gemv(torch.zeros(1, 8), weight, torch.ones(4, 3))
    with pytest.raises(ValueError, match="float8_e4m3fn weight"):
        gemv_triton.fp8_gemv(torch.zeros(1, 8), weight.float(), scale)


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("N, K, tile", CASES)
def test_silu_mul_gemv_matches_swiglu_then_linear(N, K, tile, dtype):
    gen = torch.Generator().manual_seed(N + K)
    gate_up = (torch.randn(1, 2 * K, generator=gen) * 3).to(dtype)
    weight = (torch.randn(N, K, generator=gen) * K**-0.5).to(dtype)
    got, want = (
        gemv_triton.silu_mul_gemv(gate_up, weight, tile=tile),
        reference.silu_mul_gemv(gate_up, weight),
    )
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, **_tolerance(dtype))
        return
    # bf16 rounds the activation twice, and the interpreter's float32 -> bf16 cast is not torch's
    # rounding (fused_triton's own silu_and_mul lands an ulp off in most elements here), so on the
    # CPU only gross errors show; test_gpu_engine.py holds the GPU kernel to torch's rounding.
    scale = want.float().abs().max()
    assert (got.float() - want.float()).abs().max() <= 0.1 * scale


def test_a_strided_weight_view_is_read_by_its_row_stride():
    gen = torch.Generator().manual_seed(1)
    full = torch.randn(48, 160, generator=gen)
    weight = full[:, 32:96]  # rows 160 apart, 64 wide
    x = torch.randn(1, 64, generator=gen)
    torch.testing.assert_close(
        gemv_triton.gemv(x, weight), reference.gemv(x, weight), **_tolerance(torch.float32)
    )


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: gemv_triton.gemv(torch.zeros(2, 8), torch.zeros(4, 8)), "one row"),
        (lambda: gemv_triton.gemv(torch.zeros(1, 8), torch.zeros(4, 6)), "weight must be"),
        (
            lambda: gemv_triton.gemv(torch.zeros(1, 8), torch.zeros(4, 8, dtype=torch.bfloat16)),
            "share a float dtype",
        ),
        (
            lambda: gemv_triton.gemv(torch.zeros(1, 8), torch.zeros(4, 8), torch.zeros(3)),
            "bias must be",
        ),
        (lambda: gemv_triton.silu_mul_gemv(torch.zeros(1, 7), torch.zeros(4, 3)), "gate | up"),
        (lambda: gemv_triton.gemv(torch.zeros(1, 0), torch.zeros(4, 0)), "K >= 1"),
        (
            lambda: gemv_triton.gemv(torch.zeros(1, 8), torch.zeros(4, 8), tile=(3, 64, 4)),
            "powers of two",
        ),
        (
            lambda: gemv_triton.gemv(torch.zeros(1, 8), torch.zeros(4, 8), tile=(0, 64, 4)),
            "powers of two",
        ),
    ],
)
def test_bad_inputs_are_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_dispatcher_sends_one_row_to_the_gemv_and_more_to_cublas(monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    calls = []
    monkeypatch.setattr(
        gemv_triton, "gemv", lambda *a, **k: calls.append("gemv") or reference.gemv(*a)
    )
    monkeypatch.setattr(
        gemv_triton,
        "silu_mul_gemv",
        lambda *a, **k: calls.append("silu") or reference.silu_mul_gemv(*a),
    )
    weight = torch.randn(16, 8)
    dispatch.linear(torch.randn(1, 8), weight)
    dispatch.silu_mul_linear(torch.randn(1, 16), weight)
    dispatch.linear(torch.randn(2, 8), weight)
    dispatch.linear(torch.randn(1, 16)[:, ::2], weight)  # not contiguous: cuBLAS
    assert calls == ["gemv", "silu"]
    monkeypatch.setenv("TANDEM_GEMV", "off")
    dispatch.linear(torch.randn(1, 8), weight)
    assert calls == ["gemv", "silu"]
    monkeypatch.setenv("TANDEM_GEMV", "0")  # not a setting: an error, not silently on
    with pytest.raises(ValueError, match="TANDEM_GEMV"):
        dispatch.linear(torch.randn(1, 8), weight)
    monkeypatch.delenv("TANDEM_ATTENTION_BACKEND")
    monkeypatch.delenv("TANDEM_GEMV")
    dispatch.linear(torch.randn(1, 8), weight)  # CPU tensors without the override: torch
    assert calls == ["gemv", "silu"]


def test_the_dispatcher_sends_one_fp8_row_to_the_fp8_gemv(monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    calls = []
    for name in ("fp8_gemv", "fp8_silu_mul_gemv"):
        real = getattr(reference, name)
        monkeypatch.setattr(
            gemv_triton, name, lambda *a, _n=name, _r=real, **k: calls.append(_n) or _r(*a)
        )
    weight, scale = fp8.quantize_rows(torch.randn(16, 8))
    x = torch.randn(1, 8).to(torch.bfloat16)
    torch.testing.assert_close(
        dispatch.fp8_linear(x, weight, scale), reference.fp8_gemv(x, weight, scale)
    )
    dispatch.fp8_silu_mul_linear(torch.randn(1, 16).to(torch.bfloat16), weight, scale)
    assert calls == ["fp8_gemv", "fp8_silu_mul_gemv"]
    dispatch.fp8_linear(torch.randn(3, 8).to(torch.bfloat16), weight, scale)  # _scaled_mm
    assert calls == ["fp8_gemv", "fp8_silu_mul_gemv"]


def test_a_bad_gemv_setting_stops_an_engine_before_its_model_loads(monkeypatch, model_dirs):
    from tandem.engine.config import EngineConfig
    from tandem.engine.model_runner import ModelRunner

    monkeypatch.setenv("TANDEM_GEMV", "of")
    with pytest.raises(ValueError, match="TANDEM_GEMV='of'; expected on or off"):
        ModelRunner(EngineConfig(str(model_dirs["llama"]), device="cpu", num_blocks=16))
