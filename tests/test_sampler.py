"""The batched sampler: its counter-based noise, the distribution it draws from, truncation,
penalties and log-probabilities, each row independent of the batch around it."""

from __future__ import annotations

import collections

import pytest
import torch

from tandem.engine.sampler import Sampler, _truncation_mask, hashed_exponential, row_key
from tandem.engine.sampling_options import SamplingOptions


def draw(sampler, logits, options, token_indices=None, histories=None, outputs=None, blocked=None):
    rows = len(options)
    return sampler.sample(
        logits,
        options,
        token_indices or [0] * rows,
        histories or [[]] * rows,
        outputs or [[]] * rows,
        blocked or [frozenset()] * rows,
    ).to_host()


def fmix32_reference(key: int, vocab_id: int) -> int:
    """murmur3's 32-bit finalizer over key + vocab_id * 0x9E3779B9, in plain Python integers."""
    h = (key + vocab_id * 0x9E3779B9) & 0xFFFFFFFF
    h ^= h >> 16
    h = (h * 0x85EBCA6B) & 0xFFFFFFFF
    h ^= h >> 13
    h = (h * 0xC2B2AE35) & 0xFFFFFFFF
    return h ^ (h >> 16)


def test_hashed_noise_is_the_integer_hash_exactly():
    keys = [
        row_key(seed, index) for seed, index in [(0, 0), (7, 3), (2**63 - 1, 10**6), (12345, 0)]
    ]
    vocab = 1000
    weyl = (torch.arange(vocab, dtype=torch.long) * 0x9E3779B9) & 0xFFFFFFFF
    noise = hashed_exponential(torch.tensor(keys), weyl)
    for row, key in enumerate(keys):
        for vocab_id in (0, 1, 511, 999):
            uniform = ((fmix32_reference(key, vocab_id) >> 8) + 0.5) * 2.0**-24
            assert noise[row, vocab_id].item() == pytest.approx(
                -torch.log(torch.tensor(uniform)).item(), rel=1e-6
            )
    assert all(0 <= k < 2**32 for k in keys) and len(set(keys)) == len(keys)
    assert row_key(7, 3) != row_key(7, 4) != row_key(8, 3)


@pytest.mark.parametrize("seeded", [True, False], ids=["seeded", "unseeded"])
def test_draws_follow_the_distribution(seeded):
    probs = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.05, 0.03, 0.015, 0.005])
    num_draws = 4000
    sampler = Sampler(vocab_size=8, max_rows=num_draws)
    options = [SamplingOptions(temperature=1.0, seed=11 if seeded else None)] * num_draws
    # Seeded: one request, num_draws successive tokens (the token index is the counter).
    drawn = draw(
        sampler, probs.log().expand(num_draws, 8), options, token_indices=list(range(num_draws))
    ).token_ids
    freq = collections.Counter(drawn)
    for token, p in enumerate(probs.tolist()):
        assert abs(freq[token] / num_draws - p) < 0.025, (token, freq[token] / num_draws, p)


def test_seeded_rows_depend_only_on_seed_and_token_index():
    sampler = Sampler(vocab_size=64, max_rows=8)
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(8, 64, generator=gen)
    seeded = SamplingOptions(temperature=1.0, seed=3)
    others = [
        SamplingOptions(temperature=0.8),
        SamplingOptions(),
        SamplingOptions(temperature=1.5, seed=9, top_p=0.9),
    ]

    def first_row(batch_options, index):
        return draw(
            sampler,
            logits[: len(batch_options)],
            batch_options,
            token_indices=[index] * len(batch_options),
        ).token_ids[0]

    alone = [first_row([seeded], i) for i in range(12)]
    assert len(set(alone)) > 3  # the token index moves the noise
    for neighbours in ([], others[:1], others, others * 2):
        assert [first_row([seeded] + neighbours, i) for i in range(12)] == alone


def test_greedy_rows_beside_random_rows_stay_greedy():
    sampler = Sampler(vocab_size=32, max_rows=4)
    logits = torch.randn(4, 32, generator=torch.Generator().manual_seed(1))
    options = [
        SamplingOptions(),
        SamplingOptions(temperature=2.0),
        SamplingOptions(seed=4),
        SamplingOptions(temperature=1.0, seed=5),
    ]
    got = draw(sampler, logits, options).token_ids
    assert got[0] == int(logits[0].argmax()) and got[2] == int(logits[2].argmax())


def test_truncation_keeps_draws_inside_top_k_top_p_min_p():
    probs = torch.tensor([0.3, 0.25, 0.2, 0.12, 0.08, 0.05])
    cases = [
        (SamplingOptions(temperature=1.0, top_k=2, seed=1), {0, 1}),
        (SamplingOptions(temperature=1.0, top_p=0.7, seed=2), {0, 1, 2}),
        (SamplingOptions(temperature=1.0, min_p=0.5, seed=3), {0, 1, 2}),
        (SamplingOptions(temperature=1.0, top_k=4, top_p=0.5, seed=4), {0, 1}),
    ]
    sampler = Sampler(vocab_size=6, max_rows=400)
    for options, allowed in cases:
        got = draw(
            sampler, probs.log().expand(400, 6), [options] * 400, token_indices=list(range(400))
        ).token_ids
        assert set(got) == allowed, (options, set(got))


def test_truncation_mask_keeps_top_k_top_p_min_p():
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.4, 0.3, 0.2, 0.1], [0.7, 0.2, 0.06, 0.04]])
    cut = _truncation_mask(
        probs,
        top_k=torch.tensor([2, 0, 0]),
        top_p=torch.tensor([1.0, 0.65, 1.0]),
        min_p=torch.tensor([0.0, 0.0, 0.1]),
    )
    assert cut.tolist() == [
        [False, False, True, True],
        [False, False, True, True],
        [False, False, True, True],
    ]


def test_min_p_alone_uses_the_max_not_a_sort():
    sampler = Sampler(vocab_size=4, max_rows=300)
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    got = draw(
        sampler,
        probs.log().expand(300, 4),
        [SamplingOptions(temperature=1.0, min_p=0.35, seed=8)] * 300,
        token_indices=list(range(300)),
    ).token_ids
    assert set(got) == {0, 1}


def test_penalties():
    sampler = Sampler(vocab_size=4, max_rows=2)
    logits = torch.tensor([[0.0, 5.0, 4.9, 1.0]])
    assert draw(sampler, logits, [SamplingOptions()], histories=[[1]], outputs=[[1]]).token_ids == [
        1
    ]
    assert draw(
        sampler, logits, [SamplingOptions(repetition_penalty=1.5)], histories=[[1]], outputs=[[1]]
    ).token_ids == [2]
    # presence: once per distinct id; frequency: per occurrence (5 - 2 * 0.06 = 4.88 < 4.9)
    assert draw(
        sampler, logits, [SamplingOptions(presence_penalty=0.2)], outputs=[[1, 1]]
    ).token_ids == [2]
    assert draw(
        sampler, logits, [SamplingOptions(frequency_penalty=0.06)], outputs=[[1, 1]]
    ).token_ids == [2]
    assert draw(
        sampler, logits, [SamplingOptions(frequency_penalty=0.06)], outputs=[[1]]
    ).token_ids == [1]
    # negative logits are multiplied by the repetition penalty, positive ones divided
    neg = torch.tensor([[-1.0, -1.2, -3.0, -5.0]])
    assert draw(
        sampler, neg, [SamplingOptions(repetition_penalty=1.5)], histories=[[0]]
    ).token_ids == [1]


def test_min_tokens_blocking_and_raw_logprobs():
    sampler = Sampler(vocab_size=5, max_rows=2)
    logits = torch.tensor([[3.0, 1.0, 0.5, 0.0, -1.0], [0.0, 0.1, 0.2, 0.3, 2.0]])
    result = draw(
        sampler,
        logits,
        [SamplingOptions(logprobs=3), SamplingOptions(logprobs=0)],
        blocked=[frozenset({0}), frozenset()],
    )
    raw = torch.log_softmax(logits, dim=-1)
    assert result.token_ids == [1, 4]
    # the reported log-probabilities are the raw model's, before blocking
    assert result.logprobs == pytest.approx([raw[0, 1].item(), raw[1, 4].item()], abs=1e-6)
    top = result.top_logprobs[0]
    assert set(top) == {0, 1, 2} and top[0] == pytest.approx(raw[0, 0].item(), abs=1e-6)
    assert result.top_logprobs[1] == {4: pytest.approx(raw[1, 4].item(), abs=1e-6)}


def test_rows_asking_for_more_than_a_draw_get_it_at_their_own_rows_only():
    # The sampler looks again only at the rows whose options want more than a draw: among plain
    # rows, each extra lands at its row and nowhere else.
    sampler = Sampler(vocab_size=6, max_rows=5)
    logits = torch.tensor([[0.0, 3.0, 2.9, 0.0, 0.0, 0.0]] * 5)
    plain = SamplingOptions()
    options = [
        plain,
        SamplingOptions(logprobs=2),
        SamplingOptions(repetition_penalty=2.0),
        plain,
        SamplingOptions(return_generation_logits=True),
    ]
    assert [o.wants_only_draws for o in options] == [True, False, False, True, False]
    result = draw(sampler, logits, options, histories=[[], [], [1], [], []])
    assert result.token_ids == [1, 1, 2, 1, 1]
    assert [t is None for t in result.top_logprobs] == [True, False, True, True, True]
    assert set(result.top_logprobs[1]) == {1, 2} and result.ranks[1] == {1: 1, 2: 2}
    assert [r is None for r in result.ranks] == [True, False, True, True, True]
    assert [r is None for r in result.logits_rows] == [True, True, True, True, False]
    assert torch.equal(result.logits_rows[4], logits[4])


def test_rejects_more_rows_than_it_holds():
    with pytest.raises(ValueError, match="holds 2"):
        draw(Sampler(vocab_size=4, max_rows=2), torch.zeros(3, 4), [SamplingOptions()] * 3)
