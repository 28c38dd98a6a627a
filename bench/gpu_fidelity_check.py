"""Issue 9 server features on a GPU (decode graphs, GPU sampler, overlap scheduling) against the
same engine on the CPU: beam search, ranks, prompt logprobs, logits, bad words, n-grams, bias,
guided decoding. Run from the repository root on the device machine; prints a table, exits 1
on a mismatch. GPU_CHECK_DEVICE=cpu runs it against the CPU itself (a check of the check)."""

import os
import sys

import torch

sys.path.insert(0, "tests")
from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions

md = str(tiny_model_dir())
failures = []


def engine(device, **kw):
    return LLMEngine(
        EngineConfig(md, device=device, block_size=4, num_blocks=128, max_num_seqs=16, **kw)
    )


def run(e, prompts, options):
    for rid, ids in prompts.items():
        e.add_request(rid, ids, options[rid])
    outs = {rid: [] for rid in prompts}
    while e.num_unfinished:
        for out in e.step():
            outs[out.request_id].append(out)
    return outs


def check(name, ok):
    print(f"{name:60s} {'ok' if ok else 'MISMATCH'}")
    if not ok:
        failures.append(name)


prompts = {f"p{i}": [1] + [(7 * i + 3 * k) % 370 + 5 for k in range(5 + 3 * i)] for i in range(6)}
cpu, gpu = engine("cpu"), engine(os.environ.get("GPU_CHECK_DEVICE", "cuda"))
# Beam search: the same beams and scores.
beam = {
    rid: SamplingOptions(
        max_tokens=10,
        n=4,
        beam_width=4,
        length_penalty=1.0,
        early_stopping=1,
        eos_token_ids=(ids[-1],),
    )
    for rid, ids in prompts.items()
}
a, b = run(cpu, prompts, beam), run(gpu, prompts, beam)
same = all(
    [x.token_ids for x in a[r][-1].beams] == [x.token_ids for x in b[r][-1].beams] for r in prompts
)
close = all(
    abs(x.cumulative_logprob - y.cumulative_logprob) < 1e-3
    for r in prompts
    for x, y in zip(a[r][-1].beams, b[r][-1].beams)
)
check("beam search: beams equal CPU, scores within 1e-3", same and close)
check("beam search: every block free afterwards", gpu.block_manager.num_free_blocks == 128)
# Logprobs with ranks, prompt logprobs, context and generation logits, bad words, n-grams, bias.
bias = tuple(((t * 37) % 11 - 5) * 0.3 for t in range(gpu.model_config.vocab_size))
opts = {
    rid: SamplingOptions(
        max_tokens=12,
        ignore_eos=True,
        logprobs=3,
        prompt_logprobs=2,
        return_context_logits=True,
        return_generation_logits=True,
        bad_words=((ids[-1],), (ids[1], ids[2])),
        no_repeat_ngram_size=2,
        embedding_bias=bias if i % 2 else (),
    )
    for i, (rid, ids) in enumerate(prompts.items())
}
a, b = run(cpu, prompts, opts), run(gpu, prompts, opts)
check(
    "greedy tokens with bad words, n-grams, bias equal CPU",
    all([o.new_token_ids for o in a[r]] == [o.new_token_ids for o in b[r]] for r in prompts),
)
check(
    "ranks equal CPU",
    all([o.new_ranks for o in a[r]] == [o.new_ranks for o in b[r]] for r in prompts),
)
check(
    "prompt logprobs: same tokens, values within 1e-3",
    all(
        [sorted(x[0]) for x in a[r][0].prompt_logprobs]
        == [sorted(x[0]) for x in b[r][0].prompt_logprobs]
        for r in prompts
    ),
)
check(
    "context logits within 1e-3",
    all(torch.allclose(a[r][0].context_logits, b[r][0].context_logits, atol=1e-3) for r in prompts),
)
check(
    "generation logits within 1e-3",
    all(
        torch.allclose(x.generation_logits[0], y.generation_logits[0], atol=1e-3)
        for r in prompts
        for x, y in zip(a[r], b[r])
    ),
)
# Seeded sampling with the new knobs, graphs and overlap on: the same draws.
seeded = {
    rid: SamplingOptions(
        max_tokens=12,
        ignore_eos=True,
        temperature=0.9,
        seed=i,
        top_k=40,
        bad_words=((ids[-1],),),
        no_repeat_ngram_size=3,
    )
    for i, (rid, ids) in enumerate(prompts.items())
}
a, b = run(cpu, prompts, seeded), run(gpu, prompts, seeded)
check(
    "seeded draws with bad words and n-grams equal CPU",
    all([o.new_token_ids for o in a[r]] == [o.new_token_ids for o in b[r]] for r in prompts),
)
try:
    import xgrammar  # noqa: F401

    from tandem.engine.guided import GuideCompiler
    from tandem.text.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(md)
    vocab = tok.backend.get_vocab(with_added_tokens=True)
    encoded = [""] * (max(vocab.values()) + 1)
    for t, i in vocab.items():
        encoded[i] = t
    compiler = GuideCompiler(tok.backend.to_str(), encoded, gpu.model_config.vocab_size, [2])
    guide = compiler.compile("regex", r"(cat|dog)s? [0-9]{2}\.")
    import dataclasses

    guided = {
        rid: dataclasses.replace(SamplingOptions(max_tokens=16, eos_token_ids=(2,)), guide=guide)
        for rid in prompts
    }
    a, b = run(cpu, prompts, guided), run(gpu, prompts, guided)
    import re

    texts = [tok.decode([t for o in b[r] for t in o.new_token_ids]) for r in prompts]
    check(
        "guided regex: GPU outputs match the regex and equal CPU",
        all(re.fullmatch(r"(cat|dog)s? [0-9]{2}\.", t) for t in texts)
        and all(
            [o.new_token_ids for o in a[r]] == [o.new_token_ids for o in b[r]] for r in prompts
        ),
    )
except ImportError as exc:
    print("guided decoding: skipped,", exc)
sys.exit(1 if failures else 0)
