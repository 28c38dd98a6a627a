"""The greedy draw's Triton kernels (kernels/greedy_triton.py) against the torch reference
(kernels/greedy.py) on the CPU through TRITON_INTERPRET: random logits of several shapes, ties
inside a chunk and across chunks, -inf lanes; and the sampler's choice of path.
test_gpu_engine.py runs them on a GPU at the 8B vocabulary; bench/sampler.py times them."""

from __future__ import annotations

import importlib
import os
import sys

os.environ["TRITON_INTERPRET"] = "1"  # read when kernels are decorated: before their import

import pytest  # noqa: E402
import torch  # noqa: E402

from tandem.engine.sampler import Sampler  # noqa: E402
from tandem.engine.sampling_options import SamplingOptions  # noqa: E402
from tandem.kernels import greedy as reference  # noqa: E402

if "tandem.kernels.greedy_triton" in sys.modules:  # decorated earlier without the interpreter
    importlib.reload(sys.modules["tandem.kernels.greedy_triton"])
from tandem.kernels import greedy_triton  # noqa: E402


def _check(logits: torch.Tensor, chunk: int) -> None:
    ids, logprobs, lse = greedy_triton.greedy_draw(logits, chunk=chunk)
    want_ids, want_logprobs, want_lse = reference.greedy_draw(logits)
    assert ids.dtype == torch.int64 and ids.tolist() == want_ids.tolist()
    torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)


# (rows, vocab, chunk): one chunk, a ragged last chunk, a vocabulary smaller than a chunk, SmolLM2's
@pytest.mark.parametrize(
    "rows, vocab, chunk",
    [(1, 256, 256), (3, 1000, 128), (5, 77, 64), (2, 49152, 2048), (17, 3000, 512)],
)
def test_greedy_draw_matches_torch(rows, vocab, chunk):
    gen = torch.Generator().manual_seed(rows * vocab + chunk)
    _check(torch.randn(rows, vocab, generator=gen) * 4, chunk)


@pytest.mark.parametrize("impl", ["triton", "reference"])
def test_greedy_draw_writes_into_given_tensors(impl):
    """out= (a decode graph's buffers, allocated outside its pool): the draws land in those rows
    and nowhere else; a wrong shape or dtype is refused before a launch."""
    draw = greedy_triton.greedy_draw if impl == "triton" else reference.greedy_draw
    logits = torch.randn(3, 700, generator=torch.Generator().manual_seed(9)) * 3
    ids, logprobs, lse = torch.full((5,), -7), torch.full((5,), 9.0), torch.full((5,), 9.0)
    out = (ids[:3], logprobs[:3], lse[:3])
    got = draw(logits, out=out)
    assert all(g is o for g, o in zip(got, out))
    want = reference.greedy_draw(logits)
    assert ids[:3].tolist() == want[0].tolist() and ids[3:].tolist() == [-7, -7]
    torch.testing.assert_close(logprobs[:3], want[1], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(lse[:3], want[2], atol=1e-5, rtol=1e-5)
    assert logprobs[3:].tolist() == [9.0, 9.0] and lse[3:].tolist() == [9.0, 9.0]
    if impl == "triton":
        with pytest.raises(ValueError, match="out must be three contiguous"):
            greedy_triton.greedy_draw(logits, out=(ids[:2], logprobs[:2], lse[:2]))
        with pytest.raises(ValueError, match="out must be three contiguous"):
            greedy_triton.greedy_draw(logits, out=(ids[:3].int(), logprobs[:3], lse[:3]))


def test_ties_go_to_the_first_index_inside_a_chunk_and_across_chunks():
    logits = torch.randn(4, 1000, generator=torch.Generator().manual_seed(1))
    logits[0, [7, 3, 900]] = 50.0  # chunk 0 twice, chunk 7 once: 3 wins
    logits[1, [640, 130, 999]] = 50.0  # chunks 5, 1, 7: 130 wins
    logits[2, :] = 2.5  # all equal: 0
    logits[3, [999, 998]] = 50.0  # the ragged last chunk only: 998
    _check(logits, 128)
    assert greedy_triton.greedy_draw(logits, chunk=128)[0].tolist() == [3, 130, 0, 998]


@pytest.mark.filterwarnings(
    "ignore::RuntimeWarning"
)  # numpy's -inf - -inf in the interpreter: masked out
def test_minus_infinity_lanes_and_rows():
    logits = torch.randn(3, 600, generator=torch.Generator().manual_seed(2))
    logits[0, :512] = float("-inf")  # whole chunks of -inf: the max is in the last one
    logits[1, 1::2] = float("-inf")
    _check(logits[:2], 128)
    logits[2, :] = float("-inf")  # nothing drawable: id 0, as torch.argmax; lse -inf
    ids, logprobs, lse = greedy_triton.greedy_draw(logits, chunk=128)
    assert ids[2].item() == 0 and lse[2].item() == float("-inf")


def test_a_strided_row_view_is_read_by_its_row_stride():
    wide = torch.randn(4, 1200, generator=torch.Generator().manual_seed(3))
    _check(wide[:, 100:1100], 256)  # rows 1200 apart, 1000 wide


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: greedy_triton.greedy_draw(torch.zeros(2, 8, dtype=torch.bfloat16)), "float32"),
        (lambda: greedy_triton.greedy_draw(torch.zeros(8)), r"\[R, V\]"),
        (lambda: greedy_triton.greedy_draw(torch.zeros(8, 2).t()), "contiguous"),
        (lambda: greedy_triton.greedy_draw(torch.zeros(2, 0)), "1 <= V"),
        (lambda: greedy_triton.greedy_draw(torch.zeros(1, 70000), chunk=1), "65535 chunks"),
        (lambda: greedy_triton.greedy_draw(torch.zeros(2, 8), chunk=100), "power of two"),
    ],
)
def test_bad_inputs_are_value_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()


def test_the_sampler_draws_with_the_kernel_only_when_nothing_changed_the_logits(monkeypatch):
    """Plain rows (greedy or random) go through one greedy_draw; a penalty, a banned id or a guide
    changes the logits first and keeps torch's argmax over them, with the raw model's logprobs,
    whose log-sum-exp the kernel still computes (one program a row: --deterministic on a GPU)."""
    monkeypatch.setenv("TANDEM_ATTENTION_BACKEND", "triton")
    calls = []
    monkeypatch.setattr(
        greedy_triton,
        "greedy_draw",
        lambda x, out=None: calls.append(x.shape) or reference.greedy_draw(x, out),
    )
    vocab = 64
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4))
    sampler = Sampler(vocab, max_rows=4)
    plain = [
        SamplingOptions(max_tokens=4),
        SamplingOptions(max_tokens=4, temperature=0.7, seed=5),
        SamplingOptions(max_tokens=4),
    ]
    result = sampler.sample(logits, plain, [0] * 3, [[]] * 3, [[]] * 3, [frozenset()] * 3).to_host()
    assert calls == [(3, vocab)]
    want_ids, want_logprobs, _ = reference.greedy_draw(logits)
    assert [result.token_ids[0], result.token_ids[2]] == [want_ids[0].item(), want_ids[2].item()]
    assert result.logprobs[0] == pytest.approx(want_logprobs[0].item(), abs=1e-5)
    log_probs = torch.log_softmax(logits, dim=-1)
    assert result.logprobs[1] == pytest.approx(log_probs[1, result.token_ids[1]].item(), abs=1e-5)
    top = want_ids[0].item()
    banned = [frozenset({top}), frozenset(), frozenset()]
    result = sampler.sample(
        logits, [SamplingOptions(max_tokens=4)] * 3, [0] * 3, [[]] * 3, [[]] * 3, banned
    ).to_host()
    assert calls == [(3, vocab)] * 2  # the banned id changed the logits: torch's argmax
    assert (
        result.token_ids[0]
        == logits[0].clone().index_fill_(0, torch.tensor([top]), float("-inf")).argmax().item()
    )
    assert result.logprobs[0] == pytest.approx(log_probs[0, result.token_ids[0]].item(), abs=1e-5)
    penalized = [SamplingOptions(max_tokens=4, repetition_penalty=1.5)] + [
        SamplingOptions(max_tokens=4)
    ] * 2
    sampler.sample(
        logits, penalized, [0] * 3, [[top], [], []], [[top], [], []], [frozenset()] * 3
    ).to_host()
    allowed = torch.full(
        (3, (vocab + 31) // 32), -1, dtype=torch.int32
    )  # a guide that allows every id
    sampler.sample(
        logits,
        [SamplingOptions(max_tokens=4)] * 3,
        [0] * 3,
        [[]] * 3,
        [[]] * 3,
        [frozenset()] * 3,
        allowed,
    ).to_host()
    assert calls == [(3, vocab)] * 4  # a penalty and a guide keep torch's argmax too
