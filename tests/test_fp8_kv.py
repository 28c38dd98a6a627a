"""FP8 KV cache (--kv-cache-dtype fp8): the attention reference on FP8 blocks, the pool's capacity,
and FP8 serving over real processes: a split (prefill + decode) gives the aggregated worker's
tokens, and a prefill and a decode whose KV dtypes differ refuse each other with
FAILED_PRECONDITION. SmolLM2's agreement: test_fp8_smollm2.py."""

from __future__ import annotations

import random

import grpc
import pytest
import torch
from conftest import assert_all_blocks_free

from tandem.client import LLM, RequestError, SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.kernels import paged_attention as reference
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.testing.cluster import LocalCluster

FP8 = torch.float8_e4m3fn

# -- the reference kernels on FP8 blocks --


@pytest.mark.parametrize("query_lens", [[1, 1, 1], [5, 1, 12], [20]])
@pytest.mark.parametrize("kv_scales", [(1.0, 1.0), (0.02, 0.005)])
def test_paged_attention_on_fp8_blocks_matches_the_float32_pool(query_lens, kv_scales):
    gen = torch.Generator().manual_seed(sum(query_lens))
    block_size, num_blocks, heads, kv_heads, head_dim = 4, 32, 4, 2, 16
    # Keys and values of magnitude ~ 448 * scale: the scales put them in e4m3's normal range.
    k_mag, v_mag = (100 * s for s in kv_scales)
    pools = {
        dtype: torch.zeros(num_blocks, 2, block_size, kv_heads, head_dim, dtype=dtype)
        for dtype in (torch.float32, FP8)
    }
    tables, seq_lens, free = [], [], list(range(1, num_blocks))
    random.Random(0).shuffle(free)
    for q in query_lens:
        seq_len = q + 7
        tables.append([free.pop() for _ in range(-(-seq_len // block_size))])
        seq_lens.append(seq_len)
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    slots = torch.tensor(
        [
            t[p // block_size] * block_size + p % block_size
            for t, n in zip(tables, seq_lens)
            for p in range(n)
        ]
    )
    key = torch.randn(len(slots), kv_heads, head_dim, generator=gen) * k_mag
    value = torch.randn(len(slots), kv_heads, head_dim, generator=gen) * v_mag
    for pool in pools.values():
        reference.store_kv(key, value, pool, slots, kv_scales)
    stored = pools[FP8][slots // block_size, 0, slots % block_size].float() * kv_scales[0]
    assert ((stored - key).abs() <= key.abs() * 2**-4 + 1e-6).all()  # e4m3: 3 mantissa bits
    query = torch.randn(sum(query_lens), heads, head_dim, generator=gen) / k_mag
    want = reference.paged_attention(query, pools[torch.float32], meta, head_dim**-0.5)
    got = reference.paged_attention(query, pools[FP8], meta, head_dim**-0.5, kv_scales)
    error = (got - want).norm() / want.norm()
    assert error < 0.05, error


# -- the engine --


def test_fp8_pool_holds_twice_the_blocks_of_bf16_and_copies_blocks(model_dirs):
    def runner(kv_cache_dtype):
        config = EngineConfig(
            str(model_dirs["llama"]),
            dtype="bfloat16",
            kv_cache_memory_gb=0.01,
            kv_cache_dtype=kv_cache_dtype,
            max_loras=0,
        )
        return LLMEngine(config).runner

    bf16, fp8 = runner("auto"), runner("fp8")
    assert fp8.kv_cache.dtype == FP8 and fp8.block_nbytes * 2 == bf16.block_nbytes
    assert fp8.num_blocks == int(0.01 * (1 << 30)) // fp8.block_nbytes
    assert fp8.num_blocks in (2 * bf16.num_blocks, 2 * bf16.num_blocks + 1)
    assert fp8.kv_cache_bytes <= 0.01 * (1 << 30)
    fp8.kv_cache[3] = torch.randn(fp8.kv_cache[3].shape).to(FP8)
    fp8.copy_blocks([(3, 5)])  # beam forks: index_copy_ has no float8 kernel on the CPU
    assert torch.equal(fp8.kv_cache[5].view(torch.uint8), fp8.kv_cache[3].view(torch.uint8))
    assert fp8.kv_layout["dtype"] == "float8_e4m3fn" and bf16.kv_layout["dtype"] == "bfloat16"


# -- real processes --

FP8_ARGS = [
    "--quantization",
    "fp8",
    "--kv-cache-dtype",
    "fp8",
    "--block-size",
    "8",
    "--num-blocks",
    "64",
]


def test_fp8_split_equals_fp8_aggregated(model_dirs):
    """Prefill + decode with FP8 weights and an FP8 pool give the aggregated FP8 worker's tokens:
    the FP8 blocks cross NIXL intact."""
    rng = random.Random(3)
    prompts = [[1] + [rng.randrange(4, 300) for _ in range(rng.randrange(3, 40))] for _ in range(6)]
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=["--model", str(model_dirs["llama"]), *FP8_ARGS],
    ) as c:
        with (
            LLM(c.address) as split,
            LLM(c.workers[2].address, **c.worker_client_kwargs()) as aggregated,
        ):
            got = [o.outputs[0].token_ids for o in split.generate(prompts, params, use_tqdm=False)]
            want = [
                o.outputs[0].token_ids for o in aggregated.generate(prompts, params, use_tqdm=False)
            ]
            assert got == want
            assert all(len(t) == 12 for t in got)
            info = split._server_info()
            for worker in info.workers:
                assert split.get_kv_cache_capacity(worker.worker_id)["maxNumBlocks"] == 64
            assert_all_blocks_free(split)


def test_fp8_prefill_and_model_dtype_decode_refuse_each_other(model_dirs):
    with (
        LocalCluster(
            roles=["prefill", "decode"],
            engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "64"],
            worker_args={"prefill-1": ["--kv-cache-dtype", "fp8"]},
        ) as c,
        LLM(c.address) as llm,
    ):
        with pytest.raises(RequestError) as err:
            llm.generate(
                "kv dtypes differ", SamplingParams(max_tokens=4, ignore_eos=True), use_tqdm=False
            )
        assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
        assert "dtype: prefill 'float8_e4m3fn' vs decode 'float32'" in err.value.details
