"""--deterministic on a GPU: a request's tokens, logprobs and logits bitwise the same in any batch
and chunking (test_deterministic.py's cases, bf16 on CUDA), decode CUDA graphs on, and the pinned
attention schedule and the GEMM row tiles row-invariant on the 8B shapes.

Skipped without CUDA (CI has no GPU; the CPU runs the same cases in test_deterministic.py and the
pinned kernel through the interpreter in test_triton_kernels.py). Run it in its own pytest
process: the interpreter tests set TRITON_INTERPRET for the whole session.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from test_deterministic import CASES, OPTIONS, _differences, _engine, _run, _target_run  # noqa: E402

from tandem.engine.sampling_options import SamplingOptions  # noqa: E402
from tandem.kernels import batch_invariant  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402

GPU = {"device": "cuda", "dtype": "bfloat16"}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_request_is_bitwise_the_same_in_any_batch_and_chunking_on_the_gpu(model_dirs, name):
    alone = _target_run(model_dirs["llama"], True, name, 0, 512, **GPU)
    assert len(alone[0]) == 10
    differences = {
        case: _differences(_target_run(model_dirs["llama"], True, name, *case, **GPU), alone)
        for case in CASES
    }
    assert differences == {case: [] for case in CASES}


def test_decode_graphs_run_in_the_mode(model_dirs):
    engine = _engine(model_dirs["llama"], True, 512, **GPU)
    options = SamplingOptions(max_tokens=8, ignore_eos=True)
    _run(engine, {f"r{i}": ([1] + [5 + i] * (3 + i), options, []) for i in range(4)})
    graphs = engine.runner.graphs
    assert graphs is not None and graphs.is_captured


def test_pinned_attention_rows_do_not_depend_on_the_step():
    """Llama-3.1-8B's heads (32 query, 8 KV, 128 dims), bf16: each sequence's rows alone equal
    its rows in a step of decodes and prefill chunks, and a chunk's last row equals that row
    computed as a decode step."""
    from tandem.kernels.paged_attention_triton import paged_attention_triton

    gen = torch.Generator("cuda").manual_seed(5)
    block_size, num_heads, num_kv_heads, head_dim = 16, 32, 8, 128
    shape = [(1, 700), (37, 300), (1, 9), (128, 128), (1, 1500), (5, 2100)]
    num_blocks = sum(-(-s // block_size) for _, s in shape)
    kv_layer = torch.randn(
        num_blocks, 2, block_size, num_kv_heads, head_dim, generator=gen, device="cuda"
    ).bfloat16()
    order = torch.randperm(num_blocks, generator=gen, device="cuda").tolist()
    tables = []
    for _, seq_len in shape:
        tables.append([order.pop() for _ in range(-(-seq_len // block_size))])
    meta = AttentionMetadata.build(
        [q for q, _ in shape], [s for _, s in shape], tables, block_size, "cuda"
    )
    query = torch.randn(
        sum(q for q, _ in shape), num_heads, head_dim, generator=gen, device="cuda"
    ).bfloat16()
    scale = head_dim**-0.5

    def attend(rows, query_lens, seq_lens, seq_tables):
        step = AttentionMetadata.build(query_lens, seq_lens, seq_tables, block_size, "cuda")
        return paged_attention_triton(rows, kv_layer, step, scale, batch_invariant=True)

    batched = paged_attention_triton(query, kv_layer, meta, scale, batch_invariant=True)
    start = 0
    for (query_len, seq_len), table in zip(shape, tables):
        rows, want = query[start : start + query_len], batched[start : start + query_len]
        assert torch.equal(attend(rows, [query_len], [seq_len], [table]), want), (
            query_len,
            seq_len,
        )
        assert torch.equal(attend(rows[-1:], [1], [seq_len], [table]), want[-1:]), seq_len
        start += query_len


@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (128256, 4096)])
def test_gemm_row_tiles_do_not_depend_on_the_rows_beside(n, k):
    gen = torch.Generator("cuda").manual_seed(n)
    x = torch.randn(300, k, generator=gen, device="cuda").bfloat16()
    w = (torch.randn(n, k, generator=gen, device="cuda") / k**0.5).bfloat16()
    full = batch_invariant.linear(x, w)
    for rows in (slice(0, 1), slice(7, 10), slice(3, 67), slice(150, 300)):
        assert torch.equal(batch_invariant.linear(x[rows], w), full[rows]), rows
