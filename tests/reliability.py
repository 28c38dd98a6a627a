"""The load and fault matrix's sizes and its report (docs/RELIABILITY.md).

`make test` runs every fault test CI-sized; `make reliability` runs the same tests full-size
(TANDEM_RELIABILITY=full) and has each one record what it tried, handled and lost into
TANDEM_RELIABILITY_REPORT, which `python tests/reliability.py REPORT` prints as a table.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from dataclasses import dataclass, field

FULL = os.environ.get("TANDEM_RELIABILITY") == "full"


def scaled(ci: int, full: int) -> int:
    """A count for this run: CI-sized under `make test`, full-size under `make reliability`."""
    return full if FULL else ci


def record(name: str, tried: int, handled: int, lost: int, command: str, note: str = "") -> None:
    """One row of the report (when `make reliability` asked for one)."""
    path = os.environ.get("TANDEM_RELIABILITY_REPORT")
    if not path:
        return
    with open(path, "a") as f:
        f.write(
            json.dumps(
                {
                    "name": name,
                    "tried": tried,
                    "handled": handled,
                    "lost": lost,
                    "command": command,
                    "note": note,
                    "size": "full" if FULL else "ci",
                }
            )
            + "\n"
        )


@dataclass
class Outcome:
    """What became of one request of a load run."""

    tokens: list[int] = field(default_factory=list)
    finish_reason: str | None = None
    error: str | None = None
    served_by: list[str] = field(default_factory=list)
    kv_transfer_bytes: int = 0
    seconds: float = 0.0


async def run_load(llm, prompts: list, params, concurrency: int, on_started=None) -> list[Outcome]:
    """Streams every prompt through llm (an AsyncLLM), concurrency at a time; on_started(i) runs
    as request i's first message arrives. Never raises for a failed request: its Outcome says."""
    limit = asyncio.Semaphore(concurrency)
    outcomes = [Outcome() for _ in prompts]

    async def one(i: int, prompt) -> None:
        outcome = outcomes[i]
        async with limit:
            started = time.monotonic()
            try:
                async for out in llm.generate_async(prompt, params, streaming=True):
                    if not outcome.tokens and on_started is not None:
                        on_started(i)
                    outcome.tokens += out.outputs[0].token_ids_diff
                outcome.finish_reason = out.outputs[0].finish_reason
                if out.metrics is not None:
                    outcome.served_by = list(out.metrics.served_by)
                    outcome.kv_transfer_bytes = out.metrics.kv_transfer_bytes
            except Exception as exc:  # noqa: BLE001 - a lost request, counted by the caller
                outcome.error = f"{type(exc).__name__}: {exc}"
            outcome.seconds = time.monotonic() - started

    await asyncio.gather(*(one(i, p) for i, p in enumerate(prompts)))
    return outcomes


def lost(outcomes: list[Outcome], max_tokens: int) -> list[Outcome]:
    """Requests that failed or ended short (every load request asks for max_tokens, ignore_eos)."""
    return [
        o for o in outcomes if o.error or len(o.tokens) != max_tokens or o.finish_reason != "length"
    ]


def print_report(path: str) -> None:
    rows = [json.loads(line) for line in open(path)]
    print("| fault | tried | handled | lost | command |")
    print("| --- | ---: | ---: | ---: | --- |")
    for r in rows:
        note = f" ({r['note']})" if r["note"] else ""
        print(
            f"| {r['name']}{note} | {r['tried']} | {r['handled']} | {r['lost']} | `{r['command']}` |"
        )


if __name__ == "__main__":
    print_report(sys.argv[1])
