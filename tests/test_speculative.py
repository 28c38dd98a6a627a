"""Speculative decoding (engine/speculative.py): drafts verified in one forward give exactly the
tokens of plain decoding (greedy, seeded sampling, penalties, min_tokens, stop ids, logprobs),
under preemption too, in fewer steps when the drafts are right."""

from __future__ import annotations

import json
import random

import pytest
from conftest import run_to_completion
from test_overlap_scheduling import _mixed_options

from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions
from tandem.engine.speculative import NgramIndex, SpeculativeConfig, SuffixTable


def _engine(model_dir, spec: dict | None, **kwargs) -> LLMEngine:
    config = dict(block_size=4, num_blocks=96, max_num_seqs=4, max_num_batched_tokens=32)
    config.update(kwargs)
    return LLMEngine(
        EngineConfig(str(model_dir), speculative_config=json.dumps(spec) if spec else "", **config)
    )


def drafted_steps_in_graphs(engine) -> list[bool]:
    """Spies on engine's runner: for each step of decode rows alone (a prompt chunk beside them
    makes a step eager) that verifies drafts, whether it replays a decode graph."""
    seen = []
    execute = engine.runner._execute

    def spy(batch):
        decoding = all(
            n == 1 + len(seq.draft_token_ids) for seq, n in zip(batch.seqs, batch.num_new_tokens)
        )
        if decoding and any(seq.draft_token_ids for seq in batch.seqs):
            seen.append(engine.runner._graph_size(batch) is not None)
        return execute(batch)

    engine.runner._execute = spy
    return seen


def _repetitive_prompts(seed: int, num: int) -> dict[str, list[int]]:
    """Prompts that repeat a phrase: prompt lookup finds drafts in them."""
    rng = random.Random(seed)
    prompts = {}
    for i in range(num):
        phrase = [rng.randrange(4, 300) for _ in range(rng.randrange(3, 7))]
        prompts[f"r{i}"] = [1] + phrase * rng.randrange(2, 5) + phrase[: rng.randrange(1, 3)]
    return prompts


def _full_run(engine, prompts, options):
    """Each request's tokens, logprobs and cumulative logprob."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, options[rid] if isinstance(options, dict) else options)
    got = {rid: ([], [], 0.0) for rid in prompts}
    for _ in range(10_000):
        if not engine.num_unfinished:
            break
        for out in engine.step():
            tokens, logprobs, _ = got[out.request_id]
            got[out.request_id] = (
                tokens + out.new_token_ids,
                logprobs + out.new_logprobs,
                out.cumulative_logprob,
            )
    assert engine.num_unfinished == 0
    return got


def assert_same_as_plain(engine, model_dir, prompts, options) -> None:
    """engine (drafting) gives each request plain decoding's tokens, logprobs and cumulative
    logprob."""
    got = _full_run(engine, prompts, options)
    plain = _full_run(_engine(model_dir, None), prompts, options)
    for rid in prompts:
        assert got[rid][0] == plain[rid][0], rid
        for mine, theirs in zip(got[rid][1], plain[rid][1], strict=True):
            assert (mine or {}).keys() == (theirs or {}).keys(), rid
            for token, value in (mine or {}).items():
                assert value == pytest.approx(theirs[token], abs=1e-4), rid
        assert got[rid][2] == pytest.approx(plain[rid][2], abs=1e-3)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
@pytest.mark.parametrize("k", [1, 3, 5])
def test_drafts_give_the_tokens_of_plain_decoding(model_dirs, method, k):
    prompts = _repetitive_prompts(k, 9)
    options = _mixed_options(prompts, stop_token=17)
    spec = {"method": method, "num_speculative_tokens": k, "prompt_lookup_min": 1}
    engine = _engine(model_dirs["llama"], spec)
    assert_same_as_plain(engine, model_dirs["llama"], prompts, options)
    c = engine.counters
    assert c.num_draft_tokens > 0 and c.num_accepted_draft_tokens > 0
    assert engine.block_manager.num_free_blocks == 96


def test_accepted_drafts_take_fewer_steps_and_are_counted(model_dirs):
    """A greedy request on the tiny model falls into a loop: prompt lookup drafts it and the
    target accepts; the same tokens come in fewer steps."""
    prompts = {"a": [1, 5, 6, 7, 5, 6, 7, 5, 6]}
    options = SamplingOptions(max_tokens=64, ignore_eos=True)
    engine = _engine(model_dirs["llama"], {"method": "ngram", "num_speculative_tokens": 4})
    plain = _engine(model_dirs["llama"], None)
    assert run_to_completion(engine, prompts, options) == run_to_completion(plain, prompts, options)
    c = engine.counters
    assert c.num_accepted_draft_tokens > 0
    assert c.num_steps + c.num_accepted_draft_tokens == plain.counters.num_steps
    assert c.num_steps < plain.counters.num_steps


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_verify_steps_replay_the_decode_graphs(model_dirs, method):
    """A drafted step runs in a decode graph (the ladder reaches the rows a step samples at
    most), each row a decode query over the keys up to its position: the same tokens, logprobs
    and steps as the eager verify step and as plain decoding."""
    prompts = _repetitive_prompts(11, 6)
    options = _mixed_options(prompts, stop_token=17)
    spec = {"method": method, "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = _engine(model_dirs["llama"], spec)
    drafted = drafted_steps_in_graphs(engine)
    assert_same_as_plain(engine, model_dirs["llama"], prompts, options)
    assert drafted and all(drafted)
    eager = _engine(model_dirs["llama"], spec, enforce_eager=True)
    eager_got = _full_run(eager, prompts, options)
    graph_got = _full_run(_engine(model_dirs["llama"], spec), prompts, options)
    for rid in prompts:
        assert eager_got[rid][0] == graph_got[rid][0], rid
        assert eager_got[rid][2] == pytest.approx(graph_got[rid][2], abs=1e-3), rid
    assert eager.counters.num_steps == engine.counters.num_steps


def test_verify_steps_with_long_contexts_stay_eager(model_dirs, monkeypatch):
    """Past GRAPH_VERIFY_MAX_EXTRA_KV_BYTES of keys read again by a drafted step's extra rows,
    the step runs eagerly (its multi-query kernel reads each sequence's keys once)."""
    from tandem.engine import model_runner

    monkeypatch.setattr(model_runner, "GRAPH_VERIFY_MAX_EXTRA_KV_BYTES", 0)
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = _engine(model_dirs["llama"], spec)
    in_graph = drafted_steps_in_graphs(engine)
    prompts = _repetitive_prompts(5, 3)
    assert_same_as_plain(engine, model_dirs["llama"], prompts, SamplingOptions(max_tokens=24))
    assert in_graph and not any(in_graph)


def test_no_drafts_past_disable_by_batch_size_and_those_steps_overlap(model_dirs):
    """vLLM's disable_by_batch_size: while more sequences run than it, no step drafts and steps
    stay overlapped (one in flight); once the batch shrinks to it, drafts come back; the tokens
    are plain decoding's throughout."""
    prompts = _repetitive_prompts(3, 4)
    lengths = [8, 16, 24, 48]
    options = {
        rid: SamplingOptions(max_tokens=n, ignore_eos=True) for rid, n in zip(prompts, lengths)
    }
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
    engine = _engine(model_dirs["llama"], {**spec, "disable_by_batch_size": 1})
    seen = []
    launch = engine._launch

    def spy(batch):
        running = len(engine.scheduler.running)
        drafted = any(seq.draft_token_ids for seq in batch.seqs)
        seen.append((running, drafted, engine._in_flight is not None))
        return launch(batch)

    engine._launch = spy
    assert_same_as_plain(engine, model_dirs["llama"], prompts, options)
    assert not any(drafted for running, drafted, _ in seen if running > 1)
    assert any(drafted for running, drafted, _ in seen if running == 1)
    assert any(overlapped for running, _, overlapped in seen if running > 1)
    with pytest.raises(ValueError, match="disable_by_batch_size"):
        SpeculativeConfig.parse(json.dumps({**spec, "disable_by_batch_size": 0}))


def test_unseeded_sampling_with_drafts_keeps_the_targets_distribution(model_dirs):
    """Rejection sampling keeps the target's distribution: thousands of unseeded requests whose
    second token is verified against a draft (the likeliest token, so it is accepted and
    rejected): given the first token, the second's frequencies match the target's exact
    probabilities (transformers' softmax over the top-k logits at the temperature) within 5
    standard errors each. A draft accepted blindly would put its token at 100%, a rejected
    position that drew from p without removing the draft at p + (1 - p) p."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = model_dirs["llama"]
    # After this prompt's likeliest first token (p 0.67) the next is not near-certain (0.80).
    prompt = [1, 40, 41, 42, 43]
    temperature, top_k, num = 1.5, 4, 3000
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()

    def exact(ids: list[int]) -> dict[int, float]:
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0, -1]
        top = torch.topk(logits, top_k)
        probs = torch.softmax(top.values / temperature, dim=-1)
        return dict(zip(top.indices.tolist(), probs.tolist()))

    first = exact(prompt)
    v = max(first, key=first.get)  # the first token to condition on
    want = exact(prompt + [v])
    draft = max(want, key=want.get)
    assert 0.05 < want[draft] < 0.95  # accepted sometimes, rejected sometimes
    spec = {"method": "ngram", "num_speculative_tokens": 1}
    engine = _engine(model_dir, spec, max_num_seqs=64, num_blocks=64 * 4 + 8)
    # The verification is under test, not the lookup: after v, the draft is `draft`.
    engine.proposer.propose_all = lambda wants: {
        seq: [draft] if seq.all_token_ids[-1] == v and seq.num_output_tokens == 1 else []
        for seq, _ in wants
    }
    options = SamplingOptions(max_tokens=3, ignore_eos=True, temperature=temperature, top_k=top_k)
    got = run_to_completion(engine, {f"r{i}": prompt for i in range(num)}, options)
    seconds = [tokens[1] for tokens in got.values() if tokens[0] == v]
    n = len(seconds)
    assert n > 500, n
    for token, p in want.items():
        frequency = seconds.count(token) / n
        assert abs(frequency - p) <= 5 * (p * (1 - p) / n) ** 0.5, (token, frequency, p)
    assert set(seconds) <= set(want)
    c = engine.counters
    # Most second tokens were verified (the rest drew plainly, their first token in flight).
    assert n // 2 < c.num_draft_tokens <= n
    assert 0 < c.num_accepted_draft_tokens < c.num_draft_tokens


def test_preemption_under_drafts_keeps_the_tokens(model_dirs):
    prompts = _repetitive_prompts(7, 8)
    options = SamplingOptions(max_tokens=30, ignore_eos=True)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    engine = _engine(model_dirs["llama"], spec, num_blocks=20)
    got = run_to_completion(engine, prompts, options)
    assert got == run_to_completion(
        _engine(model_dirs["llama"], None, num_blocks=20), prompts, options
    )
    assert engine.scheduler.num_preemptions > 0
    assert engine.block_manager.num_free_blocks == 20


def test_the_prefix_cache_holds_only_accepted_tokens(model_dirs):
    """A rejected draft's KV is never hashed into the prefix cache: a second request over the
    first one's whole text reuses its blocks and still decodes what plain decoding does."""
    spec = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}
    engine = _engine(model_dirs["llama"], spec)
    plain = _engine(model_dirs["llama"], None)
    options = SamplingOptions(max_tokens=20, ignore_eos=True)
    first = {"a": [1, 9, 10, 11, 9, 10, 11, 9]}
    out = run_to_completion(engine, first, options)
    assert out == run_to_completion(plain, first, options)
    second = {"b": first["a"] + out["a"]}
    assert run_to_completion(engine, second, options) == run_to_completion(plain, second, options)
    assert engine.block_manager.num_prefix_hit_tokens > 0


def test_iteration_stats_report_tensorrt_llms_spec_decoding_stats(model_dirs):
    from tandem.engine.iteration_stats import iteration_stats

    engine = _engine(model_dirs["llama"], {"method": "ngram", "num_speculative_tokens": 3})
    engine.add_request(
        "a", [1, 5, 6, 7, 5, 6, 7, 5, 6], SamplingOptions(max_tokens=40, ignore_eos=True)
    )
    seen = []
    while engine.num_unfinished:
        outputs = engine.step()
        seen.append(iteration_stats(engine, outputs, [])["specDecodingStats"])
    drafted = [s for s in seen if s["numDraftTokens"]]
    assert drafted
    for stats in drafted:
        assert stats["numRequestsWithDraftTokens"] == 1
        assert stats["acceptanceLength"] == 1 + stats["numAcceptedTokens"]
        assert 0 <= stats["draftOverhead"] < 1
    assert _engine(model_dirs["llama"], None).proposer is None


def _seq(tokens: list[int], salt: str | None = None):
    from tandem.engine.sequence import Sequence

    return Sequence("s", list(tokens), SamplingOptions(), cache_salt=salt)


def test_prompt_lookup_proposes_what_followed_the_latest_match():
    index = NgramIndex(1, 3)
    seq = _seq([1, 2, 3, 9, 1, 2, 3, 7, 8, 1, 2, 3])
    assert index.propose(seq, 3) == [7, 8, 1]  # the latest earlier [1, 2, 3] ends before 7
    seq.output_token_ids += [7, 8]
    assert index.propose(seq, 2) == [1, 2]  # [.., 7, 8] -> 1, 2 (indexed as they came)
    assert NgramIndex(2, 3).propose(_seq([5, 6, 7]), 4) == []


@pytest.mark.parametrize("seed", range(4))
def test_a_one_shot_lookup_drafts_what_the_index_drafts(seed):
    """lookup_once (a handed-off context phase's drafts) proposes NgramIndex's drafts: random
    prompts over small vocabularies (many matches), some longer than the index's window."""
    from tandem.engine import speculative

    rng = random.Random(seed)
    for _ in range(40):
        vocab = rng.choice([3, 8, 40])
        length = rng.choice([2, 9, 60, speculative.INDEX_WINDOW + rng.randrange(1, 40)])
        tokens = [rng.randrange(vocab) for _ in range(length)]
        low = rng.randrange(1, 4)
        high = rng.randrange(low, 7)
        k = rng.randrange(1, 6)
        want = NgramIndex(low, high).propose(_seq(tokens), k)
        assert speculative.lookup_once(tokens, low, high, k) == want, (length, low, high, k)


def test_the_index_covers_a_window_and_prunes_what_left_it():
    from tandem.engine import speculative

    window = speculative.INDEX_WINDOW
    # A pattern only at the very start of a prompt longer than the window is not found...
    prompt = [5, 6, 7] + [100 + i % 50 for i in range(window)] + [5, 6]
    assert NgramIndex(2, 2).propose(_seq(prompt), 1) == []
    # ...and one inside the window is.
    assert NgramIndex(2, 2).propose(_seq(prompt[-window:] + [5, 6]), 1) != []
    index = NgramIndex(1, 1)
    seq = _seq(list(range(10)))
    index.propose(seq, 1)
    seq.output_token_ids += [1000 + i for i in range(window + 10)]
    index.propose(seq, 1)
    assert all(end >= seq.num_tokens - window for end in index._ends[1].values())


def test_the_suffix_table_keeps_tenants_apart():
    table = SuffixTable(2, 3)
    table.add(("a", None), [4, 5, 6, 7, 8])
    assert table.propose(("a", None), [9, 9, 5, 6], 2) == [7, 8]
    assert table.propose(("a", None), [9, 9], 2) == []
    assert table.propose(("b", None), [9, 9, 5, 6], 2) == []  # another cache_salt
    assert table.propose(("a", "lora-x"), [9, 9, 5, 6], 2) == []  # another adapter


@pytest.mark.parametrize(
    "text, message",
    [
        ('{"method": "eagle3", "num_speculative_tokens": 3}', "EAGLE-3"),
        ('{"method": "eagle", "num_speculative_tokens": 3}', "EAGLE"),
        ('{"method": "medusa", "num_speculative_tokens": 3}', "Medusa"),
        ('{"method": "draft_model", "num_speculative_tokens": 3}', 'needs "model"'),
        (
            '{"method": "draft_model", "num_speculative_tokens": 3, "model": "/nowhere"}',
            "no config.json",
        ),
        ('{"method": "lookahead", "num_speculative_tokens": 3}', "one of"),
        ('{"method": "ngram"}', "needs num_speculative_tokens"),
        ('{"method": "ngram", "num_speculative_tokens": 0}', "[1, 16]"),
        (
            '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 5, '
            '"prompt_lookup_max": 2}',
            "prompt_lookup_min <= prompt_lookup_max",
        ),
        ('{"method": "ngram", "num_speculative_tokens": 4, "model": "x"}', "takes no"),
        ('{"method": "ngram", "num_speculative_tokens": 4, "draft": "x"}', "unknown keys"),
        ("ngram", "not JSON"),
    ],
)
def test_a_bad_speculative_config_is_refused_with_what_to_give(text, message):
    with pytest.raises(ValueError, match=None) as error:
        SpeculativeConfig.parse(text)
    assert message in str(error.value)


SPEC = '{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1}'


@pytest.fixture(scope="module")
def spec_cluster(model_dirs):
    """Router + prefill + decode (drafting) + an aggregated worker (drafting)."""
    from tandem.testing.cluster import LocalCluster

    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "96"],
        worker_args={
            "decode-1": ["--speculative-config", SPEC],
            "both-1": ["--speculative-config", SPEC],
        },
    ) as c:
        yield c


@pytest.mark.parametrize("which", ["split", "aggregated"])
def test_a_drafting_cluster_streams_the_greedy_tokens_and_reports_acceptance(
    spec_cluster, model_dirs, oracle, which
):
    from tandem.client import LLM, SamplingParams
    from tandem.testing.cluster import client_kwargs_for

    ref = oracle(model_dirs["llama"])
    address = spec_cluster.address if which == "split" else spec_cluster.workers[2].address
    worker = spec_cluster.workers[1 if which == "split" else 2]
    prompts = [ref.tokenizer.encode(f"copy {i} " * (2 + i)) for i in range(4)]
    params = SamplingParams(max_tokens=40, ignore_eos=True, logprobs=1, return_perf_metrics=True)
    with LLM(address, **client_kwargs_for(address)) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    drafted_total = accepted_total = 0
    for prompt, out in zip(prompts, outs):
        seq = out.outputs[0]
        assert seq.token_ids == ref.greedy(prompt, 40)
        assert seq.text == ref.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
        assert len(seq.logprobs) == 40
        perf = seq.request_perf_metrics.speculative_decoding
        assert 0 <= perf.total_accepted_draft_tokens <= perf.total_draft_tokens
        assert perf.acceptance_rate == pytest.approx(
            perf.total_accepted_draft_tokens / max(1, perf.total_draft_tokens)
        )
        drafted_total += perf.total_draft_tokens
        accepted_total += perf.total_accepted_draft_tokens
    with LLM(worker.address, **client_kwargs_for(worker.address)) as llm:
        stats = [s["specDecodingStats"] for s in llm.get_stats(timeout=2)]
    drafted = [s for s in stats if s and s["numDraftTokens"]]
    assert drafted and sum(s["numAcceptedTokens"] for s in drafted) > 0
    assert accepted_total > 0 and drafted_total >= accepted_total


def test_drafts_never_preempt_and_stay_within_the_steps_draft_rows(model_dirs):
    """A full pool: a sequence whose real next token fits its blocks verifies only the drafts
    the free blocks hold, and nobody is preempted for them; the step's draft rows are bounded."""
    from tandem.engine.block_manager import BlockManager
    from tandem.engine.scheduler import Scheduler
    from tandem.engine.sequence import Sequence

    bm = BlockManager(4, 16, True)
    sched = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=64, max_num_draft_tokens=3)
    a = Sequence("a", list(range(14)), SamplingOptions(max_tokens=50))
    b = Sequence("b", list(range(30)), SamplingOptions(max_tokens=50))
    for seq in (a, b):
        sched.add(seq)
    sched.schedule()  # both prompts: a holds 1 block, b 2; one free
    for seq, token in ((a, 7), (b, 8)):
        seq.output_token_ids.append(token)
        seq.num_computed_tokens = seq.num_tokens - 1
    (other,) = bm.allocate(1)  # someone else takes the last free block: the pool is full
    a.draft_token_ids = [3, 4, 5, 6]
    batch = sched.schedule()
    assert sched.num_preemptions == 0
    assert dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)) == {"a": 2, "b": 1}
    assert a.draft_token_ids == [3]  # the one draft its last block still holds
    bm.free([other])  # room again: now the step's draft rows (3) bound the drafts
    a.draft_token_ids, b.draft_token_ids = [1, 2, 3, 4], [5, 6, 7, 8]
    batch = sched.schedule()
    assert dict(zip([s.request_id for s in batch.seqs], batch.num_new_tokens)) == {"a": 4, "b": 1}
    assert (a.draft_token_ids, b.draft_token_ids) == ([1, 2, 3], [])
    assert sched.num_preemptions == 0
