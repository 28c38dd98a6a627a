"""Triton paged attention / KV store against the torch reference, on the CPU through TRITON_INTERPRET.

triton is a test dependency: if it does not import, collection errors and the run fails.
"""

from __future__ import annotations

import importlib
import os
import sys

# The interpreter flag is read when kernels are decorated, so it must precede their import.
os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402,F401  (a missing triton must fail this module, not skip it)

from tandem.kernels import dispatch  # noqa: E402
from tandem.kernels import paged_attention as reference
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402

if (
    "tandem.kernels.paged_attention_triton" in sys.modules
):  # decorated earlier without the interpreter
    importlib.reload(sys.modules["tandem.kernels.paged_attention_triton"])
from tandem.kernels.paged_attention_triton import paged_attention_triton, store_kv_triton  # noqa: E402

CASES = {
    # name: (block_size, num_heads, num_kv_heads, head_dim, [(query_len, seq_len), ...])
    "decode": (16, 4, 2, 32, [(1, 1), (1, 17), (1, 40)]),
    "prefill": (4, 4, 4, 64, [(19, 19), (7, 7)]),
    "mixed": (16, 8, 2, 32, [(5, 5), (1, 30), (9, 9), (1, 3)]),
    "chunk_continuation": (4, 8, 2, 64, [(6, 37), (1, 12)]),
    "group_of_3": (16, 6, 2, 32, [(3, 20), (1, 9)]),
    "long_context_mqa": (16, 4, 1, 32, [(3, 150), (1, 70)]),  # unmasked tiles below the diagonal
}


def make_batch(block_size, num_heads, num_kv_heads, head_dim, shape, dtype, seed):
    """A layer view of a 2-layer cache holding every sequence's KV, plus the step's queries and metadata."""
    gen = torch.Generator().manual_seed(seed)
    num_blocks = sum(triton.cdiv(s, block_size) for _, s in shape) + 3
    kv_cache = torch.randn(num_blocks, 2, 2, block_size, num_kv_heads, head_dim, generator=gen).to(
        dtype
    )
    kv_layer = kv_cache[:, 1]
    free = torch.randperm(num_blocks, generator=gen).tolist()
    tables = [[free.pop() for _ in range(triton.cdiv(s, block_size))] for _, s in shape]
    for (_, seq_len), table in zip(shape, tables):
        full = AttentionMetadata.build([seq_len], [seq_len], [table], block_size)
        key, value = (
            torch.randn(seq_len, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)
        )
        reference.store_kv(key, value, kv_layer, full.slot_mapping)
    meta = AttentionMetadata.build([q for q, _ in shape], [s for _, s in shape], tables, block_size)
    query = torch.randn(int(meta.query_start_loc[-1]), num_heads, head_dim, generator=gen).to(dtype)
    return query, kv_layer, meta


def assert_matches_reference(query, kv_layer, meta, num_kv_splits=None):
    scale = query.shape[-1] ** -0.5
    out = paged_attention_triton(query, kv_layer, meta, scale, num_kv_splits=num_kv_splits)
    # The oracle runs in float32 on the same (possibly bf16-rounded) inputs.
    expected = reference.paged_attention(query.float(), kv_layer.float(), meta, scale)
    tol = 2e-5 if query.dtype == torch.float32 else 2e-2
    assert out.dtype == query.dtype and out.shape == query.shape
    torch.testing.assert_close(out.float(), expected, atol=tol, rtol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("case", CASES)
def test_attention_matches_reference(case, dtype):
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES[case]
    batch = make_batch(block_size, num_heads, num_kv_heads, head_dim, shape, dtype, seed=len(case))
    assert_matches_reference(*batch)


@pytest.mark.parametrize(
    "case,num_kv_splits", [("decode", 3), ("chunk_continuation", 2), ("mixed", 4)]
)
def test_split_kv_matches_reference(case, num_kv_splits):
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES[case]
    # Longer contexts so that each split holds more than one 64-key tile.
    shape = [(q, s + 150) for q, s in shape]
    batch = make_batch(block_size, num_heads, num_kv_heads, head_dim, shape, torch.float32, seed=7)
    assert_matches_reference(*batch, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_pinned_schedule_gives_a_row_the_same_bits_in_any_step(dtype):
    """--deterministic's schedule (batch_invariant=True): each sequence's rows alone are bitwise
    its rows in a step of decodes and prefill chunks, and a chunk's last row is bitwise that row
    computed as a decode step; it still computes attention (against the reference)."""
    block_size, num_heads, num_kv_heads, head_dim = 16, 8, 2, 32
    shape = [(1, 70), (12, 40), (1, 5), (30, 30), (1, 130), (3, 200)]
    query, kv_layer, meta = make_batch(
        block_size, num_heads, num_kv_heads, head_dim, shape, dtype, seed=11
    )
    scale = head_dim**-0.5
    batched = paged_attention_triton(query, kv_layer, meta, scale, batch_invariant=True)
    expected = reference.paged_attention(query.float(), kv_layer.float(), meta, scale)
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(batched.float(), expected, atol=tol, rtol=tol)
    starts = meta.query_start_loc.tolist()
    for b, (query_len, seq_len) in enumerate(shape):
        table = meta.block_tables[b, : triton.cdiv(seq_len, block_size)].tolist()
        rows, want = query[starts[b] : starts[b + 1]], batched[starts[b] : starts[b + 1]]
        alone = AttentionMetadata.build([query_len], [seq_len], [table], block_size)
        assert torch.equal(
            paged_attention_triton(rows, kv_layer, alone, scale, batch_invariant=True), want
        )
        last = AttentionMetadata.build([1], [seq_len], [table], block_size)
        got = paged_attention_triton(rows[-1:], kv_layer, last, scale, batch_invariant=True)
        assert torch.equal(got, want[-1:]), (query_len, seq_len)


def test_store_kv_matches_reference_on_strided_inputs():
    gen = torch.Generator().manual_seed(3)
    num_tokens, num_kv_heads, head_dim, block_size = 9, 2, 32, 4
    # key and value are column slices of one fused projection, as the model produces them.
    fused = torch.randn(num_tokens, 3 * num_kv_heads * head_dim, generator=gen)
    key, value = (
        t.view(num_tokens, num_kv_heads, head_dim)
        for t in fused.split(num_kv_heads * head_dim, -1)[1:]
    )
    assert not key.is_contiguous()
    slots = torch.randperm(6 * block_size, generator=gen)[:num_tokens]
    slots[[2, 5]] = -1
    for key_dtype, cache_dtype in [
        (torch.float32,) * 2,
        (torch.bfloat16,) * 2,
        (torch.float32, torch.bfloat16),
    ]:
        expected = torch.randn(6, 3, 2, block_size, num_kv_heads, head_dim, generator=gen).to(
            cache_dtype
        )
        actual = expected.clone()
        reference.store_kv(key.to(key_dtype), value.to(key_dtype), expected[:, 2], slots)
        store_kv_triton(key.to(key_dtype), value.to(key_dtype), actual[:, 2], slots)
        if key_dtype == cache_dtype:
            assert torch.equal(actual, expected), cache_dtype
        else:  # the interpreter's float32 -> bf16 cast may round differently from torch's by an ulp
            torch.testing.assert_close(actual, expected, atol=0, rtol=2**-7)


def test_launchers_reject_bad_inputs():
    query, kv_layer, meta = make_batch(4, 4, 2, 32, [(3, 5)], torch.float32, seed=1)
    with pytest.raises(ValueError, match="differs from kv_layer dtype"):
        paged_attention_triton(query.bfloat16(), kv_layer, meta, 1.0)
    with pytest.raises(ValueError, match="not a multiple"):
        paged_attention_triton(torch.randn(3, 3, 32), kv_layer, meta, 1.0)
    with pytest.raises(ValueError, match="unit stride"):
        paged_attention_triton(torch.randn(3, 4, 64)[:, :, ::2], kv_layer, meta, 1.0)
    with pytest.raises(ValueError, match="kv_layer must be"):
        paged_attention_triton(query, kv_layer[:, 0], meta, 1.0)
    with pytest.raises(ValueError, match="meta.seq_lens dtype"):
        paged_attention_triton(
            query,
            kv_layer,
            AttentionMetadata(
                meta.slot_mapping,
                meta.query_start_loc,
                meta.seq_lens.long(),
                meta.block_tables,
                3,
                5,
            ),
            1.0,
        )
    with pytest.raises(ValueError, match="disagree on T"):
        store_kv_triton(query[:, :2], query[:2, :2], kv_layer, meta.slot_mapping)


def test_dispatch_env_override(monkeypatch):
    query, kv_layer, meta = make_batch(4, 4, 2, 32, [(2, 6), (1, 3)], torch.float32, seed=2)
    monkeypatch.delenv("TANDEM_ATTENTION_BACKEND", raising=False)
    assert dispatch.backend_for(torch.device("cpu")) == "torch"
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    assert dispatch.backend_for(torch.device("cpu")) == "triton"
    out = dispatch.paged_attention(query, kv_layer, meta, 0.5)
    torch.testing.assert_close(
        out, reference.paged_attention(query, kv_layer, meta, 0.5), atol=2e-5, rtol=2e-5
    )
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "cuda")
    with pytest.raises(ValueError, match="TANDEM_ATTENTION_BACKEND"):
        dispatch.backend_for(torch.device("cpu"))


@pytest.mark.parametrize("wanted", [3, 5])
def test_default_splits_round_up_to_powers_of_two_with_empty_segments(monkeypatch, wanted):
    """On a GPU the default split count is bucketed to a power of two (no JIT per batch shape);
    the segments that then lie past a sequence's context must drop out of the merge."""
    import tandem.kernels.paged_attention_triton as kernel_module

    monkeypatch.setattr(kernel_module, "_default_num_splits", lambda *args: wanted)
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES["mixed"]
    shape = [(q, s + 150) for q, s in shape]
    assert_matches_reference(
        *make_batch(block_size, num_heads, num_kv_heads, head_dim, shape, torch.float32, seed=9)
    )


def test_precompile_launches_every_eager_variant():
    """The worker's warm-up launches each key-segment count with prefill and with decode tiles
    (on a GPU: compiles them), so no step compiles one in the middle of serving."""
    import tandem.kernels.paged_attention_triton as kernel_module

    kv_layer = torch.randn(4, 2, 8, 2, 32)
    assert kernel_module.precompile_eager_variants(kv_layer, 4, torch.float32) == 2 * len(
        kernel_module.EAGER_NUM_SPLITS
    )
    assert kernel_module.EAGER_NUM_SPLITS[-1] == 32  # _default_num_splits' cap
