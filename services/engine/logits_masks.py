"""Token ids a sequence may not draw next: min_tokens, bad words, no repeated n-grams.

Computed on the host per row and step (the sampler sets them to -inf). Bad words follow
TensorRT-LLM's SamplingParams._get_bad_words (bad_token_ids are one-token words; a longer word
bans its last token when the sequence ends with the rest of it), as transformers'
NoBadWordsLogitsProcessor does; no_repeat_ngram_size bans every token that would complete an
n-gram already in the sequence, prompt included (transformers' NoRepeatNGramLogitsProcessor).
"""

from __future__ import annotations

from tandem.engine.sampling_options import SamplingOptions


def banned_ids(
    options: SamplingOptions, token_ids: list[int], num_output_tokens: int
) -> frozenset[int]:
    """token_ids: the sequence so far (prompt + output) when options.needs_token_ids, else ignored."""
    banned: set[int] = set()
    if num_output_tokens < options.min_tokens:
        banned |= options.end_ids
    for word in options.bad_words:
        if len(word) == 1 or (
            len(token_ids) >= len(word) - 1
            and tuple(token_ids[len(token_ids) - len(word) + 1 :]) == word[:-1]
        ):
            banned.add(word[-1])
    n = options.no_repeat_ngram_size
    if n and len(token_ids) >= n:
        tail = tuple(token_ids[len(token_ids) - n + 1 :]) if n > 1 else ()
        for i in range(len(token_ids) - n + 1):
            if tuple(token_ids[i : i + n - 1]) == tail:
                banned.add(token_ids[i + n - 1])
    return frozenset(banned)
