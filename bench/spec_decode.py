"""Speculative decoding against plain decoding (issue 31), in one run, on the engine itself:
decode tokens/s at batch 1 (and at a batch of --batch), per workload and method, with the
acceptance (draft tokens accepted / drafted; tokens per step) beside the plain row.

    python bench/spec_decode.py                        # SmolLM2-135M (the default model), CPU
    python bench/spec_decode.py --device cuda --model DIR --max-tokens 256
    python bench/spec_decode.py --draft-model DIR      # also the draft_model method (or 'self')
    python bench/spec_decode.py --eagle3-model DIR     # also the eagle3 method (an EAGLE-3 head)

Workloads, chat-templated: copy-heavy (the model is asked to repeat or edit a passage it was
given: what prompt lookup is for) and free-form (an open question: drafts rarely match). Every
method's greedy tokens are checked equal to plain decoding's before any number is printed. Each
configuration runs once to warm up, then --repeats times; the table has the median. The
suffix rows are its best case: the same prompts were answered before (the warm-up), which is
what it is for (repeated and agentic requests); on new prompts it is the ngram row.

On the GPU the verification step runs eagerly (the decode CUDA graphs hold one token per
sequence), so a drafted step there costs more than a plain graph step: the GPU row says what
that leaves of the speed-up. With eagle3 every target step runs eagerly (the head needs the
layers' states, which the graphs do not capture yet) and the head drafts one sequence at a time.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

from transformers import AutoTokenizer

from tandem.engine.checkpoints import resolve_model
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions

PASSAGE = (
    "The committee met on Tuesday to review the budget for the new library. After a long "
    "discussion, the members agreed to fund the children's section, to extend the opening "
    "hours on weekends, and to hire two more librarians before the end of the year."
)
WORKLOADS = {
    "copy": [
        f"Repeat the following text exactly, word for word:\n\n{PASSAGE}",
        f"Rewrite this text with 'Tuesday' replaced by 'Friday', changing nothing else:\n\n{PASSAGE}",
    ],
    "free": [
        "Write a short story about a lighthouse keeper.",
        "Explain why the sky is blue to a ten-year-old.",
    ],
}


def _prompts(tokenizer, texts: list[str]) -> list[list[int]]:
    if not tokenizer.chat_template:  # a base model: the text as it is
        return [tokenizer.encode(text) for text in texts]
    return [
        tokenizer.encode(
            tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
            ),
            add_special_tokens=False,
        )
        for text in texts
    ]


def _run(engine: LLMEngine, prompts: list[list[int]], max_tokens: int):
    """(tokens per prompt, decode seconds, steps) of one batch run to the end."""
    options = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}-{time.monotonic_ns()}", prompt, options)
    tokens: dict[str, list[int]] = {}
    steps_before = engine.counters.num_steps
    started = time.perf_counter()
    while engine.num_unfinished:
        for out in engine.step():
            tokens.setdefault(out.request_id, []).extend(out.new_token_ids)
    seconds = time.perf_counter() - started
    ordered = [tokens[key] for key in sorted(tokens, key=lambda k: int(k.split("-")[0][1:]))]
    return ordered, seconds, engine.counters.num_steps - steps_before


def _common_prefix(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="checkpoint directory (default: SmolLM2)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--batch", type=int, default=2, help="the batched row's requests")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument(
        "--draft-model",
        default=None,
        help="also the draft_model method with this checkpoint (the target's vocabulary; "
        "'self': the target itself, every greedy draft accepted: the method's cost at best)",
    )
    parser.add_argument(
        "--eagle3-model",
        default=None,
        help="also the eagle3 method with this EAGLE-3 head checkpoint (trained for the target)",
    )
    parser.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        help="the methods' disable_by_batch_size (no drafts while more sequences run)",
    )
    args = parser.parse_args()
    model_dir = str(resolve_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    extra = {}
    if args.disable_by_batch_size:
        extra["disable_by_batch_size"] = args.disable_by_batch_size
    methods = {
        "plain": "",
        "ngram": json.dumps({"method": "ngram", "num_speculative_tokens": args.k, **extra}),
        "suffix": json.dumps({"method": "suffix", "num_speculative_tokens": args.k, **extra}),
    }
    if args.draft_model:
        draft = model_dir if args.draft_model == "self" else args.draft_model
        methods["draft_model"] = json.dumps(
            {"method": "draft_model", "model": draft, "num_speculative_tokens": args.k}
        )
    if args.eagle3_model:
        methods["eagle3"] = json.dumps(
            {
                "method": "eagle3",
                "model": args.eagle3_model,
                "num_speculative_tokens": args.k,
                **extra,
            }
        )
    engines = {
        name: LLMEngine(
            EngineConfig(
                model_dir,
                device=args.device,
                kv_cache_memory_gb=0.5,
                enable_prefix_caching=False,
                speculative_config=spec,
            )
        )
        for name, spec in methods.items()
    }
    rows, differ = [], []
    for workload, texts in WORKLOADS.items():
        prompts = _prompts(tokenizer, texts)
        for batch in (1, args.batch):
            batch_prompts = (prompts * batch)[:batch]
            reference = None
            for name, engine in engines.items():
                c = engine.counters
                _run(engine, batch_prompts, args.max_tokens)  # warm-up (the suffix table learns)
                times, steps = [], []
                drafted0, accepted0 = c.num_draft_tokens, c.num_accepted_draft_tokens
                for _ in range(args.repeats):
                    tokens, seconds, num_steps = _run(engine, batch_prompts, args.max_tokens)
                    times.append(seconds)
                    steps.append(num_steps)
                if reference is None:
                    reference = tokens
                elif tokens != reference:
                    if args.device == "cpu":
                        raise SystemExit(f"{name} on {workload}: tokens differ from plain decoding")
                    # On a GPU the verify forward (k + 1 rows a sequence) runs other kernels than
                    # the plain decode step, which round differently: report where they part.
                    same = [_common_prefix(a, b) for a, b in zip(tokens, reference)]
                    differ.append(f"{name}/{workload}/bs{batch}: first differs at {min(same)}")
                drafted = c.num_draft_tokens - drafted0
                accepted = c.num_accepted_draft_tokens - accepted0
                num_tokens = sum(len(t) for t in tokens)
                rows.append(
                    (
                        workload,
                        batch,
                        name,
                        num_tokens / statistics.median(times),
                        num_tokens / statistics.median(steps) / batch,
                        accepted / drafted if drafted else 0.0,
                    )
                )
    plain = {(w, b): tps for w, b, name, tps, _, _ in rows if name == "plain"}
    print(
        f"\nspeculative decoding, {model_dir}, {args.device}, k={args.k}, "
        f"disable_by_batch_size={args.disable_by_batch_size}, greedy, "
        f"{args.max_tokens} tokens; tokens equal to plain decoding: "
        + ("checked" if not differ else "NOT in " + "; ".join(differ))
    )
    print(
        f"{'workload':<8} {'batch':>5} {'method':<7} {'tok/s':>8} {'vs plain':>8} "
        f"{'tok/step':>8} {'accepted':>8}"
    )
    for workload, batch, name, tps, per_step, rate in rows:
        print(
            f"{workload:<8} {batch:>5} {name:<7} {tps:>8.1f} {tps / plain[workload, batch]:>7.2f}x "
            f"{per_step:>8.2f} {rate:>8.0%}"
        )


if __name__ == "__main__":
    main()
