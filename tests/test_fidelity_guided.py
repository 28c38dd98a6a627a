"""Issue 9, group 8: guided_decoding with xgrammar, as TensorRT-LLM's PyTorch backend does it
(tensorrt_llm/_torch/pyexecutor/grammar_matcher.py, XGrammarMatcherFactory.create: JSON ->
compile_builtin_json_grammar, JSON_SCHEMA -> compile_json_schema, REGEX -> compile_regex,
EBNF_GRAMMAR -> compile_grammar, STRUCTURAL_TAG -> compile_structural_tag; one guide per request,
sampling_params.py GuidedDecodingParams._validate).

On the tiny random-weight Llama every output follows its guide whatever the weights; the real
model's JSON-schema outputs are checked in test_smollm2.py. Through the router's split the
prefill samples the first token under the guide and the decode carries the grammar on from it.
"""

from __future__ import annotations

import json
import re

import grpc
import jsonschema
import pytest

from tandem.client import GuidedDecodingParams, RequestError, SamplingParams

PROMPTS = ["guide me", "a grammar decides", "structure please"]
SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 9},
    },
    "required": ["answer", "score"],
    "additionalProperties": False,
}


def _texts(tiny_llm, guide: GuidedDecodingParams, max_tokens: int = 32, **kwargs) -> list:
    outs = tiny_llm.generate(
        PROMPTS,
        [SamplingParams(max_tokens=max_tokens, guided_decoding=guide, **kwargs)] * len(PROMPTS),
        use_tqdm=False,
    )
    return [o.outputs[0] for o in outs]


def test_json_schema_and_json_object(tiny_llm):
    # TensorRT-LLM compiles the schema with xgrammar's defaults (any whitespace between tokens):
    # random weights may spend their budget on whitespace, so an output cut by length is only
    # checked to start the object; every one that ended (EOS, once the value closed) is valid.
    # json_object is xgrammar's builtin JSON grammar there: any JSON value.
    for out in _texts(tiny_llm, GuidedDecodingParams(json=SCHEMA), temperature=0.8, seed=1):
        assert out.text.lstrip().startswith("{"), out.text
        if out.finish_reason == "stop":
            jsonschema.validate(json.loads(out.text), SCHEMA)
    ended = [
        out
        for out in _texts(tiny_llm, GuidedDecodingParams(json_object=True), temperature=0.8, seed=1)
        if out.finish_reason == "stop"
    ]
    assert ended, "some JSON value ends within the budget"
    for out in ended:
        json.loads(out.text)


def test_regex_and_ebnf_grammar(tiny_llm):
    for out in _texts(tiny_llm, GuidedDecodingParams(regex=r"(cat|dog)s? [0-9]{2}\.")):
        assert re.fullmatch(r"(cat|dog)s? [0-9]{2}\.", out.text), out.text
    grammar = 'root ::= "(" item (", " item)* ")"\nitem ::= [a-c]+'
    for out in _texts(tiny_llm, GuidedDecodingParams(grammar=grammar), temperature=1.0, seed=2):
        assert re.fullmatch(r"\([a-c]+(, [a-c]+)*\)", out.text) or out.finish_reason == "length", (
            out.text
        )


def test_structural_tag(tiny_llm):
    tag = {
        "type": "structural_tag",
        "format": {
            "type": "tag",
            "begin": "<n>",
            "end": "</n>",
            "content": {"type": "regex", "pattern": "[0-9]{3}"},
        },
    }
    for out in _texts(
        tiny_llm, GuidedDecodingParams(structural_tag=json.dumps(tag)), temperature=0.8, seed=3
    ):
        assert re.fullmatch(r"<n>[0-9]{3}</n>", out.text), out.text


def test_a_guide_that_does_not_compile_is_bad_input(tiny_llm):
    with pytest.raises(RequestError) as err:
        tiny_llm.generate(
            "x",
            SamplingParams(max_tokens=4, guided_decoding=GuidedDecodingParams(regex="(")),
            use_tqdm=False,
        )
    assert (
        err.value.code == grpc.StatusCode.INVALID_ARGUMENT
        and "guided_decoding.regex" in err.value.details
    )
