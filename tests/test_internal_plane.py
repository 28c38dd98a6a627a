"""The internal plane (issue 27): a worker's Worker RPCs speak internal.proto's engine messages,
never the public AsyncLLM ones; the conversions at the text front are exact; and a worker that
makes several tokens of a request in one step gets them to the client whole (a test-only
multi-token step: TANDEM_TEST_TOKENS_PER_STEP), through the split, text and logprobs right."""

from __future__ import annotations

import asyncio
import random

import pytest

from tandem.common.engine_messages import (
    OutputBuilder,
    engine_outputs,
    engine_request,
    generate_request,
)
from tandem.v1 import internal_pb2, llm_pb2, types_pb2, worker_pb2

# The public AsyncLLM messages: what a client sends and gets.
PUBLIC = {
    f"tandem.v1.{name}"
    for name in ("RequestOutput", "CompletionOutput", "DisaggregatedParams", "Prompt")
} | {f"tandem.v1.{name}" for name in llm_pb2.DESCRIPTOR.message_types_by_name}


def _reachable(message, seen: set[str]) -> set[str]:
    """message's full name and every message type its fields reach."""
    if message.full_name in seen:
        return seen
    seen.add(message.full_name)
    for field in message.fields:
        if field.message_type is not None:
            _reachable(field.message_type, seen)
    return seen


def test_no_worker_rpc_takes_or_returns_a_public_message():
    service = worker_pb2.DESCRIPTOR.services_by_name["Worker"]
    for method in service.methods:
        reached: set[str] = set()
        _reachable(method.input_type, reached)
        _reachable(method.output_type, reached)
        assert not reached & PUBLIC, (method.name, sorted(reached & PUBLIC))
    # The session's own messages are the engine's.
    session = service.methods_by_name["Session"]
    assert session.output_type.full_name == "tandem.v1.EngineOutputs"
    submit = session.input_type.fields_by_name["submits"].message_type
    assert submit.fields_by_name["request"].message_type.full_name == "tandem.v1.EngineRequest"


def test_kv_params_has_the_fields_of_disaggregated_params():
    """kv_params() converts by re-parsing the bytes: the two must agree field by field."""

    def shape(descriptor):
        return {
            (
                f.name,
                f.number,
                f.type,
                f.is_repeated,
                f.has_presence,
                getattr(f.message_type, "full_name", None),
            )
            for f in descriptor.fields
        }

    assert shape(internal_pb2.KvParams.DESCRIPTOR) == shape(
        types_pb2.DisaggregatedParams.DESCRIPTOR
    )


def _random_request(rng: random.Random) -> llm_pb2.GenerateRequest:
    request = llm_pb2.GenerateRequest(request_id=f"r{rng.randrange(1000)}", streaming=True)
    request.prompt.token_ids.ids[:] = [rng.randrange(1, 30000) for _ in range(rng.randrange(1, 40))]
    params = request.sampling_params
    params.max_tokens = rng.randrange(1, 100)
    if rng.random() < 0.5:
        params.temperature = rng.random()
        params.seed = rng.randrange(1 << 40)
    if rng.random() < 0.5:
        params.logprobs = rng.randrange(0, 5)
    if rng.random() < 0.5:
        request.priority = rng.random()
    if rng.random() < 0.5:
        request.cache_salt = "salt"
    if rng.random() < 0.5:
        request.lora_request.lora_name = "adapter"
        request.lora_request.lora_int_id = 3
    if rng.random() < 0.5:
        request.trace_headers["traceparent"] = "00-abc"
    if rng.random() < 0.5:
        d = request.disaggregated_params
        d.request_type = rng.choice(
            [types_pb2.REQUEST_TYPE_CONTEXT_ONLY, types_pb2.REQUEST_TYPE_GENERATION_ONLY]
        )
        d.first_gen_tokens[:] = [rng.randrange(100)]
        d.ctx_request_id = rng.randrange(1 << 60)
        d.opaque_state = rng.randbytes(30)
        d.disagg_request_id = rng.randrange(1 << 60)
        d.finish_in_context = rng.random() < 0.5
        d.first_gen_log_probs.add().logprobs[5] = -0.25
    return request


@pytest.mark.parametrize("seed", range(20))
def test_a_token_id_request_crosses_the_session_unchanged(seed):
    request = _random_request(random.Random(seed))
    engine = engine_request(request)
    assert list(engine.prompt_token_ids) == list(request.prompt.token_ids.ids)
    assert generate_request(internal_pb2.EngineRequest.FromString(engine.SerializeToString())) == (
        request
    )


def test_a_text_prompt_is_refused_on_the_internal_plane():
    request = llm_pb2.GenerateRequest(prompt=types_pb2.Prompt(text="hello"))
    with pytest.raises(ValueError, match="tokenized prompt"):
        engine_request(request)


def _random_output(rng: random.Random, first: bool, last: bool) -> types_pb2.RequestOutput:
    msg = types_pb2.RequestOutput(request_id="r", finished=last)
    num_sequences = rng.choice([0, 1, 1, 3])
    for index in range(num_sequences):
        comp = msg.outputs.add(index=index)
        tokens = [rng.randrange(30000) for _ in range(rng.randrange(0, 4))]
        comp.token_ids[:] = tokens
        comp.cumulative_logprob = -rng.random() * 10
        if rng.random() < 0.5:
            for token in tokens:
                comp.logprobs.add().logprobs[token] = -rng.random()
        if last:
            comp.finish_reason = rng.choice(
                [types_pb2.FINISH_REASON_STOP, types_pb2.FINISH_REASON_LENGTH]
            )
            if rng.random() < 0.5:
                comp.stop_token_id = rng.randrange(100)
        if rng.random() < 0.3:
            comp.generation_logits.add(values=[rng.random() for _ in range(3)])
        if rng.random() < 0.3:
            comp.perf_metrics.iter = rng.randrange(100)
    if first:
        msg.prompt_token_ids[:] = [rng.randrange(30000) for _ in range(5)]
        if rng.random() < 0.5:
            msg.prompt_logprobs.add().logprobs[1] = -1.5
        if rng.random() < 0.3:
            msg.context_logits.add(values=[0.5, 0.25])
        if num_sequences and rng.random() < 0.5:
            handoff = msg.outputs[0].disaggregated_params
            handoff.ctx_request_id = 9
            handoff.opaque_state = b"handoff"
            handoff.first_gen_tokens[:] = list(msg.outputs[0].token_ids)[:1]
            msg.disaggregated_params.CopyFrom(handoff)
    if last:
        msg.metrics.time_to_first_token_s = rng.random()
        msg.metrics.kv_transfer_bytes = rng.randrange(1 << 30)
    return msg


@pytest.mark.parametrize("seed", range(30))
def test_a_workers_message_is_rebuilt_from_its_entries(seed):
    rng = random.Random(seed)
    first, last = rng.random() < 0.5, rng.random() < 0.5
    msg = _random_output(rng, first, last)
    entries = engine_outputs(7, msg)
    assert all(e.tag == 7 for e in entries)
    builder = OutputBuilder("r")
    for entry in entries:
        builder.add(internal_pb2.EngineOutput.FromString(entry.SerializeToString()))
    assert builder.build() == msg


def test_entries_of_several_sequences_out_of_order_build_one_ordered_message():
    builder = OutputBuilder("r")
    for index, tokens in ((2, [5]), (0, [6]), (1, [7]), (0, [8, 9])):
        builder.add(internal_pb2.EngineOutput(tag=1, index=index, new_token_ids=tokens))
    msg = builder.build()
    assert [(o.index, list(o.token_ids)) for o in msg.outputs] == [
        (0, [6, 8, 9]),
        (1, [7]),
        (2, [5]),
    ]


# -- several tokens a step, end to end --

TOKENS_PER_STEP = 3
MAX_TOKENS = 20


@pytest.fixture(scope="module")
def cluster(model_dirs):
    """Router + prefill + decode + an aggregated worker, each engine running three steps as one."""
    from tandem.testing.cluster import LocalCluster

    with LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            "64",
            "--block-size",
            "8",
        ],
        env={"TANDEM_TEST_TOKENS_PER_STEP": str(TOKENS_PER_STEP)},
    ) as c:
        yield c


def _streamed(address: str, prompt, params):
    """(the last output, the number of new tokens of each streamed message)."""
    from tandem.client import AsyncLLM
    from tandem.testing.cluster import client_kwargs_for

    async def run():
        async with AsyncLLM(address, **client_kwargs_for(address)) as llm:
            sizes, last = [], None
            async for out in llm.generate_async(prompt, params, streaming=True):
                sizes.append(len(out.outputs[0].token_ids_diff))
                last = out
            return last, sizes

    return asyncio.run(run())


@pytest.mark.parametrize("which", ["split", "aggregated"])
def test_several_tokens_a_step_reach_the_client_whole(cluster, model_dirs, oracle, which):
    from tandem.client import SamplingParams

    ref = oracle(model_dirs["llama"])
    address = cluster.address if which == "split" else cluster.workers[2].address
    prompt = ref.tokenizer.encode("several tokens a step")
    params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=1)
    out, sizes = _streamed(address, prompt, params)
    seq = out.outputs[0]
    assert seq.token_ids == ref.greedy(prompt, MAX_TOKENS)
    assert seq.text == ref.tokenizer.decode(seq.token_ids, skip_special_tokens=True)
    # Past the first token the engine's steps make three tokens each, and they reach the client
    # whole: a message holds one step's tokens, or several steps' where the client's reads lagged
    # or the split's decode held its first steps until its lease was confirmed; so there are no
    # more messages than steps (a token a message would make 20), and steps of three show.
    num_steps = 2 + -(-(MAX_TOKENS - 2) // TOKENS_PER_STEP)  # the first token's, a short one
    assert sum(sizes) == MAX_TOKENS and len(sizes) <= num_steps, sizes
    assert max(sizes) >= TOKENS_PER_STEP, sizes
    with ref.torch.no_grad():
        logits = ref.model(ref.torch.tensor([prompt + seq.token_ids[:-1]])).logits[0]
    expected = ref.torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 :]
    assert len(seq.logprobs) == MAX_TOKENS
    for position, (token, entry) in enumerate(zip(seq.token_ids, seq.logprobs)):
        assert entry[token].logprob == pytest.approx(expected[position, token].item(), abs=1e-3)
    assert seq.cumulative_logprob == pytest.approx(
        sum(e[t].logprob for t, e in zip(seq.token_ids, seq.logprobs)), abs=1e-4
    )


def test_a_stop_string_inside_a_multi_token_step_cuts_the_text_there(cluster, model_dirs, oracle):
    from tandem.client import LLM, SamplingParams

    ref = oracle(model_dirs["llama"])
    prompt = ref.tokenizer.encode("a stop string inside a step")
    tokens = ref.greedy(prompt, MAX_TOKENS)
    full = ref.tokenizer.decode(tokens, skip_special_tokens=True)
    # A stop string that ends inside the text of the tokens of one step (tokens 7-8).
    stop = ref.tokenizer.decode(tokens[7:9], skip_special_tokens=True).strip()
    assert stop and stop in full
    with LLM(cluster.address) as llm:
        out = llm.generate(
            prompt,
            SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True, stop=[stop]),
            use_tqdm=False,
        ).outputs[0]
    assert out.text == full[: full.index(stop)]
    assert out.finish_reason == "stop" and out.stop_reason == stop
