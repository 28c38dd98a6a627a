"""The skinny linear Triton kernel (kernels/skinny_linear_triton.py) against its torch reference,
on the CPU through TRITON_INTERPRET, on random inputs of several shapes and tile configs (split-K,
uneven N and K, bias, fp32 and bf16); on a GPU, `linear`'s pick against F.linear as well."""
from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.kernels.skinny_linear import skinny_linear  # noqa: E402

if "tandem.kernels.skinny_linear_triton" in sys.modules:  # decorated earlier without the interpreter
    importlib.reload(sys.modules["tandem.kernels.skinny_linear_triton"])
from tandem.kernels import skinny_linear_triton as kernel  # noqa: E402
from tandem.kernels.skinny_linear_triton import TileConfig  # noqa: E402

CASES = [  # (rows, N, K, config)
    (1, 64, 256, TileConfig(32, 64, 1)),
    (3, 96, 512, TileConfig(32, 64, 2)),
    (16, 40, 200, TileConfig(16, 64, 1)),   # N and K not multiples of the tiles
    (5, 72, 330, TileConfig(32, 64, 4)),    # split-K over an uneven K
    (2, 128, 128, TileConfig(64, 128, 1)),
]


def _inputs(rows, n, k, dtype, seed, with_bias):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, k, generator=gen).to(dtype)
    weight = (torch.randn(n, k, generator=gen) * k ** -0.5).to(dtype)
    bias = torch.randn(n, generator=gen).to(dtype) if with_bias else None
    return x, weight, bias


@pytest.mark.parametrize("with_bias", [False, True], ids=["no-bias", "bias"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES, ids=[f"{m}x{n}x{k}-split{c.split_k}" for m, n, k, c in CASES])
def test_matches_the_reference(case, dtype, with_bias):
    rows, n, k, config = case
    x, weight, bias = _inputs(rows, n, k, dtype, seed=rows * 1000 + n + k, with_bias=with_bias)
    got = kernel.skinny_linear_triton(x, weight, bias, config)
    want = skinny_linear(x.double(), weight.double(), None if bias is None else bias.double())
    assert got.dtype == dtype and got.shape == (rows, n)
    # The kernel sums in float32 and rounds once; bf16 operands are exact in float32.
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)
    torch.testing.assert_close(got.double(), want, **tol)


def test_strided_rows_are_read_where_they_are():
    x, weight, _ = _inputs(4, 64, 128, torch.float32, seed=3, with_bias=False)
    wide = torch.randn(4, 300)
    wide[:, 50:178] = x
    got = kernel.skinny_linear_triton(wide[:, 50:178], weight, None, TileConfig(32, 64, 2))
    torch.testing.assert_close(got, skinny_linear(x, weight), atol=1e-4, rtol=1e-4)


def test_bad_inputs_are_refused_with_a_message():
    x, weight, _ = _inputs(17, 32, 64, torch.float32, seed=1, with_bias=False)
    with pytest.raises(ValueError, match="at most 16 rows"):
        kernel.skinny_linear_triton(x, weight)
    with pytest.raises(ValueError, match="columns"):
        kernel.skinny_linear_triton(x[:2], weight[:, :32])
    with pytest.raises(ValueError, match="share a float dtype"):
        kernel.skinny_linear_triton(x[:2], weight.to(torch.bfloat16))
    with pytest.raises(ValueError, match="bias"):
        kernel.skinny_linear_triton(x[:2], weight, torch.zeros(31))


def test_default_config_splits_k_when_n_gives_too_few_programs():
    device = torch.device("cpu")  # counts 8 SMs off CUDA
    assert kernel.default_config(4096, 4096, device).split_k == 1  # 128 programs of 32 columns
    narrow = kernel.default_config(64, 16384, device)
    assert narrow.split_k > 1 and 16384 // narrow.split_k >= 4 * narrow.block_k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU (CI has none: the interpreter cases above run)")
def test_linear_on_the_gpu_matches_cublas_whichever_it_picks(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET")
    compiled = importlib.reload(kernel)  # compiled, not interpreted, on the device
    try:
        _check_on_the_gpu(compiled)
    finally:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        importlib.reload(kernel)


def _check_on_the_gpu(kernel):
    for rows in (1, 4, 16):
        for n, k in ((6144, 4096), (4096, 14336), (28672, 4096)):
            x, weight, bias = (t.cuda() if t is not None else None for t in _inputs(rows, n, k, torch.bfloat16, rows, False))
            for config in [None] + kernel.candidate_configs(n, k, x.device):
                got = kernel.linear(x, weight) if config is None else kernel.skinny_linear_triton(x, weight, None, config)
                want = skinny_linear(x.float(), weight.float())
                rel = (got.float() - want).norm() / want.norm()
                assert rel < 1e-2, (rows, n, k, config, rel.item())
