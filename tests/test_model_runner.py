"""The device side on the CPU: packed step inputs, the padded decode path the GPU replays as
CUDA graphs (the same function runs here), and the thread's device binding."""

from __future__ import annotations

import random

import pytest
import torch
from conftest import run_to_completion

from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import DecodeGraphs, capture_sizes
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.model_runner import ModelRunner
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.engine.step_inputs import InputBuffers


def _seq(prompt, computed, block_table, outputs=()):
    seq = Sequence("r", list(prompt), SamplingOptions(), output_token_ids=list(outputs))
    seq.num_computed_tokens = computed
    seq.block_table = list(block_table)
    return seq


def test_prepare_packs_a_mixed_step():
    buffers = InputBuffers(
        max_num_tokens=32,
        max_num_seqs=4,
        max_blocks_per_seq=8,
        block_size=4,
        device=torch.device("cpu"),
    )
    chunk = _seq(range(100, 110), computed=2, block_table=[7, 3, 5])  # tokens 2..7 of 10: no sample
    decode = _seq([1, 2, 3, 4, 5], computed=5, block_table=[6, 2], outputs=[42])  # position 5
    inputs = buffers.prepare(ScheduledBatch([chunk, decode], [6, 1]))
    assert inputs.input_ids.tolist() == [102, 103, 104, 105, 106, 107, 42]
    assert inputs.positions.tolist() == [2, 3, 4, 5, 6, 7, 5]
    assert inputs.meta.slot_mapping.tolist() == [30, 31, 12, 13, 14, 15, 9]
    assert inputs.meta.query_start_loc.tolist() == [0, 6, 7] and inputs.meta.seq_lens.tolist() == [
        8,
        6,
    ]
    assert inputs.meta.block_tables[:, :3].tolist() == [[7, 3, 5], [6, 2, 0]]
    assert inputs.sample_rows.tolist() == [6] and inputs.sample_indices == [1]
    assert inputs.meta.max_query_len == 6 and inputs.graph_size is None


def test_prepare_pads_a_decode_step_to_its_graph():
    buffers = InputBuffers(
        max_num_tokens=16,
        max_num_seqs=8,
        max_blocks_per_seq=4,
        block_size=4,
        device=torch.device("cpu"),
    )
    seqs = [
        _seq([1, 2, 3], computed=3, block_table=[5], outputs=[9]),
        _seq([4, 5, 6, 7, 8], computed=5, block_table=[1, 6], outputs=[8]),
    ]
    inputs = buffers.prepare(ScheduledBatch(seqs, [1, 1]), graph_size=4)
    views, meta = buffers.graph_metadata(4, None, 64)
    # The step landed exactly where the graph of batch size 4 reads.
    assert views["input_ids"].tolist() == [9, 8, 0, 0] == inputs.input_ids.tolist()
    assert meta.slot_mapping.tolist() == [23, 25, -1, -1]  # padding stores no KV
    assert meta.seq_lens.tolist() == [4, 6, 1, 1] and meta.query_start_loc.tolist() == [
        0,
        1,
        2,
        3,
        4,
    ]
    assert inputs.sample_indices == [0, 1]


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_the_device_table_gets_only_new_entries_and_stays_exact(seed):
    """A row that holds the same sequence's table as at the last upload gets only the entries it
    gained; the device table equals every sequence's table after each step, through growing
    tables, new tables (a preemption), rows that change hands, padded decode steps and a graph
    capture between a pack and its upload, as when every entry is written each step."""
    rng = random.Random(seed)
    bs, width = 4, 32

    def buffers(incremental: bool) -> InputBuffers:
        b = InputBuffers(32, 8, width, bs, torch.device("cpu"))
        b.incremental_tables = incremental
        return b

    fast, whole = buffers(True), buffers(False)
    next_block = iter(range(1, 10_000))
    seqs = []
    for i in range(6):
        n = rng.randrange(1, 40)
        seqs.append(_seq(range(n), n - 1, [next(next_block) for _ in range(-(-n // bs))]))
    num_fast = num_whole = 0
    batch_seqs = seqs
    for step in range(80):
        if rng.random() < 0.2:  # mostly the same rows step after step, as in steady decoding
            batch_seqs = rng.sample(seqs, rng.randrange(1, 7))
        for seq in batch_seqs:
            if rng.random() < 0.05:  # preempted and back: a new table, the same sequence
                seq.block_table = [next(next_block) for _ in seq.block_table]
            seq.output_token_ids.append(rng.randrange(100))
            seq.num_computed_tokens = seq.num_tokens - 1
            if len(seq.block_table) * bs < seq.num_tokens:
                seq.block_table.append(next(next_block))
        batch = ScheduledBatch(batch_seqs, [1] * len(batch_seqs))
        graph_size = 8 if rng.random() < 0.5 else None
        for b in (fast, whole):
            packed = b.pack(batch, graph_size)
            if b is fast and rng.random() < 0.1:
                b.fill_dummy(8)  # a capture between the pack and the upload
            b.upload(packed)
            for row, seq in enumerate(batch_seqs):
                assert b.block_tables[row, : len(seq.block_table)].tolist() == seq.block_table
            if b is fast:
                num_fast += packed.counts[4]  # the table entries the step carried
            else:
                num_whole += packed.counts[4]
    assert num_fast < num_whole / 2


def test_capture_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(12) == [1, 2, 4, 8, 12]
    assert capture_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    # Speculative decoding's draft rows past the sequences: every 64.
    assert capture_sizes(200, dense_until=32) == [1, 2, 4, 8, 16, 32, 96, 160, 200]
    graphs = DecodeGraphs(lambda size: None, lambda size: None, 40, torch.device("cpu"))
    assert [graphs.size_for(n) for n in (1, 3, 9, 33, 40, 41)] == [1, 4, 16, 40, 40, None]


def _engine(model_dir, enforce_eager, max_num_seqs=8):
    return LLMEngine(
        EngineConfig(
            str(model_dir),
            block_size=4,
            num_blocks=128,
            max_num_seqs=max_num_seqs,
            enforce_eager=enforce_eager,
        )
    )


def _generate(model_dir, enforce_eager, prompts, options, max_num_seqs=8):
    engine = _engine(model_dir, enforce_eager, max_num_seqs)
    return run_to_completion(engine, prompts, options), engine


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_padded_decode_path_equals_eager(model_dirs, oracle, model):
    """5 sequences ride the batch-8 graph (3 padding rows); seeded sampled rows too."""
    rng = random.Random(5)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 200) for _ in range(rng.randrange(3, 20))]
        for i in range(5)
    }
    options = {
        rid: SamplingOptions(
            max_tokens=10, ignore_eos=True, temperature=0.0 if i % 2 else 0.9, seed=i
        )
        for i, rid in enumerate(prompts)
    }
    padded, engine = _generate(model_dirs[model], False, prompts, options)
    eager, _ = _generate(model_dirs[model], True, prompts, options)
    assert padded == eager
    assert engine.runner.graphs.size_for(5) == 8
    ref = oracle(model_dirs[model])
    for i, (rid, ids) in enumerate(prompts.items()):
        if options[rid].is_greedy:
            assert padded[rid] == ref.greedy(ids, 10)


_PLAIN = SamplingOptions(max_tokens=8, ignore_eos=True)
_LOGPROBS = SamplingOptions(max_tokens=8, ignore_eos=True, logprobs=2)
_PENALTY = SamplingOptions(max_tokens=8, ignore_eos=True, repetition_penalty=1.3)
_SEEDED = SamplingOptions(max_tokens=8, ignore_eos=True, temperature=0.8, seed=4)


@pytest.mark.parametrize(
    "variants",
    [
        # Nothing changes the logits: the graph's ids and log-probabilities go to the host as drawn.
        [_PLAIN, _LOGPROBS],
        # A penalty and a random draw beside them: the sampler takes the graph's lse only.
        [_PLAIN, _LOGPROBS, _PENALTY, _SEEDED],
    ],
    ids=["greedy", "mixed"],
)
def test_the_decode_graph_draws_greedily_and_the_sampler_starts_from_it(
    model_dirs, monkeypatch, variants
):
    """A decode graph's replay draws every row greedily (the argmax, its log-probability, the lse):
    the sampler takes those and launches no draw of its own; tokens and log-probabilities equal the
    eager engine's."""
    import inspect

    from tandem.kernels import dispatch

    rng = random.Random(11)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 200) for _ in range(rng.randrange(3, 20))]
        for i in range(6)
    }
    options = {rid: variants[i % len(variants)] for i, rid in enumerate(prompts)}

    def outputs(enforce_eager):
        engine = _engine(model_dirs["llama"], enforce_eager)
        draws, handed = [], []
        real_draw, real_sample = dispatch.greedy_draw, engine.runner.sampler.sample
        signature = inspect.signature(real_sample)
        monkeypatch.setattr(
            dispatch,
            "greedy_draw",
            lambda logits, out=None: draws.append(1) or real_draw(logits, out),
        )

        def sample(*args, **kwargs):  # whether the sampler was handed the step's greedy draws
            handed.append(signature.bind(*args, **kwargs).arguments.get("greedy") is not None)
            return real_sample(*args, **kwargs)

        engine.runner.sampler.sample = sample
        for rid, ids in prompts.items():
            engine.add_request(rid, ids, options[rid])
        got = {rid: [] for rid in prompts}
        while engine.num_unfinished:
            for out in engine.step():
                got[out.request_id] += [
                    (
                        t,
                        top and {k: round(v, 4) for k, v in top.items()},
                        round(out.cumulative_logprob, 3),
                    )
                    for t, top in zip(out.new_token_ids, out.new_logprobs)
                ]
        monkeypatch.setattr(dispatch, "greedy_draw", real_draw)
        return got, len(draws), handed

    graphed, graph_draws, graph_steps = outputs(enforce_eager=False)
    eager, eager_draws, eager_steps = outputs(enforce_eager=True)
    assert graphed == eager
    # One greedy draw a sampling step on either path: in the graph's replay or in the sampler.
    assert graph_draws == len(graph_steps) and eager_draws == len(eager_steps)
    # The prompts' step draws in the sampler, each of the 7 decode steps takes the graph's.
    assert graph_steps == [False] + [True] * 7 and not any(eager_steps)


def test_bind_device_sets_the_thread_current_device(monkeypatch):
    """CUDA's current device is per thread; each step binds the engine's own before launching."""
    calls = []
    monkeypatch.setattr(torch.cuda, "set_device", calls.append)
    runner = ModelRunner.__new__(ModelRunner)
    runner.device = torch.device("cuda", 1)
    runner.bind_device()
    runner.device = torch.device("cpu")
    runner.bind_device()
    assert calls == [torch.device("cuda", 1)]


def test_engine_flags_reach_the_config_and_tandem_up_passes_them_on(model_dirs):
    from tandem.cli.flags import engine_argv
    from tandem.cli.main import _engine_config, _parser

    args = _parser().parse_args(
        [
            "serve",
            "both",
            "--model",
            str(model_dirs["llama"]),
            "--enforce-eager",
            "--no-overlap-scheduling",
        ]
    )
    config = _engine_config(args)
    assert config.enforce_eager and not config.overlap_scheduling
    assert _engine_config(_parser().parse_args(["serve", "both", *engine_argv(config)])) == config
