"""Issue 9, group 8: beam search. TensorRT-LLM's parameters (tensorrt_llm/sampling_params.py:
use_beam_search with best_of beams (default n) returning n; length_penalty; early_stopping, an
int: 1 stops once beam-width sequences are finished) and the issue's acceptance: the same beams and
scores as transformers' generate(num_beams=4, length_penalty=..., early_stopping=...) on the same
checkpoint. tandem reports each beam's cumulative_logprob (the sum of its tokens' log-probabilities,
TensorRT-LLM's cum_log_probs); transformers' sequences_scores divide it by length ** length_penalty.
"""

from __future__ import annotations

import grpc
import pytest
from conftest import assert_all_blocks_free

from tandem.client import RequestError, SamplingParams
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions

MAX_TOKENS = 10
# (length_penalty, TensorRT-LLM early_stopping, transformers early_stopping)
SETTINGS = [(1.0, 1, True), (0.5, 0, False), (1.5, 2, "never"), (0.0, 1, True)]


def _transformers_beams(
    ref, ids: list[int], length_penalty: float, early_stopping, eos: int, num_return: int = 4
):
    torch = ref.torch
    with torch.no_grad():
        out = ref.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            num_beams=4,
            num_return_sequences=num_return,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_new_tokens=MAX_TOKENS,
            do_sample=False,
            eos_token_id=eos,
            pad_token_id=eos,
            output_scores=True,
            return_dict_in_generate=True,
        )
    beams = []
    for seq, score in zip(out.sequences, out.sequences_scores):
        new = seq[len(ids) :].tolist()
        beams.append((new[: new.index(eos) + 1] if eos in new else new, score.item()))
    return beams


def _end_id(ref, ids, length_penalty, early_stopping) -> int:
    """A token in the middle of the best beam: as the end id, some beams end by it, others by length."""
    best = _transformers_beams(ref, ids, length_penalty, early_stopping, eos=0)[0][0]
    return best[len(best) // 2]


def _assert_same(got, want, length_penalty):
    assert [o.token_ids for o in got] == [w[0] for w in want]
    for o, (tokens, score) in zip(got, want):
        assert o.cumulative_logprob / len(tokens) ** length_penalty == pytest.approx(
            score, abs=1e-3
        )


@pytest.mark.parametrize("length_penalty,early_stopping,hf_early_stopping", SETTINGS)
def test_beams_and_scores_equal_transformers(
    tiny_llm, model_dirs, oracle, length_penalty, early_stopping, hf_early_stopping
):
    ref = oracle(model_dirs["llama"])
    for i in range(3):
        ids = tiny_llm.tokenizer.encode(f"beam prompt {i} goes here")
        end = _end_id(ref, ids, length_penalty, hf_early_stopping)
        want = _transformers_beams(ref, ids, length_penalty, hf_early_stopping, end)
        params = SamplingParams(
            max_tokens=MAX_TOKENS,
            use_beam_search=True,
            n=4,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            end_id=end,
            logprobs=0,
        )  # logprobs: the scores
        out = tiny_llm.generate(ids, params, use_tqdm=False)
        _assert_same(out.outputs, want, length_penalty)
        assert [o.index for o in out.outputs] == [0, 1, 2, 3]
        assert all(
            o.finish_reason == ("stop" if o.token_ids[-1] == end else "length") for o in out.outputs
        )
        assert out.outputs[0].text == tiny_llm.tokenizer.decode(out.outputs[0].token_ids)


def test_best_of_beams_return_the_n_best(tiny_llm, model_dirs, oracle):
    # TensorRT-LLM: beam width best_of, n returned (SamplingParams._get_sampling_config).
    ref = oracle(model_dirs["llama"])
    ids = tiny_llm.tokenizer.encode("two of four beams")
    want = _transformers_beams(ref, ids, 1.0, True, eos=0, num_return=2)
    out = tiny_llm.generate(
        ids,
        SamplingParams(
            max_tokens=MAX_TOKENS,
            use_beam_search=True,
            n=2,
            best_of=4,
            length_penalty=1.0,
            logprobs=0,
        ),
        use_tqdm=False,
    )
    _assert_same(out.outputs, want, 1.0)
    for o in out.outputs:  # logprobs=0: each beam token's log-probability, summing to the beam's
        assert len(o.logprobs) == len(o.token_ids)
        assert sum(e[t].logprob for t, e in zip(o.token_ids, o.logprobs)) == pytest.approx(
            o.cumulative_logprob, abs=1e-4
        )
    assert_all_blocks_free(tiny_llm)


def test_what_beam_search_refuses(tiny_llm):
    # TensorRT-LLM's TorchSampler.validate_request: no occurrence penalties, only the sampled logprob.
    for kwargs in (dict(repetition_penalty=1.2), dict(logprobs=2)):
        with pytest.raises(RequestError) as err:
            tiny_llm.generate(
                "x",
                SamplingParams(max_tokens=4, use_beam_search=True, n=2, **kwargs),
                use_tqdm=False,
            )
        assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT


def test_beams_share_their_prefix_blocks(model_dirs):
    """In the engine: a fork shares the parent's full blocks (their reference count grows) and
    copies only its partial last block; every block is back when the search ends."""
    engine = LLMEngine(EngineConfig(str(model_dirs["llama"]), num_blocks=64, block_size=4))
    prompt = list(range(5, 23))  # 18 tokens: 4 full blocks and a partial one
    engine.add_request(
        "b", prompt, SamplingOptions(max_tokens=6, n=4, beam_width=4, ignore_eos=True)
    )
    shared_seen = 0
    beams = None
    while engine.num_unfinished:
        for out in engine.step():
            beams = out.beams
        bm = engine.block_manager
        if len(engine.scheduler.running) == 4:  # the beams are live
            tables = [s.block_table for s in engine.scheduler.running]
            prefix = {t[0] for t in tables}
            assert (
                len(prefix) == 1 and bm._ref_counts[tables[0][0]] == 4
            )  # one copy of the prompt's blocks
            assert bm.num_blocks - bm.num_free_blocks < 4 * len(tables[0])
            shared_seen += 1
    assert shared_seen and len(beams) == 4 and all(len(b.token_ids) == 6 for b in beams)
    assert engine.block_manager.num_free_blocks == 64


def test_more_beams_than_a_step_holds_run_in_turns(model_dirs):
    """Three searches of 4 beams on an engine whose steps hold 5 sequences: the beams take turns
    and each search ends as it does alone."""

    def search(engine, prompts):
        for rid, ids in prompts.items():
            engine.add_request(
                rid, ids, SamplingOptions(max_tokens=6, n=4, beam_width=4, ignore_eos=True)
            )
        found = {}
        while engine.num_unfinished:
            for out in engine.step():
                found[out.request_id] = [
                    (b.token_ids, round(b.cumulative_logprob, 4)) for b in out.beams
                ]
        return found

    prompts = {f"r{i}": [1] + [(5 * i + k) % 300 + 4 for k in range(7 + i)] for i in range(3)}
    crowded = LLMEngine(
        EngineConfig(str(model_dirs["llama"]), num_blocks=96, block_size=4, max_num_seqs=5)
    )
    together = search(crowded, prompts)
    alone = {
        rid: search(
            LLMEngine(EngineConfig(str(model_dirs["llama"]), num_blocks=96, block_size=4)),
            {rid: ids},
        )[rid]
        for rid, ids in prompts.items()
    }
    assert together == alone
    assert crowded.block_manager.num_free_blocks == 96
