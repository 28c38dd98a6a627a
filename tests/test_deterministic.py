"""--deterministic (kernels/batch_invariant.py): a request's tokens, logprobs and generation
logits are bitwise the same alone or among up to 63 other requests of mixed lengths, under
chunk budgets of 16, 64 and 512 tokens, greedy and seeded, when its generated tokens are
recomputed as a prompt (a migration), and split across a prefill and a decode worker. The
default mode runs the same cases and prints which of them it computes differently."""

from __future__ import annotations

import asyncio
import random
import signal
import time

import pytest
import torch
import torch.nn.functional as F

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.kernels import batch_invariant
from tandem.kernels import paged_attention as reference
from tandem.kernels.attention_metadata import AttentionMetadata

_rng = random.Random(33)
TARGET = [1] + [_rng.randrange(4, 300) for _ in range(150)]
# Other requests of mixed lengths (one shares the target's first 40 tokens: a prefix-cache hit).
OTHERS = [TARGET[:40] + [5, 6]] + [
    [1] + [_rng.randrange(4, 300) for _ in range(_rng.randrange(1, 200))] for _ in range(62)
]
OTHER_MAX_TOKENS = [_rng.randrange(1, 24) for _ in OTHERS]

OPTIONS = {
    "greedy": SamplingOptions(
        max_tokens=10, logprobs=2, ignore_eos=True, return_generation_logits=True
    ),
    "seeded": SamplingOptions(
        max_tokens=10,
        logprobs=2,
        ignore_eos=True,
        return_generation_logits=True,
        temperature=0.9,
        top_p=0.95,
        seed=11,
    ),
}
# (other requests, token budget per step): the target's prompt in 10, 3 and 1 chunks.
CASES = [(0, 16), (0, 64), (2, 64), (20, 16), (63, 512)]


def _engine(model_dir, deterministic: bool, budget: int, **config) -> LLMEngine:
    """config: more EngineConfig fields (test_deterministic_gpu.py: device and dtype)."""
    return LLMEngine(
        EngineConfig(
            str(model_dir),
            block_size=16,
            num_blocks=1024,
            max_num_seqs=64,
            max_num_batched_tokens=budget,
            deterministic=deterministic,
            **config,
        )
    )


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingOptions, list[int]]]):
    """Each request's (tokens, logprobs, generation logits [n, V]) from the engine; the prompt
    tokens the target found in the prefix cache go to engine.target_cached."""
    for rid, (prompt, options, given) in requests.items():
        engine.add_request(rid, prompt, options, output_token_ids=given)
    got = {rid: ([], [], []) for rid in requests}
    deadline = time.monotonic() + 60
    while engine.num_unfinished:
        assert time.monotonic() < deadline, "the engine did not finish in 60 s"
        for out in engine.step():
            tokens, logprobs, logits = got[out.request_id]
            if out.request_id == "target" and not tokens:
                engine.target_cached = out.num_cached_prompt_tokens
            tokens += out.new_token_ids
            logprobs += out.new_logprobs
            logits += out.generation_logits or []
    return {rid: (t, lp, torch.stack(lg) if lg else None) for rid, (t, lp, lg) in got.items()}


def _target_run(model_dir, deterministic, name, num_others, budget, **config):
    """The target among num_others others; the first of them, sharing its prefix, arrives first:
    under a small budget the target reads those blocks from the prefix cache."""
    others = {
        f"other{i}": (
            OTHERS[i],
            SamplingOptions(max_tokens=OTHER_MAX_TOKENS[i], ignore_eos=True),
            [],
        )
        for i in range(num_others)
    }
    requests = dict(list(others.items())[:1])
    requests["target"] = (TARGET, OPTIONS[name], [])
    requests.update(others)
    engine = _engine(model_dir, deterministic, budget, **config)
    got = _run(engine, requests)["target"]
    if (num_others, budget) == (20, 16):
        assert engine.target_cached > 0, "the case meant to hit the prefix cache did not"
    return got


def _differences(a, b) -> list[str]:
    """What differs bitwise between two (tokens, logprobs, logits) results."""
    found = []
    if a[0] != b[0]:
        found.append("tokens")
    if a[1] != b[1]:
        found.append("logprobs")
    if a[2].shape != b[2].shape or not torch.equal(a[2], b[2]):
        found.append("logits")
    return found


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_request_is_bitwise_the_same_in_any_batch_and_chunking(model_dirs, name):
    model_dir = model_dirs["llama"]
    by_mode = {}
    for deterministic in (True, False):
        alone = _target_run(model_dir, deterministic, name, 0, 512)
        assert len(alone[0]) == 10
        by_mode[deterministic] = {
            case: _differences(_target_run(model_dir, deterministic, name, *case), alone)
            for case in CASES
        }
    default = {case: diff for case, diff in by_mode[False].items() if diff}
    print(
        f"\n{name}, default mode, differences from the request alone (others, budget): "
        + (str(default) if default else "none on this machine")
    )
    assert by_mode[True] == {case: [] for case in CASES}


@pytest.mark.parametrize("name", list(OPTIONS))
def test_a_recomputed_stream_continues_bitwise(model_dirs, name):
    """A migration recomputes the prompt and the tokens already streamed as one prompt, then
    draws on: its continuation is the original's, to the bit, under --deterministic."""
    model_dir = model_dirs["llama"]
    found = {}
    for deterministic in (True, False):
        whole = _run(_engine(model_dir, deterministic, 64), {"t": (TARGET, OPTIONS[name], [])})["t"]
        given = whole[0][:4]
        resumed = _run(
            _engine(model_dir, deterministic, 64), {"t": (TARGET, OPTIONS[name], given)}
        )["t"]
        tail = (whole[0][4:], whole[1][4:], whole[2][4:])
        found[deterministic] = _differences(resumed, tail)
    print(
        f"\n{name}, default mode, recomputed continuation differs in: {found[False] or 'nothing'}"
    )
    assert found[True] == []


def test_the_batch_invariant_kernels_compute_what_the_reference_does():
    """Invariance is not enough: the tiled GEMM and the chunked attention give the reference's
    numbers up to float32 rounding (a prefill chunk, two decodes and a one-token prompt)."""
    gen = torch.Generator().manual_seed(0)
    x, w, b = (torch.randn(s, generator=gen) for s in ((37, 64), (96, 64), (96,)))
    assert torch.allclose(batch_invariant.linear(x, w, b), F.linear(x, w, b), atol=1e-5)
    num_blocks, block_size, hkv, d, hq = 40, 8, 2, 16, 4
    kv_layer = torch.randn(num_blocks, 2, block_size, hkv, d, generator=gen)
    query_lens, seq_lens = [45, 1, 1, 1], [300, 260, 7, 1]
    # Tables may share blocks here: attention only reads them.
    tables = [
        [(3 * i + j) % num_blocks for j in range(-(-s // block_size))]
        for i, s in enumerate(seq_lens)
    ]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size)
    query = torch.randn(sum(query_lens), hq, d, generator=gen)
    got = batch_invariant.paged_attention(query, kv_layer, meta, d**-0.5)
    want = reference.paged_attention(query, kv_layer, meta, d**-0.5)
    assert torch.allclose(got, want, atol=1e-5)


@pytest.mark.parametrize("num_q_heads,num_kv_heads,head_dim", [(4, 2, 16), (9, 3, 64), (8, 8, 32)])
def test_an_attention_row_is_the_same_in_a_decode_a_batch_and_any_prefill_chunk(
    num_q_heads, num_kv_heads, head_dim
):
    """The last row of a 200-token sequence, computed as a decode alone, as a decode among other
    sequences, and as the last row of prefill chunks of 3, 37 and 200 rows: bitwise equal (the
    default reference differs here, which shows the cases are not trivially equal)."""
    gen = torch.Generator().manual_seed(1)
    block_size, seq_len = 8, 200
    kv_layer = torch.randn(80, 2, block_size, num_kv_heads, head_dim, generator=gen)
    table = list(range(25))
    row = torch.randn(1, num_q_heads, head_dim, generator=gen)

    def last_row(kernel, query_len: int, others: int) -> torch.Tensor:
        lens = [query_len] + [1] * others
        seqs = [seq_len] + [50 + 30 * i for i in range(others)]
        tables = [table] + [list(range(30, 30 + -(-n // block_size))) for n in seqs[1:]]
        meta = AttentionMetadata.build(lens, seqs, tables, block_size)
        query = torch.randn(sum(lens), num_q_heads, head_dim, generator=gen)
        query[query_len - 1] = row[0]
        return kernel(query, kv_layer, meta, head_dim**-0.5)[query_len - 1]

    cases = [(1, 0), (1, 5), (3, 0), (37, 2), (200, 0)]
    rows = [last_row(batch_invariant.paged_attention, *case) for case in cases]
    assert all(torch.equal(r, rows[0]) for r in rows[1:])
    default = [last_row(reference.paged_attention, *case) for case in cases]
    print(
        f"\ndefault attention, cases equal to the decode alone: {[torch.equal(r, default[0]) for r in default]}"
    )


def test_the_mode_is_in_the_kv_layout_and_a_mixed_handoff_is_refused(model_dirs):
    import grpc

    from tandem.common.errors import status_for
    from tandem.common.exceptions import IncompatibleHandoffError
    from tandem.kvtransfer.handoff import HandoffFormat

    model_dir = model_dirs["llama"]
    layouts = {d: _engine(model_dir, d, 64).runner.kv_layout for d in (True, False)}
    assert layouts[True]["deterministic"] is True and layouts[False]["deterministic"] is False
    key = b"k" * 32
    prompt = [1, 5, 6, 7]
    opaque = HandoffFormat(layouts[False], key).build(
        "127.0.0.1:1", "agent", 3, [0], time.time() + 30, prompt, None
    )
    with pytest.raises(IncompatibleHandoffError, match="deterministic") as refused:
        HandoffFormat(layouts[True], key).parse(opaque, prompt, None)
    assert status_for(refused.value)[0] == grpc.StatusCode.FAILED_PRECONDITION


def test_the_flag_reaches_the_engine_and_lora_requests_are_refused(model_dirs):
    import argparse

    from tandem.cli.flags import add_engine_flags, engine_argv, engine_config
    from tandem.common.exceptions import PreconditionError
    from tandem.engine.lora_adapter import LoRAAdapter

    parser = argparse.ArgumentParser()
    add_engine_flags(parser)
    args = parser.parse_args(["--model", str(model_dirs["llama"]), "--deterministic"])
    config = engine_config(args, lambda model: model)
    assert config.deterministic and "--deterministic" in engine_argv(config)
    assert not engine_config(
        parser.parse_args(["--model", "x"]), lambda _: config.model_dir
    ).deterministic
    engine = _engine(model_dirs["llama"], True, 64)
    with pytest.raises(PreconditionError, match="--deterministic"):
        adapter = LoRAAdapter("a", 1, "/adapters/a", 8, "f" * 16, {})
        engine.add_request("r", [1, 2, 3], SamplingOptions(), adapter=adapter)


@pytest.fixture
def cluster(model_dirs):
    """A deterministic 1 prefill + 2 decode split beside an aggregated worker (one per test: a
    test kills a decode)."""
    from tandem.testing.cluster import LocalCluster

    with LocalCluster(
        roles=["prefill", "decode", "decode", "both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "256",
            "--block-size",
            "8",
            "--max-num-batched-tokens",
            "32",
            "--deterministic",
        ],
    ) as c:
        yield c


def _params(name: str):
    from tandem.client import SamplingParams

    seeded = {"temperature": 0.9, "top_p": 0.95, "seed": 11} if name == "seeded" else {}
    return SamplingParams(
        max_tokens=160, ignore_eos=True, logprobs=2, return_generation_logits=True, **seeded
    )


def _same(got, want) -> None:
    import numpy

    assert got.token_ids == want.token_ids
    assert got.logprobs == want.logprobs
    assert got.cumulative_logprob == want.cumulative_logprob
    assert numpy.array_equal(numpy.asarray(got.generation_logits), want.generation_logits)


@pytest.mark.parametrize("name", list(OPTIONS))
def test_split_and_migrated_streams_are_bitwise_the_aggregated_one(cluster, name):
    """Through the router: prefill on one worker, decode on another, and that decode SIGKILLed
    mid-stream (the router migrates: the prompt and the tokens so far are recomputed on a
    survivor). Tokens, logprobs and generation logits equal the aggregated worker's, bit for bit."""
    from test_disagg import worker_state

    from tandem.client import LLM, AsyncLLM

    prompt = "a deterministic story told across workers " * 3
    with LLM(cluster.workers[-1].address, **cluster.worker_client_kwargs()) as aggregated:
        want = aggregated.generate(prompt, _params(name), use_tqdm=False).outputs[0]
    with LLM(cluster.address) as llm:
        assert llm.disaggregated_params["deterministic"] is True
        assert any(k.endswith(".deterministic") and v for k, v in llm.startup_metrics.items())
        split = llm.generate(prompt, _params(name), use_tqdm=False)
    assert len(split.metrics.served_by) == 2  # a prefill, then a decode
    _same(split.outputs[0], want)

    decodes = [w for w in cluster.workers if w.role == "decode" and w.process.poll() is None]

    async def kill_the_busy_decode():
        while True:
            for w in decodes:
                state = await asyncio.to_thread(worker_state, w.address)
                if state.num_generated_tokens - baseline[w.address] >= 10:
                    w.process.send_signal(signal.SIGKILL)
                    return w
            await asyncio.sleep(0.005)

    baseline = {w.address: worker_state(w.address).num_generated_tokens for w in decodes}

    async def go():
        llm = await AsyncLLM(cluster.address)
        killer = asyncio.create_task(kill_the_busy_decode())
        try:
            async for out in llm.generate_async(prompt, _params(name), streaming=True):
                pass
            return out, await asyncio.wait_for(killer, 5)
        finally:
            killer.cancel()
            llm.close()

    migrated, killed = asyncio.run(asyncio.wait_for(go(), 60))
    assert killed.process.wait(5) == -signal.SIGKILL
    assert killed.address in migrated.metrics.served_by and len(migrated.metrics.served_by) >= 3
    _same(migrated.outputs[0], want)
