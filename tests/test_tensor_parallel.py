"""Tensor parallelism on the CPU: the sharding math against unsharded torch, and real 2-rank
engines (gloo, one follower process) against the 1-rank engine and transformers."""

from __future__ import annotations

import dataclasses
import os
import random
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from conftest import run_to_completion

from tandem.common.exceptions import PreconditionError
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import (
    TensorParallel,
    check_divisible,
    shard_columns,
    shard_fused,
    shard_parameter,
    shard_rows,
    shard_vocab,
    vocab_parallel_embedding,
    vocab_range,
)
from tandem.engine.sampling_options import SamplingOptions


class _PartialSum(TensorParallel):
    """A rank whose all-reduce leaves its partial result: the test adds the ranks' results up."""

    def all_reduce(self, x):
        return x


def test_column_and_row_parallel_linears_sum_to_the_full_product():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 12, generator=gen, dtype=torch.float64)
    up = torch.randn(8, 12, generator=gen, dtype=torch.float64)  # column-parallel [out, in]
    down = torch.randn(12, 8, generator=gen, dtype=torch.float64)  # row-parallel [out, in]
    for size in (1, 2, 4):
        partial = [
            F.linear(F.linear(x, shard_rows(up, r, size)), shard_columns(down, r, size))
            for r in range(size)
        ]
        torch.testing.assert_close(sum(partial), F.linear(F.linear(x, up), down))
        assert torch.equal(torch.cat([shard_rows(up, r, size) for r in range(size)]), up)
    with pytest.raises(ValueError, match="equal shares"):
        shard_rows(up, 0, 3)


def test_fused_qkv_split_keeps_whole_heads_per_rank():
    heads, kv_heads, head_dim = 4, 2, 3
    q, kv = heads * head_dim, kv_heads * head_dim
    # Each row holds its (part, head) id: a rank must get q heads 2r, 2r+1 and kv head r of k and v.
    rows = torch.cat(
        [
            torch.arange(heads).repeat_interleave(head_dim),
            10 + torch.arange(kv_heads).repeat_interleave(head_dim),
            20 + torch.arange(kv_heads).repeat_interleave(head_dim),
        ]
    ).float()
    for rank in range(2):
        shard = shard_fused(rows, [q, kv, kv], rank, 2).tolist()
        expected = (
            [2 * rank] * head_dim
            + [2 * rank + 1] * head_dim
            + [10 + rank] * head_dim
            + [20 + rank] * head_dim
        )
        assert shard == expected


def test_vocab_parallel_embedding_and_logits_with_a_vocab_tp_does_not_divide():
    vocab, hidden, size = (
        11,
        6,
        4,
    )  # ceil(11 / 4) = 3 rows per rank; the last rank holds 2 plus padding
    gen = torch.Generator().manual_seed(1)
    table = torch.randn(vocab, hidden, generator=gen, dtype=torch.float64)
    assert [vocab_range(vocab, r, size) for r in range(size)] == [(0, 3), (3, 6), (6, 9), (9, 11)]
    ids = torch.tensor([0, 2, 3, 8, 9, 10, 5])
    shards = [shard_vocab(table, r, size) for r in range(size)]
    assert all(s.shape == (3, hidden) for s in shards) and not shards[-1][2].any()
    parts = [
        vocab_parallel_embedding(
            ids, shards[r], vocab_range(vocab, r, size)[0], _PartialSum(r, size)
        )
        for r in range(size)
    ]
    torch.testing.assert_close(sum(parts), F.embedding(ids, table))
    states = torch.randn(4, hidden, generator=gen, dtype=torch.float64)
    gathered = torch.cat([F.linear(states, s) for s in shards], dim=-1)[:, :vocab]
    torch.testing.assert_close(gathered, F.linear(states, table))


def _config(**overrides) -> ModelConfig:
    base = dict(
        model_type="llama",
        vocab_size=100,
        hidden_size=16,
        intermediate_size=32,
        num_layers=1,
        num_heads=4,
        num_kv_heads=2,
        head_dim=4,
        rms_norm_eps=1e-6,
        rope_theta=1e4,
        rope_scaling=None,
        max_position_embeddings=64,
        tie_word_embeddings=False,
        attention_bias=True,
        qk_norm=False,
        dtype="float32",
        bos_token_id=1,
        eos_token_ids=(2,),
    )
    return ModelConfig(**{**base, **overrides})


def test_kv_head_split_and_refusals_name_the_field():
    config = _config()
    check_divisible(config, 2)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        check_divisible(config, 4)  # 4 ranks, 2 KV heads: replication is not implemented
    with pytest.raises(ValueError, match="intermediate_size=30"):
        check_divisible(_config(intermediate_size=30, num_heads=4, num_kv_heads=4), 4)
    o_bias = torch.arange(16.0)
    assert torch.equal(
        shard_parameter("layers.0.self_attn.o_proj.bias", o_bias, config, 0, 2), o_bias
    )
    assert not shard_parameter("layers.0.self_attn.o_proj.bias", o_bias, config, 1, 2).any()
    kv_weight = torch.randn(4 * 4 + 2 * 2 * 4, 16)
    assert shard_parameter("layers.0.self_attn.qkv_proj.weight", kv_weight, config, 1, 2).shape == (
        16,
        16,
    )


@pytest.fixture(scope="module")
def tp2_engines(model_dirs):
    """One 2-rank engine per model (and extra engine settings), built on demand; the one before
    is closed (one tensor-parallel engine per process) and the last at the end of the module."""
    engines: dict[tuple, LLMEngine] = {}

    def get(model: str, **extra) -> LLMEngine:
        key = (model, *sorted(extra.items()))
        if key not in engines:
            for engine in engines.values():  # one tensor-parallel engine per process
                engine.close()
            engines.clear()
            engines[key] = LLMEngine(
                EngineConfig(
                    str(model_dirs[model]),
                    block_size=4,
                    num_blocks=96,
                    max_num_seqs=4,
                    max_num_batched_tokens=24,
                    tensor_parallel_size=2,
                    max_loras=0,
                    **extra,
                )
            )
        return engines[key]

    yield get
    for engine in engines.values():
        engine.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_tp2_greedy_tokens_equal_tp1_and_transformers(model_dirs, oracle, tp2_engines, model):
    """Chunked prefill (a 24-token budget), decode batches and the in-flight tokens the followers
    get from rank 0: llama (untied head), qwen2 (q/k/v biases, tied embeddings), qwen3 (q/k norms)."""
    ref = oracle(model_dirs[model])
    rng = random.Random(7)
    prompts = {
        f"r{i}": [1]
        + [rng.randrange(4, ref.model.config.vocab_size) for _ in range(rng.randrange(3, 40))]
        for i in range(5)
    }
    options = SamplingOptions(max_tokens=10, ignore_eos=True)
    tp1 = LLMEngine(
        EngineConfig(
            str(model_dirs[model]),
            block_size=4,
            num_blocks=96,
            max_num_seqs=4,
            max_num_batched_tokens=24,
        )
    )
    expected = run_to_completion(tp1, prompts, options)
    engine = tp2_engines(model)
    assert engine.runner.kv_cache.shape[4] == ref.model.config.num_key_value_heads // 2
    got = run_to_completion(engine, prompts, options)
    assert got == expected
    for rid, ids in prompts.items():
        assert got[rid] == ref.greedy(ids, 10), rid
    assert engine.block_manager.num_free_blocks == 96


def test_tp2_refuses_what_its_ranks_cannot_follow(model_dirs, tp2_engines):
    engine = tp2_engines("llama")
    with pytest.raises(PreconditionError, match="tensor_parallel_size=2"):
        engine.release_memory(["kv_cache"])
    with pytest.raises(
        ValueError, match="LoRA adapters are not supported with tensor_parallel_size > 1"
    ):
        EngineConfig(str(model_dirs["llama"]), tensor_parallel_size=2)
    with pytest.raises(ValueError, match="num_kv_heads=2"):
        LLMEngine(
            EngineConfig(
                str(model_dirs["llama"]), num_blocks=8, tensor_parallel_size=4, max_loras=0
            )
        )


@pytest.mark.timeout(120)
def test_tp2_serves_fp8_weights_within_fp8s_own_error(model_dirs, tp2_engines):
    """--quantization fp8 under tensor parallelism: each rank quantizes its shard of every
    projection (per output channel) and row-parallel layers quantize each rank's slice of the
    activation with its own per-token scale, so TP=2 is not bitwise TP=1; its first-token
    logprobs stay within the error FP8 itself has against bf16 on this model (a wrong scale
    shard would be nats off), and the KV pool holds the same per-rank heads."""
    model_dir = str(model_dirs["llama"])
    rng = random.Random(7)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 383) for _ in range(rng.randrange(3, 40))]
        for i in range(6)
    }
    options = SamplingOptions(max_tokens=1, ignore_eos=True, logprobs=5)
    kwargs = dict(block_size=4, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=24)

    def first_logprobs(engine) -> dict:
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, options)
        got = {}
        while engine.num_unfinished:
            for out in engine.step():
                got[out.request_id] = out.new_logprobs[0]
        return got

    def worst(a: dict, b: dict) -> float:
        return max(abs(a[r][t] - b[r][t]) for r in prompts for t in set(a[r]) & set(b[r]))

    bf16 = first_logprobs(LLMEngine(EngineConfig(model_dir, **kwargs)))
    fp8 = first_logprobs(LLMEngine(EngineConfig(model_dir, quantization="fp8", **kwargs)))
    fp8_tp2 = first_logprobs(tp2_engines("llama", quantization="fp8"))
    assert worst(fp8_tp2, fp8) <= max(worst(fp8, bf16), 0.1)
    same_top = sum(
        max(fp8[r], key=fp8[r].get) == max(fp8_tp2[r], key=fp8_tp2[r].get) for r in prompts
    )
    assert same_top >= len(prompts) - 2


_RANK0_SCRIPT = textwrap.dedent("""
    import sys, time
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    engine = LLMEngine(EngineConfig(sys.argv[1], num_blocks=16, tensor_parallel_size=2, max_loras=0))
    print(" ".join(str(p.pid) for p in engine.runner.followers.processes), flush=True)
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is gone for our purpose (its parent has not reaped it).
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.timeout(90)
def test_follower_ranks_exit_when_rank0_is_killed(model_dirs):
    rank0 = subprocess.Popen(
        [sys.executable, "-c", _RANK0_SCRIPT, str(model_dirs["llama"])],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        followers = [int(pid) for pid in rank0.stdout.readline().split()]
        assert followers and all(_alive(pid) for pid in followers)
        rank0.send_signal(signal.SIGKILL)
        rank0.wait(10)
        deadline = time.monotonic() + 15
        while any(_alive(pid) for pid in followers) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(_alive(pid) for pid in followers)
    finally:
        rank0.kill()


def test_tensor_parallel_size_is_an_engine_flag():
    from tandem.cli.flags import engine_argv

    field = {f.name: f for f in dataclasses.fields(EngineConfig)}["tensor_parallel_size"]
    assert field.default == 1 and "ranks" in field.metadata["help"]
    from tandem.engine.checkpoints import tiny_model_dir

    argv = engine_argv(EngineConfig(str(tiny_model_dir()), tensor_parallel_size=2, max_loras=0))
    assert argv[argv.index("--tensor-parallel-size") + 1] == "2"


# -- handoffs between workers of different tensor-parallel sizes --


def _rank_pools(kv: torch.Tensor, tp: int) -> list[torch.Tensor]:
    """A full pool [blocks, layers, 2, block_size, heads, head_dim] cut into tp ranks' pools (heads split)."""
    return [chunk.contiguous() for chunk in kv.chunk(tp, dim=4)]


@pytest.mark.parametrize("remote_tp, local_tp", [(1, 2), (2, 1), (2, 2), (1, 4), (4, 2), (1, 1)])
def test_read_plan_moves_each_head_slice_to_the_rank_that_owns_it(remote_tp, local_tp):
    from tandem.kvtransfer.head_slices import PoolGeometry, read_plan

    num_blocks, layers, block_size, heads, head_dim = 6, 2, 4, 4, 3
    full = torch.arange(
        num_blocks * layers * 2 * block_size * heads * head_dim, dtype=torch.float32
    ).view(num_blocks, layers, 2, block_size, heads, head_dim)
    remote = [p.view(torch.uint8).reshape(-1).numpy() for p in _rank_pools(full, remote_tp)]
    local_pools = _rank_pools(torch.zeros_like(full), local_tp)
    local = [p.view(torch.uint8).reshape(-1).numpy() for p in local_pools]
    remote_ids, local_ids = [3, 4, 0], [1, 2, 5]
    plan = read_plan(
        remote_ids,
        local_ids,
        PoolGeometry(layers, block_size, heads, head_dim, 4),
        remote_tp,
        local_tp,
        max_run_blocks=None,
    )
    for remote_rank, remote_off, local_rank, local_off, nbytes in plan.tolist():
        local[local_rank][local_off : local_off + nbytes] = remote[remote_rank][
            remote_off : remote_off + nbytes
        ]
    got = torch.cat(local_pools, dim=4)
    assert torch.equal(got[local_ids], full[remote_ids])
    untouched = [b for b in range(num_blocks) if b not in local_ids]
    assert not got[untouched].any()
    if remote_tp == local_tp:  # whole blocks, one descriptor per run and rank, as at TP 1
        assert len(plan) == 2 * local_tp


def test_handoff_check_converts_tp_and_refuses_other_fields(model_dirs):
    """The layout hash leaves the TP size out (a READ converts it); what it covers is refused,
    FAILED_PRECONDITION naming the field."""
    import grpc

    from tandem.common.errors import status_for
    from tandem.common.exceptions import IncompatibleHandoffError
    from tandem.engine.kv_layout import kv_layout
    from tandem.engine.model_config import ModelConfig
    from tandem.kvtransfer.handoff import HandoffFormat

    KEY = b"k" * 32  # the signing key (every handoff is signed)
    model_dir = str(model_dirs["llama"])
    config = ModelConfig.from_pretrained(model_dir)
    prefill = HandoffFormat(kv_layout(model_dir, config, "float32", 8), KEY)
    prompt = [1, 5, 6, 7]
    opaque = prefill.build("127.0.0.1:1", "agent", 3, [0], time.time() + 30, prompt, None)
    assert HandoffFormat(kv_layout(model_dir, config, "float32", 8), KEY).parse(
        opaque, prompt, None
    ).block_ids == [0]
    for other in (
        kv_layout(model_dir, config, "float32", 4),
        kv_layout(model_dir, config, "bfloat16", 8),
        kv_layout(
            str(model_dirs["qwen3"]), ModelConfig.from_pretrained(model_dirs["qwen3"]), "float32", 8
        ),
    ):
        changed = sorted(k for k in other if other[k] != prefill.layout[k])
        with pytest.raises(IncompatibleHandoffError) as refused:
            HandoffFormat(other, KEY).parse(opaque, prompt, None)
        assert all(field in str(refused.value) for field in changed)
        assert status_for(refused.value)[0] == grpc.StatusCode.FAILED_PRECONDITION


def _cluster_tokens(
    model_dir, prefill_tp: int, decode_tp: int, prompts, max_tokens: int
) -> list[list[int]]:
    from tandem.client import LLM, SamplingParams
    from tandem.testing.cluster import LocalCluster

    tp_args = {
        f"{role}-1": ["--tensor-parallel-size", str(tp), "--max-loras", "0"]
        for role, tp in (("prefill", prefill_tp), ("decode", decode_tp))
        if tp > 1
    }
    engine_args = ["--model", str(model_dir), "--num-blocks", "64", "--block-size", "4"]
    with LocalCluster(
        roles=["prefill", "decode"], engine_args=engine_args, worker_args=tp_args, metrics=False
    ) as c:
        with LLM(c.address) as llm:
            outs = [
                llm.generate(p, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
                for p in prompts
            ]
            decode = c.workers[1].address
    for out in outs:
        assert out.metrics.served_by[-1] == decode and out.metrics.kv_transfer_bytes > 0
    return [out.outputs[0].token_ids for out in outs]


@pytest.mark.timeout(150)
@pytest.mark.parametrize("prefill_tp, decode_tp", [(1, 2), (2, 1)])
def test_split_between_tp_sizes_gives_the_aggregated_tokens(model_dirs, prefill_tp, decode_tp):
    """router + prefill + decode processes, the KV moved by NIXL (UCX) head slice by head slice."""
    model_dir = model_dirs["llama"]
    rng = random.Random(prefill_tp * 10 + decode_tp)
    prompts = [[1] + [rng.randrange(4, 300) for _ in range(rng.randrange(5, 30))] for _ in range(3)]
    aggregated = LLMEngine(EngineConfig(str(model_dir), block_size=4, num_blocks=64))
    expected = run_to_completion(
        aggregated,
        {str(i): p for i, p in enumerate(prompts)},
        SamplingOptions(max_tokens=8, ignore_eos=True),
    )
    assert _cluster_tokens(model_dir, prefill_tp, decode_tp, prompts, 8) == [
        expected[str(i)] for i in range(len(prompts))
    ]


def test_tandem_up_takes_the_tp_size_per_role():
    import argparse

    from tandem.cli.up import role_worker_args

    args = argparse.Namespace(
        prefill_tensor_parallel_size=None,
        decode_tensor_parallel_size=2,
        both_tensor_parallel_size=None,
    )
    assert role_worker_args(args, ["prefill", "decode", "decode"]) == {
        "decode-1": ["--tensor-parallel-size", "2"],
        "decode-2": ["--tensor-parallel-size", "2"],
    }
