"""Sliding-window and soft-capped attention: the Triton kernel (on the CPU through TRITON_INTERPRET)
and the batch-invariant schedule against the torch reference, and the reference against a dense
masked softmax written out here."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402
from test_triton_kernels import make_batch  # noqa: E402

from tandem.kernels import batch_invariant  # noqa: E402
from tandem.kernels import paged_attention as reference  # noqa: E402

if "tandem.kernels.paged_attention_triton" in sys.modules:
    importlib.reload(sys.modules["tandem.kernels.paged_attention_triton"])
from tandem.kernels.paged_attention_triton import paged_attention_triton  # noqa: E402

CASES = {
    # name: (block_size, num_heads, num_kv_heads, head_dim, [(query_len, seq_len), ...])
    "decode": (16, 4, 2, 32, [(1, 1), (1, 17), (1, 140)]),
    "prefill_past_window": (4, 4, 4, 32, [(150, 150), (7, 7)]),
    "mixed": (16, 8, 2, 32, [(5, 5), (1, 130), (70, 200), (1, 3)]),
    "chunk_continuation": (4, 8, 2, 32, [(66, 237), (1, 12)]),
}
SCORINGS = [(8, 0.0), (16, 0.0), (70, 0.0), (0, 5.0), (13, 2.0)]


def _dense(query, kv_layer, meta, scale, window, softcap):
    """Each sequence's keys gathered and attended with an explicit [Q, S] mask, in float64."""
    out = torch.empty(query.shape, dtype=torch.float64)
    starts, seq_lens = meta.host_query_start_loc(), meta.host_seq_lens()
    group = query.shape[1] // kv_layer.shape[-2]
    for b, seq_len in enumerate(seq_lens):
        key, value = reference._gather_kv(kv_layer, meta.block_tables[b])
        key = key[:seq_len].double().repeat_interleave(group, 1).transpose(0, 1)
        value = value[:seq_len].double().repeat_interleave(group, 1).transpose(0, 1)
        q = query[starts[b] : starts[b + 1]].double().transpose(0, 1)
        q_pos = torch.arange(seq_len - q.shape[1], seq_len)[:, None]
        k_pos = torch.arange(seq_len)[None, :]
        visible = (k_pos <= q_pos) & ((k_pos > q_pos - window) if window else True)
        scores = q @ key.transpose(1, 2) * scale
        if softcap:
            scores = softcap * torch.tanh(scores / softcap)
        weights = scores.masked_fill(~visible, float("-inf")).softmax(-1)
        out[starts[b] : starts[b + 1]] = (weights @ value).transpose(0, 1)
    return out


@pytest.mark.parametrize("window,softcap", SCORINGS)
@pytest.mark.parametrize("case", CASES)
def test_reference_matches_dense(case, window, softcap):
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES[case]
    query, kv_layer, meta = make_batch(
        block_size, num_heads, num_kv_heads, head_dim, shape, torch.float32, seed=3
    )
    scale = head_dim**-0.5
    got = reference.paged_attention(query, kv_layer, meta, scale, window=window, softcap=softcap)
    want = _dense(query, kv_layer, meta, scale, window, softcap)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


# Every case once with the narrowest window; the edges of the tile walk (a window shorter than a
# tile, one spanning two, capping alone and with a window) each under key splits too.
TRITON_RUNS = [(case, 8, 0.0, 1) for case in CASES] + [
    ("decode", 70, 0.0, 3),
    ("prefill_past_window", 16, 0.0, 3),
    ("mixed", 13, 2.0, 3),
    ("chunk_continuation", 70, 0.0, 3),
    ("chunk_continuation", 0, 5.0, 1),
]


@pytest.mark.parametrize("case,window,softcap,num_kv_splits", TRITON_RUNS)
def test_triton_matches_reference(case, window, softcap, num_kv_splits):
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES[case]
    query, kv_layer, meta = make_batch(
        block_size, num_heads, num_kv_heads, head_dim, shape, torch.float32, seed=5
    )
    scale = head_dim**-0.5
    got = paged_attention_triton(
        query, kv_layer, meta, scale, window=window, softcap=softcap, num_kv_splits=num_kv_splits
    )
    want = reference.paged_attention(query, kv_layer, meta, scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("window,softcap", [(8, 0.0), (70, 3.0)])
@pytest.mark.parametrize("case", ["mixed", "chunk_continuation"])
def test_batch_invariant_schedule_matches_reference(case, window, softcap):
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES[case]
    query, kv_layer, meta = make_batch(
        block_size, num_heads, num_kv_heads, head_dim, shape, torch.float32, seed=11
    )
    scale = head_dim**-0.5
    got = batch_invariant.paged_attention(
        query, kv_layer, meta, scale, window=window, softcap=softcap
    )
    want = reference.paged_attention(query, kv_layer, meta, scale, window=window, softcap=softcap)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=2e-5)


def test_bf16_window_matches_reference():
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES["mixed"]
    query, kv_layer, meta = make_batch(
        block_size, num_heads, num_kv_heads, head_dim, shape, torch.bfloat16, seed=2
    )
    scale = head_dim**-0.5
    got = paged_attention_triton(query, kv_layer, meta, scale, window=16, softcap=4.0)
    want = reference.paged_attention(
        query.float(), kv_layer.float(), meta, scale, window=16, softcap=4.0
    )
    torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_fp8_pool_window_matches_reference():
    """An FP8 KV pool goes through the same kernel: the window and the cap hold there too."""
    block_size, num_heads, num_kv_heads, head_dim, shape = CASES["mixed"]
    query, kv_layer, meta = make_batch(
        block_size, num_heads, num_kv_heads, head_dim, shape, torch.float32, seed=4
    )
    pool = (kv_layer * 4).clamp(-400, 400).to(torch.float8_e4m3fn)
    scale, kv_scales = head_dim**-0.5, (0.25, 0.25)
    got = paged_attention_triton(query, pool, meta, scale, kv_scales, window=8, softcap=3.0)
    want = reference.paged_attention(query, pool, meta, scale, kv_scales, window=8, softcap=3.0)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
