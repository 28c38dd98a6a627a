"""Issue 9, group 8: every field of TensorRT-LLM's SamplingParams exists with TensorRT-LLM's
default, travels in the proto, and the server refuses (UNIMPLEMENTED, naming the field) each
one it does not implement yet when it is set, while the defaults keep working."""

from __future__ import annotations

import dataclasses

import grpc
import pytest

from tandem.client import LLM, GuidedDecodingParams, SamplingParams, UnsupportedRequestError
from tandem.testing.cluster import LocalCluster
from tandem.v1 import types_pb2

# The public fields of tensorrt_llm.SamplingParams and their defaults, as declared in
# tensorrt_llm/sampling_params.py (class SamplingParams).
TENSORRT_LLM_FIELDS = {
    "end_id": None,
    "pad_id": None,
    "max_tokens": 32,
    "bad": None,
    "bad_token_ids": None,
    "stop": None,
    "stop_token_ids": None,
    "include_stop_str_in_output": False,
    "embedding_bias": None,
    "logits_processor": None,
    "apply_batched_logits_processor": False,
    "n": 1,
    "best_of": None,
    "use_beam_search": False,
    "top_k": None,
    "top_p": None,
    "top_p_min": None,
    "top_p_reset_ids": None,
    "top_p_decay": None,
    "seed": None,
    "temperature": None,
    "min_tokens": None,
    "beam_search_diversity_rate": None,
    "repetition_penalty": None,
    "presence_penalty": None,
    "frequency_penalty": None,
    "length_penalty": None,
    "early_stopping": None,
    "no_repeat_ngram_size": None,
    "min_p": None,
    "beam_width_array": None,
    "logprobs": None,
    "prompt_logprobs": None,
    "return_context_logits": False,
    "return_generation_logits": False,
    "exclude_input_from_output": True,
    "return_encoder_output": False,
    "return_perf_metrics": False,
    "additional_model_outputs": None,
    "lookahead_config": None,
    "guided_decoding": None,
    "ignore_eos": False,
    "detokenize": True,
    "add_special_tokens": True,
    "truncate_prompt_tokens": None,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
}
# Python objects that cannot reach a server: refused when the params are built.
LOCAL_ONLY = {"logits_processor", "apply_batched_logits_processor"}


class LookaheadDecodingConfig:
    """Stands for tensorrt_llm.bindings.executor.LookaheadDecodingConfig: the same three attributes."""

    max_window_size, max_ngram_size, max_verification_set_size = 4, 3, 2


# One non-default value per field the server implements (test_fidelity_sampling_features.py).
IMPLEMENTED = {
    "bad": ["never"],
    "bad_token_ids": [5],
    "embedding_bias": [0.0] * 8,
    "no_repeat_ngram_size": 3,
    "exclude_input_from_output": False,
    "guided_decoding": GuidedDecodingParams(json={"type": "object"}),
    "use_beam_search": True,
    "length_penalty": 1.2,
    "early_stopping": 1,
    "return_context_logits": True,
    "return_generation_logits": True,
    "return_perf_metrics": True,
}
# One non-default value per field the server does not implement yet.
UNIMPLEMENTED = {
    "top_p_min": 0.1,
    "top_p_reset_ids": 3,
    "top_p_decay": 0.9,
    "beam_search_diversity_rate": 0.5,
    "beam_width_array": [2, 2],
    "return_encoder_output": True,
    "additional_model_outputs": ["hidden_states"],
    "lookahead_config": LookaheadDecodingConfig(),
}


@pytest.fixture(scope="module")
def llm(model_dirs):
    with (
        LocalCluster(
            roles=["both"], engine_args=["--model", str(model_dirs["llama"]), "--num-blocks", "32"]
        ) as c,
        LLM(c.address) as client,
    ):
        yield client


def test_every_field_with_tensorrt_llms_default():
    defaults = {f.name: f.default for f in dataclasses.fields(SamplingParams)}
    missing = set(TENSORRT_LLM_FIELDS) - set(defaults)
    assert not missing, f"fields TensorRT-LLM has and tandem lacks: {sorted(missing)}"
    assert {name: defaults[name] for name in TENSORRT_LLM_FIELDS} == TENSORRT_LLM_FIELDS
    SamplingParams(**TENSORRT_LLM_FIELDS)  # every field spelled out at its default: no TypeError


def test_every_field_but_callables_travels_in_the_proto():
    proto_fields = set(types_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert set(TENSORRT_LLM_FIELDS) - LOCAL_ONLY <= proto_fields
    assert set(UNIMPLEMENTED) | set(IMPLEMENTED) | LOCAL_ONLY | {"prompt_logprobs"} <= set(
        TENSORRT_LLM_FIELDS
    )
    msg = SamplingParams(**{**UNIMPLEMENTED, **IMPLEMENTED, "n": 2, "best_of": 2}).to_proto()
    assert (
        list(msg.bad) == ["never"] and list(msg.embedding_bias) == [0.0] * 8 and msg.use_beam_search
    )
    assert (
        msg.lookahead_config.max_window_size,
        msg.lookahead_config.max_ngram_size,
        msg.lookahead_config.max_verification_set_size,
    ) == (4, 3, 2)
    assert msg.guided_decoding.json_schema == '{"type": "object"}'
    assert msg.HasField("exclude_input_from_output") and not msg.exclude_input_from_output


@pytest.mark.parametrize("name", LOCAL_ONLY)
def test_callables_are_refused_when_the_request_is_sent(name):
    # Built as a TensorRT-LLM script builds them (its LogitsProcessor subclassed), refused at use.
    from tandem.client import BatchedLogitsProcessor, LogitsProcessor

    class Nothing(LogitsProcessor):
        def __call__(self, req_id, logits, token_ids, stream_ptr, client_id):
            pass

    class NothingBatched(BatchedLogitsProcessor):
        def __call__(self, req_ids, logits, token_ids, stream_ptr, client_ids):
            pass

    NothingBatched()
    with pytest.raises(TypeError):  # abstract, as TensorRT-LLM's
        LogitsProcessor()
    params = SamplingParams(**{name: Nothing() if name == "logits_processor" else True})
    with pytest.raises(NotImplementedError, match=name):
        params.to_proto()


@pytest.mark.parametrize("name", sorted(UNIMPLEMENTED))
def test_the_server_refuses_each_unimplemented_field_by_name(llm, name):
    params = SamplingParams(max_tokens=4, temperature=0.7, **{name: UNIMPLEMENTED[name]})
    with pytest.raises(UnsupportedRequestError) as err:
        llm.generate("refused", params, use_tqdm=False)
    assert err.value.code == grpc.StatusCode.UNIMPLEMENTED
    assert f"SamplingParams.{name}" in err.value.details


def test_the_defaults_spelled_out_keep_working(llm):
    at_defaults = {k: v for k, v in TENSORRT_LLM_FIELDS.items() if k not in ("max_tokens",)}
    out = llm.generate(
        "defaults",
        SamplingParams(**{**at_defaults, "max_tokens": 5, "ignore_eos": True}),
        use_tqdm=False,
    )
    plain = llm.generate("defaults", SamplingParams(max_tokens=5, ignore_eos=True), use_tqdm=False)
    assert (
        out.outputs[0].token_ids == plain.outputs[0].token_ids
        and len(plain.outputs[0].token_ids) == 5
    )
    # Implemented fields still act: a stop token ends the output, a seed reproduces samples.
    stop_at = plain.outputs[0].token_ids[2]
    stopped = llm.generate(
        "defaults",
        SamplingParams(max_tokens=5, ignore_eos=True, stop_token_ids=[stop_at]),
        use_tqdm=False,
    ).outputs[0]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    assert (
        stopped.token_ids == plain.outputs[0].token_ids[: plain.outputs[0].token_ids.index(stop_at)]
    )
    seeded = [
        llm.generate(
            "seeded",
            SamplingParams(max_tokens=8, temperature=1.0, top_k=20, seed=11, ignore_eos=True),
            use_tqdm=False,
        )
        .outputs[0]
        .token_ids
        for _ in range(2)
    ]
    assert seeded[0] == seeded[1]
