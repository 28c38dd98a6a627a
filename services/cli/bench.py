"""`tandem bench`: load a running cluster like `vllm bench serve` and measure it.

A sweep over concurrency (--max-concurrency 1,4,16) or request rate (--request-rate 2,8,inf:
Poisson arrivals) sends --num-prompts prompts of random token ids per point (lengths around
--input-len / --output-len within --range-ratio; 0 = fixed), fresh prompts at every point so
the prefix cache never serves one, greedy with ignore_eos so every request makes exactly its
output length. Reports p50/p90/p99 TTFT, TPOT and end-to-end latency and the throughputs,
as a table, a JSON file (--result-json) and a PNG plot of latency against throughput (--plot).
Only the client (tandem.client) talks to the cluster.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass

from tandem.client import AsyncLLM, SamplingParams

_PERCENTILES = (50, 90, 99)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--target", default="127.0.0.1:50051", help="the router (host:port)")
    sweep = p.add_mutually_exclusive_group()
    sweep.add_argument(
        "--max-concurrency",
        default=None,
        help="comma-separated concurrency levels (default 1,4,16)",
    )
    sweep.add_argument(
        "--request-rate",
        default=None,
        help="comma-separated request rates per second; inf: all at once",
    )
    p.add_argument("--num-prompts", type=int, default=64, help="requests per sweep point")
    p.add_argument("--input-len", type=int, default=128, help="prompt tokens (mean)")
    p.add_argument("--output-len", type=int, default=64, help="generated tokens (mean)")
    p.add_argument(
        "--range-ratio",
        type=float,
        default=0.0,
        help="lengths uniform in [len*(1-r), len*(1+r)]; 0: every prompt the same length",
    )
    p.add_argument(
        "--vocab-size",
        type=int,
        default=0,
        help="token ids to draw from (default: the served tokenizer's)",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--num-warmup", type=int, default=4, help="requests before the sweep, not measured"
    )
    p.add_argument("--auth-token", default=None)
    p.add_argument("--result-json", default=None, help="write the results here")
    p.add_argument(
        "--plot",
        default=None,
        help="write a PNG of latency against throughput here (needs matplotlib)",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bar")


@dataclass
class RequestResult:
    ttft_s: float = 0.0
    e2e_s: float = 0.0
    num_input_tokens: int = 0
    num_output_tokens: int = 0
    error: str | None = None

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first (None with a single token)."""
        if self.num_output_tokens < 2:
            return None
        return (self.e2e_s - self.ttft_s) / (self.num_output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return math.nan
    ordered = sorted(values)
    pos = (len(ordered) - 1) * q / 100
    lo = math.floor(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


def _latency(values_s: list[float]) -> dict:
    ms = [v * 1e3 for v in values_s]
    out = {"mean": sum(ms) / len(ms) if ms else math.nan}
    out.update({f"p{q}": percentile(ms, q) for q in _PERCENTILES})
    return out


def summarize(results: list[RequestResult], duration_s: float) -> dict:
    ok = [r for r in results if r.error is None]
    num_in, num_out = sum(r.num_input_tokens for r in ok), sum(r.num_output_tokens for r in ok)
    errors = [r.error for r in results if r.error is not None]
    return {
        "completed": len(ok),
        "failed": len(errors),
        "first_error": errors[0] if errors else None,
        "duration_s": duration_s,
        "input_tokens": num_in,
        "output_tokens": num_out,
        "request_throughput": len(ok) / duration_s,
        "output_throughput": num_out / duration_s,
        "total_token_throughput": (num_in + num_out) / duration_s,
        "ttft_ms": _latency([r.ttft_s for r in ok]),
        "tpot_ms": _latency([r.tpot_s for r in ok if r.tpot_s is not None]),
        "e2e_ms": _latency([r.e2e_s for r in ok]),
    }


class PromptSource:
    """Seeded random token-id prompts, never repeated (no prefix-cache hits between requests)."""

    def __init__(self, seed: int, vocab_size: int, excluded: set[int], args):
        self.rng = random.Random(seed)
        self.vocab_size, self.excluded = vocab_size, excluded
        self.input_len, self.output_len, self.range_ratio = (
            args.input_len,
            args.output_len,
            args.range_ratio,
        )

    def _length(self, mean: int) -> int:
        low, high = int(mean * (1 - self.range_ratio)), int(mean * (1 + self.range_ratio))
        return max(1, self.rng.randint(low, high))

    def _token(self) -> int:
        while True:
            t = self.rng.randrange(self.vocab_size)
            if t not in self.excluded:
                return t

    def take(self, n: int) -> list[tuple[list[int], int]]:
        return [
            (
                [self._token() for _ in range(self._length(self.input_len))],
                self._length(self.output_len),
            )
            for _ in range(n)
        ]


def _vocab(llm: AsyncLLM, override: int) -> tuple[int, set[int]]:
    """Token ids to draw from and the special ones to leave out, from the served tokenizer."""
    tok = llm.tokenizer
    excluded = set(tok.eos_token_ids) | (
        {tok.bos_token_id} if tok.bos_token_id is not None else set()
    )
    raw = tok.files.get("tokenizer.json")
    if raw is None:
        if not override:
            raise ValueError("the served tokenizer has no tokenizer.json: give --vocab-size")
        return override, excluded
    data = json.loads(raw)
    vocab = data["model"]["vocab"]
    ids = list(vocab.values()) if isinstance(vocab, dict) else list(range(len(vocab)))
    added = data.get("added_tokens") or []
    excluded |= {t["id"] for t in added if t.get("special")}
    size = override or max(ids + [t["id"] for t in added]) + 1
    return size, excluded


async def _one(llm: AsyncLLM, prompt: list[int], output_len: int) -> RequestResult:
    params = SamplingParams(max_tokens=output_len, ignore_eos=True)
    started = time.perf_counter()
    result = RequestResult()
    try:
        async for out in llm.generate_async(prompt, params, streaming=True):
            if not result.ttft_s and out.outputs and out.outputs[0].token_ids:
                result.ttft_s = time.perf_counter() - started
        result.e2e_s = time.perf_counter() - started
        result.num_input_tokens = len(out.prompt_token_ids)  # as the server saw it
        result.num_output_tokens = len(out.outputs[0].token_ids)
    except Exception as exc:  # noqa: BLE001 - a failed request is counted, not fatal
        result.error = f"{type(exc).__name__}: {exc}"
    return result


async def run_point(
    llm: AsyncLLM,
    prompts: list[tuple[list[int], int]],
    concurrency: int | None,
    rate: float | None,
    rng: random.Random,
    bar,
) -> dict:
    """One sweep point: all prompts under a concurrency cap and/or Poisson arrivals at rate per second."""
    limit = asyncio.Semaphore(concurrency) if concurrency else None

    async def send(prompt, output_len):
        if limit is None:
            result = await _one(llm, prompt, output_len)
        else:
            async with limit:
                result = await _one(llm, prompt, output_len)
        if bar is not None:
            bar.update(1)
        return result

    started = time.perf_counter()
    tasks = []
    for prompt, output_len in prompts:
        tasks.append(asyncio.create_task(send(prompt, output_len)))
        if rate is not None and math.isfinite(rate):
            await asyncio.sleep(rng.expovariate(rate))
    results = await asyncio.gather(*tasks)
    return summarize(results, time.perf_counter() - started)


def _sweep(args) -> tuple[str, list[float]]:
    if args.request_rate is not None:
        return "request_rate", [float(v) for v in args.request_rate.split(",")]
    return "max_concurrency", [int(v) for v in (args.max_concurrency or "1,4,16").split(",")]


def _progress(total: int, desc: str, disabled: bool):
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc=desc, dynamic_ncols=True, file=sys.stderr)


async def bench(args) -> dict:
    kind, values = _sweep(args)
    llm = await AsyncLLM(args.target, auth_token=args.auth_token)
    try:
        vocab_size, excluded = _vocab(llm, args.vocab_size)
        source = PromptSource(args.seed, vocab_size, excluded, args)
        arrivals = random.Random(args.seed + 1)
        if args.num_warmup:
            await run_point(
                llm, source.take(args.num_warmup), args.num_warmup, None, arrivals, None
            )
        points = []
        for value in values:
            bar = _progress(args.num_prompts, f"{kind} {value:g}", args.no_progress)
            try:
                summary = await run_point(
                    llm,
                    source.take(args.num_prompts),
                    value if kind == "max_concurrency" else None,
                    value if kind == "request_rate" else None,
                    arrivals,
                    bar,
                )
            finally:
                if bar is not None:
                    bar.close()
            points.append(
                {kind: value if math.isfinite(value) else "inf", **summary}
            )  # JSON has no Infinity
        info = llm.disaggregated_params
        return {
            "target": args.target,
            "model": llm._server_info().model,
            "mode": info.get("mode"),
            "date": time.strftime("%Y-%m-%d %H:%M:%S"),
            "sweep": kind,
            "num_prompts": args.num_prompts,
            "input_len": args.input_len,
            "output_len": args.output_len,
            "range_ratio": args.range_ratio,
            "seed": args.seed,
            "points": points,
        }
    finally:
        llm.shutdown()


def _label(value) -> str:
    return value if isinstance(value, str) else f"{value:g}"


def format_table(result: dict) -> str:
    kind = result["sweep"]
    head = (
        f"{kind:>16} {'ok':>5} {'fail':>5} {'req/s':>8} {'out tok/s':>10} "
        f"{'TTFT ms p50/p90/p99':>22} {'TPOT ms p50/p90/p99':>22} {'E2E ms p50/p90/p99':>24}"
    )
    lines = [head, "-" * len(head)]
    for p in result["points"]:
        cols = [
            " / ".join(f"{p[m][f'p{q}']:.1f}" for q in _PERCENTILES)
            for m in ("ttft_ms", "tpot_ms", "e2e_ms")
        ]
        lines.append(
            f"{_label(p[kind]):>16} {p['completed']:>5} {p['failed']:>5} {p['request_throughput']:>8.2f} "
            f"{p['output_throughput']:>10.1f} {cols[0]:>22} {cols[1]:>22} {cols[2]:>24}"
        )
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    """Latency (p50 and p99) of TTFT, TPOT and E2E against output throughput, one point per sweep value."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kind = result["sweep"]
    points = result["points"]
    x = [p["output_throughput"] for p in points]
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for ax, (metric, title) in zip(
        axes, (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("e2e_ms", "End-to-end"))
    ):
        for q, style in (("p50", "o-"), ("p99", "s--")):
            ax.plot(x, [p[metric][q] for p in points], style, label=q)
        for p, xv in zip(points, x):
            ax.annotate(
                _label(p[kind]),
                (xv, p[metric]["p50"]),
                textcoords="offset points",
                xytext=(4, 4),
                fontsize=8,
            )
        ax.set_title(f"{title} latency")
        ax.set_xlabel("output throughput (tokens/s)")
        ax.set_ylabel("ms")
        ax.grid(True, alpha=0.3)
        ax.legend()
    model = os.path.basename(result["model"].rstrip("/")) or result["model"]
    fig.suptitle(
        f"tandem bench: {result['mode']} {model}, {kind.replace('_', ' ')} sweep "
        f"(points labelled), {result['input_len']} in / {result['output_len']} out tokens"
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args) -> int:
    result = asyncio.run(bench(args))
    print(format_table(result))
    if args.result_json:
        with open(args.result_json, "w") as f:
            json.dump(result, f, indent=2)
    if args.plot:
        plot(result, args.plot)
    failed = sum(p["failed"] for p in result["points"])
    if failed:
        print(
            f"tandem bench: {failed} requests failed; first: "
            f"{next(p['first_error'] for p in result['points'] if p['first_error'])}",
            file=sys.stderr,
        )
    return 1 if failed else 0


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="tandem bench",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
