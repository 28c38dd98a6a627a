"""Issue 9, group 8: return_context_logits and return_generation_logits. TensorRT-LLM
(tensorrt_llm/executor/result.py): RequestOutput.context_logits holds the logits of the prompt
positions and CompletionOutput.generation_logits those each generated token was drawn from
(response_tensors.generation_logits[..., :length]); tandem sends them as packed float rows and
the client makes a numpy array of them (TensorRT-LLM: a torch tensor; the client imports no
torch). transformers is the oracle.
"""

from __future__ import annotations

import numpy
import pytest

from tandem.client import SamplingParams


def test_context_and_generation_logits_are_the_models(tiny_llm, model_dirs, oracle):
    ref = oracle(model_dirs["llama"])
    torch = ref.torch
    prompt = tiny_llm.tokenizer.encode("logits of every position, please")
    params = SamplingParams(
        max_tokens=6,
        ignore_eos=True,
        temperature=0.9,
        seed=4,
        return_context_logits=True,
        return_generation_logits=True,
    )
    for _ in range(2):  # the second time its blocks are cached: the prompt is computed all the same
        out = tiny_llm.generate(prompt, params, use_tqdm=False)
        tokens = out.outputs[0].token_ids
        with torch.no_grad():
            want = ref.model(torch.tensor([prompt + tokens[:-1]])).logits[0].float()
        assert (
            isinstance(out.context_logits, numpy.ndarray)
            and out.context_logits.dtype == numpy.float32
        )
        assert out.context_logits.shape == (len(prompt), ref.model.config.vocab_size)
        torch.testing.assert_close(
            torch.from_numpy(out.context_logits), want[: len(prompt)], atol=1e-3, rtol=1e-3
        )
        generated = out.outputs[0].generation_logits
        assert generated.shape == (len(tokens), ref.model.config.vocab_size)
        torch.testing.assert_close(
            torch.from_numpy(generated), want[len(prompt) - 1 :], atol=1e-3, rtol=1e-3
        )
    plain = tiny_llm.generate(
        prompt,
        SamplingParams(max_tokens=6, ignore_eos=True, temperature=0.9, seed=4),
        use_tqdm=False,
    )
    assert plain.context_logits is None and plain.outputs[0].generation_logits is None
    assert plain.outputs[0].token_ids == tokens


def test_streamed_generation_logits_add_up(tiny_cluster):
    import asyncio

    from tandem.client import AsyncLLM

    async def go():
        async with AsyncLLM(tiny_cluster.address) as aio:
            rows = 0
            async for out in aio.generate_async(
                "stream the logits",
                SamplingParams(max_tokens=5, ignore_eos=True, return_generation_logits=True),
                streaming=True,
            ):
                rows = len(out.outputs[0].generation_logits)
            return out, rows

    out, rows = asyncio.run(go())
    assert rows == len(out.outputs[0].token_ids) == 5
    assert (
        out.outputs[0].generation_logits.argmax(axis=-1).tolist() == out.outputs[0].token_ids
    )  # greedy


@pytest.mark.parametrize("name", ["return_context_logits", "return_generation_logits"])
def test_logits_travel_as_packed_floats(name):
    from tandem.v1 import types_pb2

    assert types_pb2.LogitsRow.DESCRIPTOR.fields_by_name["values"].is_packed
    assert SamplingParams(**{name: True}).to_proto().HasField(name)
