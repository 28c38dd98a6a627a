"""Fresh prompts' attention over their own keys (prefill_attention_triton.py) against the torch
reference, the rope kernel's rotated key, when the engine takes that path, and an engine's tokens
with it and without; on the CPU through TRITON_INTERPRET."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402,F401  (a missing triton must fail this module, not skip it)

from tandem.kernels import batch_invariant, dispatch  # noqa: E402
from tandem.kernels import fused as fused_reference  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402

for _name in ("tandem.kernels.prefill_attention_triton", "tandem.kernels.fused_triton"):
    if _name in sys.modules:  # decorated earlier without the interpreter
        importlib.reload(sys.modules[_name])
from tandem.kernels import fused_triton  # noqa: E402
from tandem.kernels.prefill_attention_triton import (  # noqa: E402
    BLOCK_M,
    DEFAULT_CONFIG,
    FreshConfig,
    fresh_prefill_attention,
    tiled_on_gpu,
)


def _reference(query, key, value, lens, scale):
    """Each sequence's causal GQA attention over its own keys, in float32."""
    group = query.shape[1] // key.shape[1]
    out, start = [], 0
    for n in lens:
        q, k, v = (t[start : start + n].float().transpose(0, 1) for t in (query, key, value))
        k, v = k.repeat_interleave(group, 0), v.repeat_interleave(group, 0)
        out.append(F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale))
        start += n
    return torch.cat([o.transpose(0, 1) for o in out])


def _step(lens, heads, kv_heads, head_dim, dtype, seed):
    """q [T, Hq, D] contiguous (as the rope kernel returns it), key and value strided views of one
    qkv projection (as the model splits it)."""
    gen = torch.Generator().manual_seed(seed)
    num = sum(lens)
    qkv = torch.randn(num, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return (
        q.reshape(num, heads, head_dim).contiguous(),
        k.view(num, kv_heads, head_dim),
        v.view(num, kv_heads, head_dim),
        starts,
    )


CASES = {
    # name: (heads, kv_heads, head_dim, lengths)
    "one prompt, three query blocks": (4, 2, 64, [2 * BLOCK_M + 37]),
    "varlen with one-token prompts": (4, 4, 32, [1, 150, 7, 1, BLOCK_M]),
    "group of three, head_dim 80": (6, 2, 80, [70, 131]),
    "mqa": (4, 1, 32, [200, 3]),
    "head_dim 8 (padded to tl.dot's 16)": (2, 1, 8, [20, 3]),
}


# The default tiles, and query blocks of two key tiles (a diagonal tile some rows see none of).
CONFIGS = {"default": DEFAULT_CONFIG, "64/32": FreshConfig(64, 32, 4, 1)}


@pytest.mark.parametrize("config", CONFIGS)
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fresh_prompts_attention_matches_the_reference(case, dtype, config):
    heads, kv_heads, head_dim, lens = CASES[case]
    q, k, v, starts = _step(lens, heads, kv_heads, head_dim, dtype, seed=len(lens))
    scale = head_dim**-0.5
    got = fresh_prefill_attention(q, k, v, starts, max(lens), scale, CONFIGS[config])
    want = _reference(q, k, v, lens, scale)
    assert got.shape == q.shape and got.dtype == dtype
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(got.float(), want, atol=tol, rtol=tol)


def test_a_row_does_not_depend_on_the_sequences_beside_it():
    """A prompt's rows are the same alone and batched with others (each program reads only its
    own sequence's keys)."""
    q, k, v, starts = _step([90, 260, 5], 4, 2, 32, torch.float32, seed=3)
    batched = fresh_prefill_attention(q, k, v, starts, 260, 0.2)
    rows = slice(90, 350)
    alone = fresh_prefill_attention(
        q[rows].contiguous(), k[rows], v[rows], torch.tensor([0, 260], dtype=torch.int32), 260, 0.2
    )
    assert torch.equal(batched[rows], alone)


def test_the_kernel_refuses_what_it_cannot_read():
    q, k, v, starts = _step([9], 4, 2, 32, torch.float32, seed=1)
    with pytest.raises(ValueError, match="do not group"):
        fresh_prefill_attention(torch.zeros(9, 3, 32), k, v, starts, 9, 1.0)
    with pytest.raises(ValueError, match="key and value must be"):
        fresh_prefill_attention(q, k[:, :, :16], v, starts, 9, 1.0)
    with pytest.raises(ValueError, match="int32"):
        fresh_prefill_attention(q, k, v, starts.long(), 9, 1.0)
    for tiles in ((64, 48, 4, 1), (64, 8, 4, 1), (32, 64, 4, 1)):
        with pytest.raises(ValueError, match="powers of two >= 16"):
            fresh_prefill_attention(q, k, v, starts, 9, 1.0, FreshConfig(*tiles))
    with pytest.raises(ValueError, match="unit stride"):
        fresh_prefill_attention(
            q.transpose(1, 2).contiguous().transpose(1, 2), k, v, starts, 9, 1.0
        )
    empty = fresh_prefill_attention(q[:0], k[:0], v[:0], torch.zeros(1, dtype=torch.int32), 0, 1.0)
    assert empty.shape == (0, 4, 32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rope_kernel_writes_the_rotated_key_it_stores(dtype):
    """rotated_key receives exactly the key the pool gets (a pool in the model's dtype), on the
    Triton kernel as on the reference; the query comes back as without it."""
    gen = torch.Generator().manual_seed(5)
    num, heads, kv_heads, head_dim, block = 11, 4, 2, 32, 4
    qkv = torch.randn(num, (heads + 2 * kv_heads) * head_dim, generator=gen).to(dtype)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k, v = (t.reshape(num, -1, head_dim) for t in (q, k, v))
    positions = torch.arange(num)
    cos_sin = torch.randn(64, head_dim, generator=gen).to(dtype)
    meta = AttentionMetadata.build([num], [num], [[2, 0, 1]], block)
    for module in (fused_reference, fused_triton):
        pool = torch.zeros(3, 2, block, kv_heads, head_dim, dtype=dtype)
        plain_pool = pool.clone()
        rotated = torch.empty(num, kv_heads, head_dim, dtype=dtype)
        got_q = module.rope_store_kv(
            q, k, v, positions, cos_sin, pool, meta.slot_mapping, (1.0, 1.0), rotated
        )
        want_q = module.rope_store_kv(q, k, v, positions, cos_sin, plain_pool, meta.slot_mapping)
        assert torch.equal(got_q, want_q) and torch.equal(pool, plain_pool)
        slots = meta.slot_mapping
        assert torch.equal(rotated, pool[slots // block, 0, slots % block])
    with pytest.raises(ValueError, match="rotated_key must be"):
        fused_triton.rope_store_kv(
            q, k, v, positions, cos_sin, pool, meta.slot_mapping, (1.0, 1.0), rotated[:, :1]
        )


def _meta(query_lens, seq_lens):
    tables = [list(range(-(-s // 4))) for s in seq_lens]
    return AttentionMetadata.build(query_lens, seq_lens, tables, 4)


def test_fresh_prompts_means_every_sequence_starts_at_position_zero():
    assert _meta([5, 3], [5, 3]).fresh_prompts
    assert _meta([1, 7], [1, 7]).fresh_prompts  # a one-token prompt beside a longer one
    assert not _meta([5, 1], [5, 9]).fresh_prompts  # a decode row beside it
    assert not _meta([5], [12]).fresh_prompts  # a chunk after a cached prefix
    assert not _meta([1, 1], [1, 1]).fresh_prompts  # one token each: the decode kernel's
    no_host = _meta([5], [5])
    no_host._host_query_start_loc = None
    assert not no_host.fresh_prompts


def test_the_tiles_are_used_on_a_gpu_only_for_the_shapes_they_were_measured_for():
    assert tiled_on_gpu(128, torch.bfloat16) and tiled_on_gpu(64, torch.float16)
    assert not tiled_on_gpu(256, torch.bfloat16)  # Gemma 3's global layers: not measured
    assert not tiled_on_gpu(128, torch.float32)  # twice the shared memory


def test_the_dispatcher_takes_the_fresh_path_only_where_it_applies(monkeypatch):
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    monkeypatch.delenv("TANDEM_FRESH_PREFILL", raising=False)
    fresh, chunk = _meta([6], [6]), _meta([6], [10])
    query = torch.zeros(6, 4, 32)
    pool = torch.zeros(4, 2, 4, 2, 32)
    assert dispatch.fresh_prefill(fresh, query, pool)
    assert not dispatch.fresh_prefill(chunk, query, pool)
    assert not dispatch.fresh_prefill(fresh, query, pool, window=4)
    assert not dispatch.fresh_prefill(fresh, query, pool, softcap=30.0)
    assert not dispatch.fresh_prefill(fresh, query, pool.to(torch.float8_e4m3fn))
    with batch_invariant.batch_invariant(True):
        assert not dispatch.fresh_prefill(fresh, query, pool)
    monkeypatch.setenv("TANDEM_FRESH_PREFILL", "off")
    assert not dispatch.fresh_prefill(fresh, query, pool)
    monkeypatch.setenv("TANDEM_FRESH_PREFILL", "sometimes")
    with pytest.raises(ValueError, match="TANDEM_FRESH_PREFILL"):
        dispatch.check_settings(torch.device("cpu"))
    monkeypatch.setenv("TANDEM_FRESH_PREFILL", "on")
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "torch")
    assert not dispatch.fresh_prefill(fresh, query, pool)


def test_an_engine_takes_the_fresh_path_for_fresh_prompts_only_with_the_same_tokens(
    model_dirs, monkeypatch
):
    """The tiny Llama on the Triton kernels (interpreted), 16 tokens a step: a 30-token prompt (a
    fresh first chunk, then a chunk after it), then a prompt sharing its first two blocks (a
    prefix-cache hit, then a chunk after the cached blocks). With the fresh path on, every step
    whose sequences all start at position 0 runs it, in every layer, and no other step does;
    the greedy tokens are those of the paged kernel alone."""
    from conftest import run_to_completion

    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    calls = []  # (kernel, query lengths, sequence lengths), one per layer per step
    for name in ("fresh_prefill_attention", "paged_attention"):
        kernel = getattr(dispatch, name)

        def recorded(query, *args, _kernel=kernel, _name=name, **kwargs):
            meta = args[2] if _name == "fresh_prefill_attention" else args[1]
            starts = meta.host_query_start_loc()
            lens = [b - a for a, b in zip(starts, starts[1:])]
            calls.append((_name, lens, meta.host_seq_lens()))
            return _kernel(query, *args, **kwargs)

        monkeypatch.setattr(dispatch, name, recorded)
    first = [1] + list(range(40, 69))
    second = first[:16] + list(range(90, 96))
    tokens = {}
    for mode in ("off", "on"):
        monkeypatch.setenv("TANDEM_FRESH_PREFILL", mode)
        calls.clear()
        engine = LLMEngine(
            EngineConfig(
                str(model_dirs["llama"]),
                block_size=8,
                num_blocks=64,
                max_loras=0,
                enforce_eager=True,
                max_num_batched_tokens=16,
            )
        )
        options = SamplingOptions(max_tokens=2, ignore_eos=True)
        tokens[mode] = run_to_completion(engine, {"a": first}, options)
        tokens[mode] |= run_to_completion(engine, {"b": second}, options)
        num_layers = len(engine.runner.model.layers)
    assert tokens["on"] == tokens["off"]
    fresh_steps = [c for c in calls if c[1] == c[2] and max(c[1]) > 1]
    assert [c for c in calls if c[0] == "fresh_prefill_attention"] == [
        ("fresh_prefill_attention", [16], [16])
    ] * num_layers
    assert fresh_steps == [("fresh_prefill_attention", [16], [16])] * num_layers
    # The chunk after the first and the chunk after the cached prefix went to the paged kernel.
    chunks = {
        (tuple(q), tuple(n)) for kind, q, n in calls if kind == "paged_attention" and max(q) > 1
    }
    assert chunks == {((14,), (30,)), ((6,), (22,))}
