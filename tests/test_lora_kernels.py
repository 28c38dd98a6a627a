"""The batched LoRA shrink/expand (kernels/lora_triton.py) against the torch reference (kernels/lora.py),
and the reference against a plain per-token loop, on random shapes and adapter mixes; on the CPU
through TRITON_INTERPRET.

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

from tandem.kernels import lora as reference  # noqa: E402
from tandem.kernels.lora import LoRAMetadata  # noqa: E402

if "tandem.kernels.lora_triton" in sys.modules:  # decorated earlier without the interpreter
    importlib.reload(sys.modules["tandem.kernels.lora_triton"])
from tandem.kernels import lora_triton  # noqa: E402

# name: (num_tokens, in_features, slice widths of the output, rank, num_slots, token slots (-1: none) or a seed)
CASES = {
    "decode_qkv_mixed": (7, 64, (64, 32, 32), 16, 4, [0, -1, 2, 0, 3, -1, 2]),
    "decode_all_base": (5, 64, (48,), 16, 2, [-1] * 5),
    "prefill_two_adapters": (40, 96, (80, 80), 8, 3, [1] * 23 + [-1] * 5 + [2] * 12),
    "one_token": (1, 32, (16,), 16, 1, [0]),
    "wide_k_split": (9, 1100, (40,), 24, 2, [1, 0, 1, 1, 0, 0, 1, -1, 1]),
    "many_tokens_random": (300, 64, (64, 16, 16), 16, 5, 7),
}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def make_case(name, dtype):
    num_tokens, k_cols, widths, rank, num_slots, slots = CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    if isinstance(slots, int):
        slots = torch.randint(-1, num_slots, (num_tokens,), generator=gen).tolist()
    bounds = tuple(int(b) for b in torch.tensor((0,) + widths).cumsum(0))
    x = torch.randn(num_tokens, k_cols, generator=gen).to(dtype)
    a_pool = (torch.randn(num_slots, len(widths) * rank, k_cols, generator=gen) * k_cols**-0.5).to(
        dtype
    )
    b_pool = (torch.randn(num_slots, bounds[-1], rank, generator=gen) * rank**-0.5).to(dtype)
    y = torch.randn(num_tokens, bounds[-1], generator=gen).to(dtype)
    return x, a_pool, b_pool, y, slots, bounds


def tolerance(dtype):
    return dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=3e-2, rtol=2e-2)


def test_metadata_groups_tokens_by_slot():
    meta = LoRAMetadata.build([2, -1, 0, 2, -1, 1], num_slots=4)
    assert meta.token_order.tolist() == [2, 5, 0, 3, 1, 4]
    assert meta.slot_starts.tolist() == [0, 1, 2, 4, 4]
    with pytest.raises(ValueError, match="token slots"):
        LoRAMetadata.build([4], num_slots=4)


@pytest.mark.parametrize("name", CASES)
def test_reference_equals_a_per_token_loop(name):
    x, a_pool, b_pool, y, slots, bounds = make_case(name, torch.float64)
    meta = LoRAMetadata.build(slots, a_pool.shape[0])
    out = y.clone()
    reference.lora_expand(reference.lora_shrink(x, a_pool, meta), b_pool, meta, out, bounds)
    rank = b_pool.shape[2]
    expected = y.clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        for s, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
            low = x[t] @ a_pool[slot, s * rank : (s + 1) * rank].T
            expected[t, lo:hi] += low @ b_pool[slot, lo:hi].T
    torch.testing.assert_close(
        out, expected, atol=1e-5, rtol=1e-5
    )  # the reference computes in float32
    assert torch.equal(
        out[[t for t, s in enumerate(slots) if s < 0]], y[[t for t, s in enumerate(slots) if s < 0]]
    )


@pytest.mark.parametrize("dtype", DTYPES.values(), ids=DTYPES.keys())
@pytest.mark.parametrize("name", CASES)
def test_triton_equals_reference(name, dtype):
    x, a_pool, b_pool, y, slots, bounds = make_case(name, dtype)
    meta = LoRAMetadata.build(slots, a_pool.shape[0])
    buf = lora_triton.lora_shrink(x, a_pool, meta)
    expected_buf = reference.lora_shrink(x, a_pool, meta)
    used = [t for t, s in enumerate(slots) if s >= 0]
    torch.testing.assert_close(buf.sum(0)[used], expected_buf.sum(0)[used], **tolerance(dtype))
    out, expected = y.clone(), y.clone()
    lora_triton.lora_expand(buf, b_pool, meta, out, bounds)
    reference.lora_expand(expected_buf, b_pool, meta, expected, bounds)
    torch.testing.assert_close(out, expected, **tolerance(dtype))
    base = [t for t, s in enumerate(slots) if s < 0]
    assert torch.equal(out[base], y[base])  # rows without an adapter are not touched


def test_launchers_refuse_bad_inputs():
    x, a_pool, b_pool, y, slots, bounds = make_case("decode_qkv_mixed", torch.float32)
    meta = LoRAMetadata.build(slots, a_pool.shape[0])
    with pytest.raises(ValueError, match="disagree"):
        lora_triton.lora_shrink(x[:, :32], a_pool, meta)
    with pytest.raises(ValueError, match="LoRAMetadata"):
        lora_triton.lora_shrink(x[:3], a_pool, meta)
    buf = lora_triton.lora_shrink(x, a_pool, meta)
    with pytest.raises(ValueError, match="slice_bounds"):
        lora_triton.lora_expand(buf, b_pool, meta, y, (0, 64, 100))
