"""Issue 9, group 5: stop handling as TensorRT-LLM does it.

tensorrt_llm/executor/result.py, GenerationResultBase._handle_sequence: a sequence ended by a
stop word (stop_token_ids are one-token stop words, SamplingParams._get_stop_reasons_and_words)
gets finish_reason 'stop', stop_reason = that token id or string, and the stop word's tokens are
trimmed from token_ids unless include_stop_str_in_output; one ended by the end id (EOS) gets
finish_reason 'stop' and no stop_reason.
"""

from __future__ import annotations

import asyncio

import pytest

from tandem.client import AsyncLLM, SamplingParams
from tandem.testing.cluster import client_kwargs_for

PROMPT = "x y z stops"


@pytest.fixture(scope="module")
def free(tiny_llm):
    return tiny_llm.generate(
        PROMPT, SamplingParams(max_tokens=14, ignore_eos=True), use_tqdm=False
    ).outputs[0]


def _run(tiny_llm, **kwargs):
    return tiny_llm.generate(
        PROMPT, SamplingParams(max_tokens=14, ignore_eos=True, **kwargs), use_tqdm=False
    ).outputs[0]


def test_a_stop_token_is_trimmed_unless_kept(tiny_llm, free):
    stop = free.token_ids[6]
    at = free.token_ids.index(stop)
    out = _run(tiny_llm, stop_token_ids=[stop], logprobs=0)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free.token_ids[:at] and len(out.logprobs) == at
    assert out.text == tiny_llm.tokenizer.decode(free.token_ids[:at])
    kept = _run(tiny_llm, stop_token_ids=[stop], include_stop_str_in_output=True)
    assert kept.token_ids == free.token_ids[: at + 1] and kept.stop_reason == stop


def test_the_end_id_stays_and_sets_no_stop_reason(tiny_llm, free):
    end = free.token_ids[4]
    at = free.token_ids.index(end)
    out = tiny_llm.generate(
        PROMPT, SamplingParams(max_tokens=14, end_id=end), use_tqdm=False
    ).outputs[0]
    assert (out.finish_reason, out.stop_reason) == ("stop", None)
    assert out.token_ids == free.token_ids[: at + 1]


def _token_aligned_stop(tiny_llm, free) -> tuple[int, str]:
    """A middle token whose text is printable and found nowhere before it: its text as a stop string."""
    for i in range(3, len(free.token_ids) - 1):
        piece = tiny_llm.tokenizer.decode([free.token_ids[i]])
        before = tiny_llm.tokenizer.decode(free.token_ids[:i])
        if (
            len(piece.strip()) >= 2
            and piece.isprintable()
            and piece not in before
            and tiny_llm.tokenizer.decode(free.token_ids[: i + 1]) == before + piece
        ):
            return i, piece
    pytest.fail(f"no token-aligned stop string in {free.text!r}")


def test_a_stop_string_takes_its_tokens_out(tiny_llm, free):
    i, stop = _token_aligned_stop(tiny_llm, free)
    out = _run(tiny_llm, stop=[stop], logprobs=0)
    assert (out.finish_reason, out.stop_reason) == ("stop", stop)
    assert out.token_ids == free.token_ids[:i] and len(out.logprobs) == i
    assert out.text == free.text[: free.text.index(stop)]
    kept = _run(tiny_llm, stop=[stop], include_stop_str_in_output=True)
    assert kept.token_ids == free.token_ids[: i + 1] and kept.text.endswith(stop)


def test_streamed_token_diffs_hold_back_what_a_stop_string_may_take(tiny_llm, free):
    i, stop = _token_aligned_stop(tiny_llm, free)

    async def go():
        async with AsyncLLM(tiny_llm.target, **client_kwargs_for(tiny_llm.target)) as aio:
            ids, text = [], ""
            async for out in aio.generate_async(
                PROMPT, SamplingParams(max_tokens=14, ignore_eos=True, stop=[stop]), streaming=True
            ):
                ids += out.outputs[0].token_ids_diff
                text += out.outputs[0].text_diff
            return out.outputs[0], ids, text

    out, ids, text = asyncio.run(go())
    assert ids == out.token_ids == free.token_ids[:i] and text == out.text
