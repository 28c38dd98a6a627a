"""/v1/embeddings through `tandem serve openai` in front of a cluster serving all-MiniLM-L6-v2
(issue 34), driven by the `openai` package: every input shape OpenAI takes, float and base64,
against the gRPC client's Encode of the same inputs; dimensions and bad input refused."""

from __future__ import annotations

import base64
import struct

import openai
import pytest
from test_encode import minilm_dir
from test_openai import openai_front

from tandem.client import LLM
from tandem.testing.cluster import LocalCluster

TEXTS = ["hello world", "Encoders see every token at once."]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    with (
        LocalCluster(roles=["both"], engine_args=["--model", str(minilm_dir())]) as cluster,
        openai_front(cluster, tmp_path_factory.mktemp("openai-embed") / "front.log") as (base, _),
        LLM(cluster.address) as llm,
    ):
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="-", max_retries=0, timeout=60)
        yield client, client.models.list().data[0].id, llm


def _close(got, expected):
    assert len(got) == len(expected) == 384
    assert max(abs(a - b) for a, b in zip(got, expected)) < 1e-6


def test_texts_and_token_ids_embed_as_encode_does(served):
    client, model, llm = served
    ids = llm.tokenizer.encode("token ids go in as they are")
    expected = llm.encode([*TEXTS, ids])
    out = client.embeddings.create(model=model, input=TEXTS, encoding_format="float")
    assert out.object == "list" and out.model == model
    assert [d.index for d in out.data] == [0, 1] and all(d.object == "embedding" for d in out.data)
    for d, e in zip(out.data, expected):
        _close(d.embedding, e.pooled)
    num_tokens = sum(len(e.prompt_token_ids) for e in expected[:2])
    assert out.usage.prompt_tokens == out.usage.total_tokens == num_tokens
    one = client.embeddings.create(model=model, input=TEXTS[1], encoding_format="float")
    assert len(one.data) == 1
    _close(one.data[0].embedding, expected[1].pooled)
    by_ids = client.embeddings.create(model=model, input=ids, encoding_format="float")
    _close(by_ids.data[0].embedding, expected[2].pooled)
    batch_ids = client.embeddings.create(model=model, input=[ids, ids[:3]], encoding_format="float")
    _close(batch_ids.data[0].embedding, expected[2].pooled)
    _close(batch_ids.data[1].embedding, llm.encode(ids[:3]).pooled)
    assert batch_ids.usage.prompt_tokens == len(ids) + 3


def test_base64_is_little_endian_float32(served):
    client, model, llm = served
    raw = client.with_raw_response.embeddings.create(
        model=model, input=TEXTS, encoding_format="base64"
    ).http_response.json()
    expected = llm.encode(TEXTS)
    for item, e in zip(raw["data"], expected):
        data = base64.b64decode(item["embedding"])
        values = struct.unpack(f"<{len(data) // 4}f", data)
        _close(values, [struct.unpack("<f", struct.pack("<f", v))[0] for v in e.pooled])
    # The SDK asks for base64 by default and decodes it itself.
    _close(
        client.embeddings.create(model=model, input=TEXTS[0]).data[0].embedding, expected[0].pooled
    )


def test_dimensions_and_bad_input_are_refused(served):
    client, model, llm = served
    # The router says the embedding size, so a wrong `dimensions` is refused before any encoding.
    assert llm._server_info().embedding_size == 384
    assert (
        len(client.embeddings.create(model=model, input="x", dimensions=384).data[0].embedding)
        == 384
    )
    cases = [
        ({"input": "x", "dimensions": 128}, "have 384 dimensions"),
        ({"input": []}, "input must not be empty"),
        ({"input": ["fine", ""]}, "input[1] is an empty string"),
        ({"input": [101] + [1000] * 600 + [102]}, "at most 512"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
    ]
    for kwargs, message in cases:
        with pytest.raises(openai.BadRequestError) as err:
            client.embeddings.create(model=model, **kwargs)
        assert message in err.value.body["message"], (kwargs, err.value.body)
    with pytest.raises(openai.NotFoundError) as err:
        client.embeddings.create(model="text-embedding-3-small", input="x")
    assert "The model `text-embedding-3-small` does not exist" in err.value.body["message"]
