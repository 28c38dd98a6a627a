"""The text front: streamed text is byte-identical to transformers' decode of the same ids (for
the default model's byte-level BPE and real BPE tokenizers with multi-byte characters), stop
strings cut text, token ids and cumulative_logprob exactly, whoever produces the ids."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.client import AsyncLLM, SamplingParams
from tandem.testing.cluster import LocalCluster
from tandem.text.detokenizer import IncrementalDetokenizer
from tandem.text.processor import TextOptions, TextProcessor
from tandem.text.tokenizer import Tokenizer
from tandem.v1 import types_pb2

CORPUS = [
    "Grüße aus München! Ça va très bien, naïve café.",
    "日本語のテキストを書きます。東京は大きい。",
    "emoji 😀🎉👍 and ünïcödé ✓",
    "Hello world, the quick brown fox jumps.",
    "Привет, как дела? Всё хорошо.",
    "中文分词测试，你好世界。한국어 문장도 있어요.",
]


def _trained_bpe(kind: str):
    """A real BPE tokenizer learned (deterministically) on multilingual text: its merges cut
    through multi-byte characters, so single tokens are often partial UTF-8."""
    from tokenizers import Tokenizer as HfTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    tok = HfTokenizer(models.BPE())
    if kind == "byte-level":
        tok.pre_tokenizer, tok.decoder = (
            pre_tokenizers.ByteLevel(add_prefix_space=False),
            decoders.ByteLevel(),
        )
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            special_tokens=["<s>", "</s>"],
        )
    else:  # SentencePiece-style, as Llama 2 and Mistral tokenizers are
        tok.pre_tokenizer, tok.decoder = pre_tokenizers.Metaspace(), decoders.Metaspace()
        trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<s>", "</s>"])
    tok.train_from_iterator(CORPUS * 20, trainer)
    return tok


@pytest.fixture(scope="module", params=["default-model", "byte-level", "metaspace"])
def tokenizers_pair(request, model_dirs):
    """(tandem's Tokenizer, transformers' tokenizer) over the same tokenizer.json."""
    from transformers import AutoTokenizer, PreTrainedTokenizerFast

    if request.param == "default-model":
        return Tokenizer.from_dir(model_dirs["llama"]), AutoTokenizer.from_pretrained(
            model_dirs["llama"]
        )
    trained = _trained_bpe(request.param)
    return Tokenizer({"tokenizer.json": trained.to_str().encode()}), PreTrainedTokenizerFast(
        tokenizer_object=trained
    )


def _stream(tokenizer: Tokenizer, ids: list[int], skip_special_tokens: bool = True) -> list[str]:
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens)
    return [detok.add(t, final=i == len(ids) - 1) for i, t in enumerate(ids)]


def test_streamed_text_equals_transformers_decode(tokenizers_pair):
    ours, theirs = tokenizers_pair
    rng = random.Random(2026)
    for trial in range(300):
        natural = trial % 2 == 0
        ids = (
            ours.encode(rng.choice(CORPUS), add_special_tokens=False)
            if natural
            else [rng.randrange(ours.vocab_size) for _ in range(rng.randrange(1, 40))]
        )
        for skip in (True, False):
            deltas = _stream(ours, ids, skip)
            assert "".join(deltas) == theirs.decode(ids, skip_special_tokens=skip), ids
            if natural:  # whole characters only: a partial UTF-8 sequence is held back, never shown as U+FFFD
                assert not any("\ufffd" in d for d in deltas), (ids, deltas)


def _completion(
    index: int,
    tokens: list[int],
    logprobs: list[float],
    finish=types_pb2.FINISH_REASON_UNSPECIFIED,
    cumulative: float = 0.0,
) -> types_pb2.CompletionOutput:
    comp = types_pb2.CompletionOutput(
        index=index, token_ids=tokens, finish_reason=finish, cumulative_logprob=cumulative
    )
    comp.logprobs.extend(
        types_pb2.TokenLogprobs(logprobs={t: lp}) for t, lp in zip(tokens, logprobs)
    )
    return comp


def _run(processor: TextProcessor, messages: list[types_pb2.RequestOutput]) -> tuple[list, list]:
    stopped = []

    async def on_stop(index, handoff):
        stopped.append(index)

    async def collect():
        got = []
        for m in messages:
            out, stops = processor.feed(m)
            for index, handoff in stops:
                await on_stop(index, handoff)
            if out is not None:
                got.append(out)
            if processor.done:
                break
        last = processor.finish()
        return got + ([last] if last is not None else [])

    return asyncio.run(collect()), stopped


def test_a_stop_string_cuts_text_ids_and_cumulative_logprob(model_dirs):
    tokenizer = Tokenizer.from_dir(model_dirs["llama"])
    ids = tokenizer.encode("the cat sat on the mat and then it slept", add_special_tokens=False)
    full = tokenizer.decode(ids)
    stop = "on the"
    cut = next(k for k in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:k]))
    logprobs = [-0.1 * (k + 1) for k in range(len(ids))]
    for include in (False, True):
        processor = TextProcessor(
            tokenizer,
            TextOptions(stop=(stop,), include_stop_str_in_output=include, strip_logprobs=True),
            prompt_text="prompt",
        )
        # Everything in two messages, the stop string completed inside the second.
        half = cut - 1
        first = types_pb2.RequestOutput(
            request_id="r",
            outputs=[_completion(0, ids[:half], logprobs[:half], cumulative=sum(logprobs[:half]))],
        )
        second = types_pb2.RequestOutput(
            request_id="r",
            outputs=[_completion(0, ids[half:], logprobs[half:], cumulative=sum(logprobs))],
        )
        last = types_pb2.RequestOutput(
            request_id="r",
            finished=True,
            metrics=types_pb2.RequestMetrics(e2e_latency_s=1.5),
            outputs=[_completion(0, [], [], types_pb2.FINISH_REASON_CANCELLED)],
        )
        out, stopped = _run(processor, [first, second, last])
        assert stopped == [0]
        assert [m.finished for m in out] == [
            False,
            True,
        ]  # the stop's message waited for the producer's last
        assert out[0].prompt == "prompt" and out[-1].metrics.e2e_latency_s == 1.5
        comp = out[-1].outputs[0]
        # Unless kept, the tokens whose text starts inside the stop string leave token_ids too
        # (TensorRT-LLM trims the stop word's tokens); a token that starts before it stays.
        at = full.index(stop)
        num_kept = (
            cut
            if include
            else 1 + max(k for k in range(cut) if len(tokenizer.decode(ids[:k])) < at)
        )
        assert num_kept < cut or include
        assert list(out[0].outputs[0].token_ids) + list(comp.token_ids) == ids[:num_kept]
        assert comp.cumulative_logprob == pytest.approx(sum(logprobs[:cut]))
        assert comp.finish_reason == types_pb2.FINISH_REASON_STOP and comp.stop_string == stop
        assert (
            not comp.logprobs and not out[0].outputs[0].logprobs
        )  # asked for by the front, not the client
        text = out[0].outputs[0].text + comp.text
        assert text == full[: full.index(stop) + (len(stop) if include else 0)]


@pytest.fixture(scope="module")
def split_cluster(model_dirs):
    with LocalCluster(
        roles=["prefill", "decode"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "128",
            "--block-size",
            "8",
        ],
    ) as c:
        yield c


def test_text_streamed_through_the_split_equals_transformers_decode(split_cluster, model_dirs):
    """The router detokenizes what the prefill and then the decode worker stream: one text."""
    from transformers import AutoTokenizer

    reference = AutoTokenizer.from_pretrained(model_dirs["llama"])

    async def one(aio, i: int):
        params = SamplingParams(max_tokens=40, temperature=1.0, seed=i, ignore_eos=True)
        deltas, ids = [], []
        async for out in aio.generate_async(f"multi-byte {i}", params, streaming=True):
            deltas.append(out.outputs[0].text_diff)
            ids += out.outputs[0].token_ids_diff
        return deltas, ids, out

    async def go():
        aio = await AsyncLLM(split_cluster.address)
        try:
            return await asyncio.gather(*(one(aio, i) for i in range(8)))
        finally:
            aio.close()

    for deltas, ids, out in asyncio.run(go()):
        assert len(ids) == 40 and ids == out.outputs[0].token_ids
        assert (
            "".join(deltas)
            == out.outputs[0].text
            == reference.decode(ids, skip_special_tokens=True)
        )
        assert len(out.metrics.served_by) == 2  # it really was split


def test_a_stop_string_ends_one_of_n_split_sequences(split_cluster):
    """n > 1 over the split runs as n single-sequence splits: the stop ends only its own."""
    import dataclasses

    from test_e2e_api import stop_string_only_in

    from tandem.client import LLM

    with LLM(split_cluster.address) as llm:
        params = SamplingParams(max_tokens=16, n=2, temperature=1.0, seed=9, ignore_eos=True)
        free = llm.generate("split sequences, one stops", params, use_tqdm=False).outputs
        stop = stop_string_only_in(free[1].text, free[0].text)
        out = llm.generate(
            "split sequences, one stops", dataclasses.replace(params, stop=[stop]), use_tqdm=False
        ).outputs
    assert (out[0].token_ids, out[0].text, out[0].finish_reason) == (
        free[0].token_ids,
        free[0].text,
        "length",
    )
    assert (
        out[1].finish_reason == "stop" and out[1].text == free[1].text[: free[1].text.index(stop)]
    )


def test_a_stop_before_another_sequence_shows_up_loses_none_of_it(model_dirs):
    """n=2: sequence 0 stops in the first message, before sequence 1's first token arrived (it was
    admitted a step later); sequence 1's tokens all reach the client."""
    tokenizer = Tokenizer.from_dir(model_dirs["llama"])
    ids = tokenizer.encode("the cat sat on the mat", add_special_tokens=False)
    other = tokenizer.encode("a dog ran far away", add_special_tokens=False)[:4]
    stop = tokenizer.decode(ids[:2])
    assert stop not in tokenizer.decode(other)
    processor = TextProcessor(tokenizer, TextOptions(stop=(stop,)), num_sequences=2)
    first = types_pb2.RequestOutput(request_id="r", outputs=[_completion(0, ids[:3], [-0.1] * 3)])
    later = [
        types_pb2.RequestOutput(request_id="r", outputs=[_completion(1, other[:2], [-0.1] * 2)]),
        types_pb2.RequestOutput(
            request_id="r",
            finished=True,
            outputs=[
                _completion(0, [], [], types_pb2.FINISH_REASON_CANCELLED),
                _completion(1, other[2:], [-0.1] * 2, types_pb2.FINISH_REASON_LENGTH),
            ],
        ),
    ]
    out, stopped = _run(processor, [first] + later)
    assert stopped == [0]
    seq1 = [t for m in out for c in m.outputs if c.index == 1 for t in c.token_ids]
    assert seq1 == other and out[-1].finished
    finish = {c.index: c.finish_reason for m in out for c in m.outputs if c.finish_reason}
    assert finish == {0: types_pb2.FINISH_REASON_STOP, 1: types_pb2.FINISH_REASON_LENGTH}
