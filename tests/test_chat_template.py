"""Client-side chat templates render as transformers renders them (its chat_template_utils.py:
sandbox, trim/lstrip blocks, loop controls, tojson, raise_exception, special tokens as variables)."""

from __future__ import annotations

import sys

import pytest

from tandem.client import chat_template
from tandem.client.tokenizer import RemoteTokenizer
from tandem.v1 import llm_pb2

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": 'Hi <there> & "you"'},
    {"role": "assistant", "content": "Hello."},
    {"role": "user", "content": "Bye"},
]
# Features real templates use: whitespace control, loop controls, tojson without HTML escaping,
# namespaces, raise_exception on a bad role, the special tokens as variables.
FEATURES_TEMPLATE = """
{%- set ns = namespace(count=0) %}
{{- bos_token }}
{% for m in messages %}
  {% if m['role'] not in ['system', 'user', 'assistant'] %}{{ raise_exception('bad role ' + m['role']) }}{% endif %}
  {% if m['role'] == 'system' %}{% continue %}{% endif %}
  {% set ns.count = ns.count + 1 %}
  [{{ ns.count }}] {{ m | tojson }}
  {% if loop.index > 3 %}{% break %}{% endif %}
{% endfor %}
{% if tools %}tools: {{ tools | tojson(indent=2) }}{% endif %}
{% if add_generation_prompt %}{{ eos_token }}assistant:{% endif %}
"""


@pytest.fixture(scope="module")
def tokenizers(model_dirs):
    from transformers import AutoTokenizer

    model_dir = model_dirs["llama"]
    files = {
        p.name: p.read_bytes()
        for p in model_dir.iterdir()
        if p.suffix == ".json" and p.name != "config.json"
    }
    ours = RemoteTokenizer(
        llm=None, files=llm_pb2.TokenizerFiles(files=files, bos_token_id=1, eos_token_ids=[2])
    )
    return ours, AutoTokenizer.from_pretrained(model_dir)


@pytest.mark.parametrize("add_generation_prompt", [False, True])
def test_model_template_and_tokens_equal_transformers(tokenizers, add_generation_prompt):
    ours, theirs = tokenizers
    want = theirs.apply_chat_template(
        CONVERSATION, tokenize=False, add_generation_prompt=add_generation_prompt
    )
    assert (
        ours.apply_chat_template(CONVERSATION, add_generation_prompt=add_generation_prompt) == want
    )
    assert want.startswith("<s>system: Be brief.\n")  # bos_token reached the template as a variable
    ids = theirs.apply_chat_template(
        CONVERSATION, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    assert (
        ours.apply_chat_template(
            CONVERSATION, tokenize=True, add_generation_prompt=add_generation_prompt
        )
        == ids
    )
    assert ours.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True) == {
        "input_ids": theirs.apply_chat_template(CONVERSATION, return_dict=False)
    }


def test_template_features_equal_transformers(tokenizers):
    ours, theirs = tokenizers
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"x": "<int>"}}}]
    for kwargs in ({}, {"add_generation_prompt": True, "tools": tools}):
        want = theirs.apply_chat_template(
            CONVERSATION, chat_template=FEATURES_TEMPLATE, tokenize=False, **kwargs
        )
        assert (
            ours.apply_chat_template(CONVERSATION, chat_template=FEATURES_TEMPLATE, **kwargs)
            == want
        )
    assert '"Hi <there> & \\"you\\""' in want  # tojson does not HTML-escape


def test_template_errors_are_clear(tokenizers):
    import jinja2

    ours, _ = tokenizers
    with pytest.raises(jinja2.TemplateError, match="bad role tool"):
        ours.apply_chat_template(
            [{"role": "tool", "content": "x"}], chat_template=FEATURES_TEMPLATE
        )
    with pytest.raises(jinja2.exceptions.SecurityError):
        ours.apply_chat_template(
            CONVERSATION, chat_template="{{ messages.__class__.__mro__[1].__subclasses__() }}"
        )
    with pytest.raises(ValueError, match="empty conversation"):
        ours.apply_chat_template([])
    with pytest.raises(ValueError, match="not compatible"):
        ours.apply_chat_template(
            CONVERSATION, add_generation_prompt=True, continue_final_message=True
        )


def test_missing_jinja2_says_what_to_install(tokenizers, monkeypatch):
    ours, _ = tokenizers
    chat_template.compile_template.cache_clear()
    monkeypatch.setitem(sys.modules, "jinja2", None)
    with pytest.raises(ImportError, match=r"pip install 'tandem-client\[chat\]'"):
        ours.apply_chat_template(CONVERSATION)
    chat_template.compile_template.cache_clear()


def test_tokenizer_attributes_equal_transformers(tokenizers):
    ours, theirs = tokenizers
    ids = theirs("Hello world, the quick brown fox")["input_ids"]
    assert ours.convert_ids_to_tokens(ids) == theirs.convert_ids_to_tokens(ids)
    assert ours.convert_ids_to_tokens(
        ids, skip_special_tokens=True
    ) == theirs.convert_ids_to_tokens(ids, skip_special_tokens=True)
    assert ours.convert_tokens_to_ids(theirs.convert_ids_to_tokens(ids)) == ids
    assert ours.get_vocab() == theirs.get_vocab() and len(ours) == len(theirs)
    assert ours.batch_decode([ids, ids[:3]]) == theirs.batch_decode(
        [ids, ids[:3]], skip_special_tokens=True
    )
    for name in (
        "bos_token",
        "eos_token",
        "pad_token",
        "unk_token",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "unk_token_id",
        "all_special_tokens",
        "all_special_ids",
    ):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_template_file_beside_the_config_wins_as_in_transformers(model_dirs, tmp_path):
    import shutil

    from transformers import AutoTokenizer

    model_dir = shutil.copytree(model_dirs["llama"], tmp_path / "model")
    (model_dir / "chat_template.jinja").write_text(FEATURES_TEMPLATE)
    files = {p.name: p.read_bytes() for p in model_dir.iterdir() if p.name != "model.safetensors"}
    ours = RemoteTokenizer(
        llm=None, files=llm_pb2.TokenizerFiles(files=files, bos_token_id=1, eos_token_ids=[2])
    )
    want = AutoTokenizer.from_pretrained(model_dir).apply_chat_template(
        CONVERSATION, tokenize=False
    )
    assert ours.apply_chat_template(CONVERSATION) == want and want.startswith("<s>\n  [1] {")
