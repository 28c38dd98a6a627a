"""A small byte-level BPE tokenizer built deterministically, for the tiny checkpoints.

The merges are learned here in plain Python rather than with `tokenizers`' trainer:
the trainer keeps counts in hash maps and may break ties differently between runs,
and the checkpoint files must be byte-identical every time.
"""

from __future__ import annotations

from collections import Counter

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors

UNK, BOS, EOS, PAD = "<unk>", "<s>", "</s>", "<pad>"
SPECIAL_TOKENS = (UNK, BOS, EOS, PAD)  # ids 0..3, Llama's order for the first three

_CORPUS = """
The quick brown fox jumps over the lazy dog. A serving cluster splits the prompt
phase from the generation phase: prefill workers read the whole prompt at once and
decode workers produce one token at a time for many requests together. The key and
value cache moves between them in fixed size blocks. Each block holds the keys and
values of a few tokens for every layer of the model, so a transfer is a list of
block ids. The scheduler admits requests while there are free blocks, and it
preempts the newest request when memory runs out. Tokens stream back to the client
as soon as they are sampled. Hello world! How are you today? It is a fine day to
write some code, to test it, and to measure how fast it runs. Numbers such as 0 1 2
3 4 5 6 7 8 9 10 42 100 2024 and 65536 appear in text as well as names like Alice,
Bob, Paris, London and Tokyo. def main(): return print("hello, world") # comment
for i in range(10): total += i * 2; if x == y: break else: continue
Once upon a time there was a small model that could only say random things, but
the pipeline around it was real, and that was what the tests were checking.
"""


def _learn_merges(corpus: str, num_merges: int) -> list[tuple[str, str]]:
    pre = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    word_counts = Counter(word for word, _ in pre.pre_tokenize_str(corpus))
    words = {tuple(word): count for word, count in sorted(word_counts.items())}
    merges: list[tuple[str, str]] = []
    for _ in range(num_merges):
        pair_counts: Counter[tuple[str, str]] = Counter()
        for symbols, count in words.items():
            for pair in zip(symbols, symbols[1:]):
                pair_counts[pair] += count
        if not pair_counts:
            break
        # Highest count wins; ties go to the lexicographically smallest pair.
        best = min(pair_counts, key=lambda pair: (-pair_counts[pair], pair))
        if pair_counts[best] < 2:
            break
        merges.append(best)
        merged = best[0] + best[1]
        new_words = {}
        for symbols, count in words.items():
            out, i = [], 0
            while i < len(symbols):
                if i + 1 < len(symbols) and (symbols[i], symbols[i + 1]) == best:
                    out.append(merged)
                    i += 2
                else:
                    out.append(symbols[i])
                    i += 1
            new_words[tuple(out)] = new_words.get(tuple(out), 0) + count
        words = new_words
    return merges


def build_tiny_tokenizer(num_merges: int = 252) -> Tokenizer:
    """4 specials + 256 byte symbols + up to `num_merges` merges; prepends <s> like Llama."""
    vocab: dict[str, int] = {token: i for i, token in enumerate(SPECIAL_TOKENS)}
    for symbol in sorted(pre_tokenizers.ByteLevel.alphabet()):
        vocab[symbol] = len(vocab)
    merges = _learn_merges(_CORPUS, num_merges)
    for left, right in merges:
        vocab.setdefault(left + right, len(vocab))
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=merges, unk_token=UNK))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tokenizer.add_special_tokens(list(SPECIAL_TOKENS))
    return tokenizer
