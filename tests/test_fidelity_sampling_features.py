"""Issue 9, group 8: SamplingParams features the server implements, each against what
TensorRT-LLM documents (tensorrt_llm/sampling_params.py, SamplingParams docstring and
_get_bad_words; executor/result.py) with transformers' generate on the same checkpoint as the
oracle for the tokens.

- bad / bad_token_ids: "redirect the generation when they are generated, so that the bad strings
  are excluded from the returned output"; _get_bad_words makes each bad token id a one-token word
  and tokenizes each bad string (without special tokens): transformers' bad_words_ids.
- no_repeat_ngram_size: transformers' no_repeat_ngram_size.
- embedding_bias: "the embedding bias tensor ... shape [vocab_size]", added to the logits.
- exclude_input_from_output=False: "output tokens in Result should include the input tokens".
"""

from __future__ import annotations

import pytest

from tandem.client import SamplingParams

PROMPTS = ["bad words are redirected", "no n-gram twice in a row please", "bias toward one token"]
MAX_TOKENS = 12


_GREEDY: dict[str, list[int]] = {}


def _greedy(ref, ids: list[int], **kwargs) -> list[int]:
    """transformers' greedy tokens (the same call from both fixtures' runs is made once)."""
    key = repr((ids, sorted(kwargs.items())))
    if key not in _GREEDY:
        _GREEDY[key] = _transformers_greedy(ref, ids, **kwargs)
    return _GREEDY[key]


def _transformers_greedy(ref, ids: list[int], **kwargs) -> list[int]:
    torch = ref.torch
    with torch.no_grad():
        out = ref.model.generate(
            torch.tensor([ids]),
            attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            do_sample=False,
            max_new_tokens=MAX_TOKENS,
            pad_token_id=0,
            eos_token_id=None,
            **kwargs,
        )
    return out[0, len(ids) :].tolist()


def _generate(tiny_llm, prompt, **kwargs):
    return tiny_llm.generate(
        prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, **kwargs), use_tqdm=False
    ).outputs[0]


def test_bad_token_ids_and_bad_strings_are_never_generated(tiny_llm, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    for prompt in PROMPTS:
        ids = tiny_llm.tokenizer.encode(prompt)
        free = _greedy(ref, ids)
        banned = sorted(set(free[:4]))[:2]
        out = _generate(tiny_llm, ids, bad_token_ids=banned)
        assert not set(out.token_ids) & set(banned)
        assert out.token_ids == _greedy(ref, ids, bad_words_ids=[[t] for t in banned])
    # A bad string: its tokens (no special tokens) as one word, whose last token is banned after the rest.
    for prompt in PROMPTS:
        ids = tiny_llm.tokenizer.encode(prompt)
        free = _greedy(ref, ids)
        # Two generated tokens whose text tokenizes back to them (the word is met as generated).
        at = next(
            (
                i
                for i in range(1, len(free) - 1)
                if tiny_llm.tokenizer.encode(
                    tiny_llm.tokenizer.decode(free[i : i + 2]), add_special_tokens=False
                )
                == free[i : i + 2]
            ),
            None,
        )
        if at is None:
            continue
        out = _generate(tiny_llm, ids, bad=tiny_llm.tokenizer.decode(free[at : at + 2]))
        assert out.token_ids == _greedy(ref, ids, bad_words_ids=[free[at : at + 2]]) != free
        break
    else:
        pytest.fail("no two generated tokens that tokenize back to themselves")


def test_no_repeat_ngram_size_equals_transformers(tiny_llm, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    changed = 0
    for prompt in PROMPTS:
        ids = tiny_llm.tokenizer.encode(prompt)
        for size in (1, 2, 3):
            out = _generate(tiny_llm, ids, no_repeat_ngram_size=size)
            assert out.token_ids == _greedy(ref, ids, no_repeat_ngram_size=size), (prompt, size)
            changed += out.token_ids != _greedy(ref, ids)
    assert changed, "some n-gram repeats without the ban (the test would show nothing otherwise)"


def test_embedding_bias_is_added_to_the_logits(tiny_llm, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    vocab = ref.model.config.vocab_size
    ids = tiny_llm.tokenizer.encode(PROMPTS[2])
    free = _generate(tiny_llm, ids).token_ids
    favourite = next(t for t in range(5, vocab) if t not in free)
    bias = [0.0] * vocab
    bias[favourite] = 1e4
    assert _generate(tiny_llm, ids, embedding_bias=bias).token_ids == [favourite] * MAX_TOKENS
    # A small bias: transformers with the same bias as a logits processor (SequenceBiasLogitsProcessor).
    bias = [((t * 37) % 11 - 5) * 0.3 for t in range(vocab)]
    out = _generate(tiny_llm, ids, embedding_bias=bias)
    assert out.token_ids == _greedy(
        ref, ids, sequence_bias={(t,): b for t, b in enumerate(bias) if b}
    )
    with pytest.raises(Exception, match="embedding_bias has 3 values"):
        _generate(tiny_llm, ids, embedding_bias=[0.0, 1.0, 2.0])


def test_exclude_input_from_output_false_returns_the_prompt_too(tiny_llm):
    prompt = PROMPTS[1]
    plain = _generate(tiny_llm, prompt, logprobs=0)
    full = _generate(tiny_llm, prompt, exclude_input_from_output=False, logprobs=0)
    prompt_ids = tiny_llm.tokenizer.encode(prompt)
    assert full.token_ids == prompt_ids + plain.token_ids
    assert full.text == tiny_llm.tokenizer.decode(prompt_ids + plain.token_ids)
    assert (
        len(full.logprobs) == len(full.token_ids)
        and full.logprobs[len(prompt_ids) :] == plain.logprobs
    )
    assert full.cumulative_logprob == pytest.approx(plain.cumulative_logprob)
