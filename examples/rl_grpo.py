"""A small GRPO loop on the CPU: the trainer is transformers on SmolLM2-135M-Instruct (the default
model, the same weights tandem serves), the rollouts come from a tandem cluster started here, and
the trainer's weights reach the cluster after every step over IPC handles (update_weights in
TensorRT-LLM's format; no disk).

    .venv/bin/python examples/rl_grpo.py --steps 4

Each step: sample a group of completions per prompt (temperature 1, the sampled tokens'
logprobs asked for), score them, normalize the rewards within each group (GRPO's advantage),
compute the trainer's logprobs of the same tokens (the mismatch against the rollout's says how
far the two engines disagree on the same weights: it stays small at every step only if each sync
landed), take one policy-gradient step (the last --train-layers layers train, to keep a CPU step
short; every weight is synced), and sync the
new weights into the cluster (pause_generation, update_weights(handles), update_weights(None),
resume_generation). One line per step ("moved": how far the step moved those logprobs, what
the next mismatch would be had the sync not landed):

    step 0  reward 0.264  mismatch mean 6.56e-06 max 2.12e-05  moved 3.1e-03  rollout 1.93 s  train 0.65 s  sync 0.53 s

The reward is a toy: the share of a completion's characters that are digits (the prompts ask
for numbers), enough to see rewards move without a reward model.
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

import torch

from tandem.client import AsyncLLM, SamplingParams
from tandem.engine.checkpoints import default_model_dir
from tandem.rl import ipc_handles
from tandem.testing.cluster import LocalCluster

PROMPTS = [
    "List the first ten prime numbers:",
    "Write today's date as digits:",
]


def reward(text: str) -> float:
    return sum(c.isdigit() for c in text) / max(len(text), 1)


async def rollouts(llm: AsyncLLM, args, step: int) -> list:
    """args.group completions per prompt, each with the sampled tokens' logprobs."""
    calls = [
        llm.generate_async(
            prompt,
            SamplingParams(
                max_tokens=args.max_tokens,
                temperature=1.0,
                top_p=1.0,
                top_k=0,
                logprobs=1,
                seed=args.seed + step * 1000 + i,
            ),
        )
        for prompt in PROMPTS
        for i in range(args.group)
    ]
    return list(await asyncio.gather(*calls))


def group_advantages(rewards: list[float], group: int) -> list[float]:
    """GRPO: each reward against its group's mean, in units of the group's spread."""
    out = []
    for start in range(0, len(rewards), group):
        chunk = rewards[start : start + group]
        mean, std = statistics.fmean(chunk), statistics.pstdev(chunk)
        out.extend((r - mean) / (std + 1e-4) for r in chunk)
    return out


def trainer_logprobs(model, outs) -> list[torch.Tensor]:
    """log p(completion token | what precedes it) under the trainer's weights, per rollout, from
    one forward of the batch (right-padded: the padding comes after every real token)."""
    rows = [list(o.prompt_token_ids) + list(o.outputs[0].token_ids) for o in outs]
    width = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), width, dtype=torch.long)
    mask = torch.zeros(len(rows), width, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, : len(row)], mask[i, : len(row)] = torch.tensor(row), 1
    logits = model(input_ids=ids, attention_mask=mask).logits
    out = []
    for i, o in enumerate(outs):
        start, completion = len(o.prompt_token_ids), list(o.outputs[0].token_ids)
        rows_logits = logits[i, start - 1 : start - 1 + len(completion)].float()
        picked = torch.log_softmax(rows_logits, dim=-1).gather(1, torch.tensor(completion)[:, None])
        out.append(picked[:, 0])
    return out


def train_step(model, optimizer, outs, advantages) -> tuple[float, float, float]:
    """One policy-gradient step on the rollouts (on-policy: GRPO's clipped ratio is 1 here).
    Returns the mean and max |trainer logprob - rollout logprob| over the sampled tokens,
    measured on the weights that sampled them, and how far the step moved the tokens' logprobs
    (mean): a sync that did not land shows as a next mismatch of that size."""
    optimizer.zero_grad()
    kept = [(o, a) for o, a in zip(outs, advantages) if o.outputs[0].token_ids]
    logprobs = trainer_logprobs(model, [o for o, _ in kept])
    diffs, loss = [], 0.0
    for (out, advantage), lps in zip(kept, logprobs):
        completion = out.outputs[0]
        served = torch.tensor(
            [lp[t].logprob for lp, t in zip(completion.logprobs, completion.token_ids)]
        )
        diffs.append((lps.detach() - served).abs())
        loss = loss - advantage * lps.mean() / len(kept)
    loss.backward()
    optimizer.step()
    with torch.no_grad():
        after = trainer_logprobs(model, [o for o, _ in kept])
    moved = torch.cat([(a - b.detach()).abs() for a, b in zip(after, logprobs)])
    diffs = torch.cat(diffs)
    return diffs.mean().item(), diffs.max().item(), moved.mean().item()


def trainable(model, num_layers: int) -> list:
    """The last num_layers decoder layers and the final norm train; the rest stays (a CPU step
    stays short: the backward stops there). Every weight is synced all the same."""
    for p in model.parameters():
        p.requires_grad_(False)
    params = [p for layer in model.model.layers[-num_layers:] for p in layer.parameters()]
    params += list(model.model.norm.parameters())
    for p in params:
        p.requires_grad_(True)
    return params


async def sync_weights(llm: AsyncLLM, model) -> float:
    started = time.perf_counter()
    await llm.pause_generation()
    await llm.update_weights(ipc_handles((n, p.data) for n, p in model.named_parameters()))
    await llm.update_weights(None)
    await llm.resume_generation()
    return time.perf_counter() - started


async def run(args, address: str, model) -> None:
    optimizer = torch.optim.AdamW(trainable(model, args.train_layers), lr=args.lr, weight_decay=0.0)
    llm = AsyncLLM(address)
    try:
        for step in range(args.steps):
            started = time.perf_counter()
            outs = await rollouts(llm, args, step)
            rollout_s = time.perf_counter() - started
            rewards = [reward(o.outputs[0].text) for o in outs]
            started = time.perf_counter()
            mean_diff, max_diff, moved = train_step(
                model, optimizer, outs, group_advantages(rewards, args.group)
            )
            train_s = time.perf_counter() - started
            sync_s = await sync_weights(llm, model)
            print(
                f"step {step}  reward {statistics.fmean(rewards):.3f}  "
                f"mismatch mean {mean_diff:.2e} max {max_diff:.2e}  moved {moved:.2e}  "
                f"rollout {rollout_s:.2f} s  train {train_s:.2f} s  sync {sync_s:.2f} s",
                flush=True,
            )
    finally:
        llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--group", type=int, default=4, help="completions per prompt")
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--lr", type=float, default=1e-5)
    parser.add_argument("--train-layers", type=int, default=2, help="last decoder layers trained")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--split", action="store_true", help="a prefill and a decode worker")
    args = parser.parse_args()

    from transformers import AutoModelForCausalLM

    torch.manual_seed(args.seed)
    model_dir = default_model_dir()  # SmolLM2's GGUF file as a checkpoint directory (float32)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    roles = ["prefill", "decode"] if args.split else ["both"]
    engine_args = ["--model", str(model_dir), "--num-blocks", "128"]
    with LocalCluster(roles=roles, engine_args=engine_args) as cluster:
        print(f"rollouts: tandem at {cluster.address} ({' + '.join(roles)}), model {model_dir}")
        asyncio.run(run(args, cluster.address, model))


if __name__ == "__main__":
    main()
