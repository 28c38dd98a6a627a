"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF file, served by real processes
(1 prefill + 1 decode behind the router, and an aggregated worker) against transformers loading
the same file with `gguf_file=`: same tokenizer, same chat template rendering, same greedy tokens."""

from __future__ import annotations

import io
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from tandem.cli.main import generate
from tandem.client import LLM, SamplingParams
from tandem.engine.checkpoints import default_gguf_path, default_model_dir
from tandem.testing.cluster import LocalCluster

MAX_TOKENS = 12
QUESTIONS = [
    "What is the capital of France?",
    "Name three primary colors.",
    "How many legs does a spider have?",
    "Write a haiku about the sea.",
]
TEXTS = [
    "Hello world 12345 ok",
    "<|im_start|>user\nHi<|im_end|>\n",
    "  ünïcödé  日本語 \t\n 🤖 x=1;y  = 2",
    "def f(x):\n    return x**2  # ok",
    "<|endoftext|>tail",
]
CONVERSATIONS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello! How can I help?"},
        {"role": "user", "content": "Tell me a joke."},
    ],
]


class GgufOracle:
    """transformers loading the GGUF file itself: the reference for tokens and templates."""

    def __init__(self, path):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        self.model = AutoModelForCausalLM.from_pretrained(
            path.parent, gguf_file=path.name, dtype=torch.float32
        ).eval()
        # tandem keeps a quantized file's weights in float16 (gguf_convert.checkpoint_dtype) and
        # computes in float32 on the CPU: the oracle's float32 weights rounded once the same way.
        with torch.no_grad():
            for param in self.model.parameters():
                param.copy_(param.half().float())
        self.eos = self.model.generation_config.eos_token_id

    def chat_ids(self, question: str) -> list[int]:
        text = self.tokenizer.apply_chat_template(
            [{"role": "user", "content": question}], tokenize=False, add_generation_prompt=True
        )
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def greedy(self, ids: list[int]) -> list[int]:
        with torch.no_grad():
            out = self.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=self.eos,
            )
        new = out[0, len(ids) :].tolist()
        return new[: new.index(self.eos) + 1] if self.eos in new else new


@pytest.fixture(scope="module")
def served():
    """The cluster starts with no --model (the default is SmolLM2) while transformers loads the file."""
    model_dir = default_model_dir()  # convert once here rather than in three workers at once
    cluster = LocalCluster(roles=["prefill", "decode", "both"], engine_args=["--num-blocks", "64"])
    with ThreadPoolExecutor(1) as pool:
        started = pool.submit(cluster.start, 180.0)
        try:
            oracle = GgufOracle(default_gguf_path())
        finally:
            started.result()
    try:
        with (
            LLM(cluster.address) as llm,
            LLM(cluster.workers[2].address, **cluster.worker_client_kwargs()) as aggregated,
        ):
            yield model_dir, cluster, llm, aggregated, oracle
    finally:
        cluster.stop()


def test_default_model_is_smollm2_and_its_tokenizer_is_transformers(served):
    model_dir, _, llm, _, oracle = served
    assert llm._server_info().model == str(model_dir)
    tok = llm.tokenizer
    for text in TEXTS:
        ids = oracle.tokenizer(text)["input_ids"]
        assert tok.encode(text) == ids, text
        assert tok.decode(ids, skip_special_tokens=False) == oracle.tokenizer.decode(ids), text
        assert tok.decode(ids) == oracle.tokenizer.decode(ids, skip_special_tokens=True), text
    assert tok.convert_ids_to_tokens(ids) == oracle.tokenizer.convert_ids_to_tokens(ids)
    assert tok.vocab_size == oracle.tokenizer.vocab_size == len(tok) == 49152
    # GGUF metadata: bos <|im_start|>, eos and pad <|im_end|>, unk <|endoftext|>. (transformers'
    # GGUF converter swaps bos and eos names in its tokenizer, not in the model's eos id.)
    assert (
        (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id, tok.unk_token_id)
        == (1, 2, 2, 0)
        == (
            oracle.model.config.bos_token_id,
            oracle.eos,
            oracle.model.config.pad_token_id,
            oracle.tokenizer.unk_token_id,
        )
    )
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")


def test_chat_template_renders_as_transformers(served):
    _, _, llm, _, oracle = served
    tok = llm.tokenizer
    for conversation in CONVERSATIONS:
        for add_generation_prompt in (False, True):
            want = oracle.tokenizer.apply_chat_template(
                conversation, tokenize=False, add_generation_prompt=add_generation_prompt
            )
            assert (
                tok.apply_chat_template(conversation, add_generation_prompt=add_generation_prompt)
                == want
            )
            assert (
                tok.apply_chat_template(
                    conversation, tokenize=True, add_generation_prompt=add_generation_prompt
                )
                == oracle.tokenizer(want, add_special_tokens=False)["input_ids"]
            )
    assert tok.apply_chat_template(CONVERSATIONS) == oracle.tokenizer.apply_chat_template(
        CONVERSATIONS, tokenize=False
    )
    partial = [*CONVERSATIONS[0], {"role": "assistant", "content": "The capital"}]
    assert tok.apply_chat_template(
        partial, continue_final_message=True
    ) == oracle.tokenizer.apply_chat_template(partial, tokenize=False, continue_final_message=True)


def test_greedy_chat_answers_equal_transformers_split_and_aggregated(served):
    _, cluster, llm, aggregated, oracle = served
    prompts = [oracle.chat_ids(q) for q in QUESTIONS]
    params = SamplingParams(max_tokens=MAX_TOKENS)
    split = llm.generate(prompts, params, use_tqdm=False)
    local = aggregated.generate(prompts, params, use_tqdm=False)
    for question, ids, a, b in zip(QUESTIONS, prompts, split, local):
        want = oracle.greedy(ids)
        assert a.outputs[0].token_ids == want == b.outputs[0].token_ids, question
        assert a.metrics.served_by == [w.address for w in cluster.workers[:2]]
    assert split[0].outputs[0].text == "The capital of France is Paris."


def test_generate_chat_cli_answers_through_the_template(served):
    _, cluster, _, _, _ = served
    out = io.StringIO()
    generate(
        cluster.address, "What is the capital of France?", max_tokens=MAX_TOKENS, chat=True, out=out
    )
    assert out.getvalue().startswith("The capital of France is Paris.\n[stop: ")


GUIDED_SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "enum": ["yes", "no", "maybe"]},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["answer", "confidence"],
    "additionalProperties": False,
}
GUIDED_QUESTIONS = [
    "Is the sky blue?",
    "Is water wet?",
    "Can pigs fly?",
    "Is Paris in France?",
    "Is ice cold?",
    "Do fish swim?",
    "Is the sun a star?",
    "Can cats bark?",
    "Is 7 a prime number?",
    "Is snow green?",
    "Do birds have feathers?",
    "Is the moon made of cheese?",
    "Is Python a language?",
    "Can humans breathe underwater?",
    "Is fire hot?",
    "Do trees grow?",
    "Is 2 bigger than 3?",
    "Is gold a metal?",
    "Can dogs read?",
    "Is the earth round?",
]


def test_guided_json_schema_is_valid_for_20_prompts(served):
    """Issue 9's acceptance: guided decoding with a JSON schema yields valid JSON on the small chat
    model, as TensorRT-LLM's xgrammar backend (grammar_matcher.py, compile_json_schema) does;
    through the split, the prefill's first token and the decode's rest follow one grammar."""
    import json

    import jsonschema

    from tandem.client import GuidedDecodingParams

    _, _, llm, _, _ = served
    tok = llm.tokenizer
    prompts = [
        tok.apply_chat_template(
            [{"role": "user", "content": f"{q} Answer in JSON."}], add_generation_prompt=True
        )
        for q in GUIDED_QUESTIONS
    ]
    params = SamplingParams(max_tokens=40, guided_decoding=GuidedDecodingParams(json=GUIDED_SCHEMA))
    outs = llm.generate(prompts, params, use_tqdm=False)
    for question, out in zip(GUIDED_QUESTIONS, outs):
        assert out.outputs[0].finish_reason == "stop", (question, out.outputs[0].text)
        jsonschema.validate(json.loads(out.outputs[0].text), GUIDED_SCHEMA)


def test_beam_search_equals_transformers_on_smollm2(served):
    """Issue 9's acceptance on the real model: 4 beams, the same beams and scores as transformers'
    generate(num_beams=4, length_penalty=1.0, early_stopping=True) on the same GGUF checkpoint
    (TensorRT-LLM's early_stopping=1); the router sends beam search to the aggregated worker."""
    _, _, llm, _, oracle = served
    for question in QUESTIONS[:2]:
        ids = oracle.chat_ids(question)
        with torch.no_grad():
            want = oracle.model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                num_beams=4,
                num_return_sequences=4,
                length_penalty=1.0,
                early_stopping=True,
                max_new_tokens=8,
                do_sample=False,
                pad_token_id=oracle.eos,
                output_scores=True,
                return_dict_in_generate=True,
            )
        out = llm.generate(
            ids,
            SamplingParams(
                max_tokens=8,
                use_beam_search=True,
                n=4,
                length_penalty=1.0,
                early_stopping=1,
                logprobs=0,
            ),
            use_tqdm=False,
        )
        for beam, seq, score in zip(out.outputs, want.sequences, want.sequences_scores):
            tokens = seq[len(ids) :].tolist()
            tokens = tokens[: tokens.index(oracle.eos) + 1] if oracle.eos in tokens else tokens
            assert beam.token_ids == tokens, question
            assert beam.cumulative_logprob / len(tokens) == pytest.approx(score.item(), abs=2e-3)
