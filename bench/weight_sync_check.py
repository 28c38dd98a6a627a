"""Is a sync by IPC handles right on this device? The tiny Llama served by one worker, the trainer
(this process, transformers) perturbs its weights and syncs them by update_weights(handles);
greedy tokens must then equal transformers' on the perturbed weights. On CUDA this is the CUDA
IPC path (tests/test_update_weights_ipc.py runs the CPU one in CI).

    python bench/weight_sync_check.py --device cuda
"""

from __future__ import annotations

import argparse
import asyncio

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tandem.client import LLM, AsyncLLM, SamplingParams
from tandem.engine.checkpoints import tiny_model_dir
from tandem.rl import ipc_handles
from tandem.testing.cluster import LocalCluster

TOKEN = "weight-sync-check"
PROMPTS = ["the weights changed", "and they are served", "by handles"]
MAX_TOKENS = 12


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    args = parser.parse_args()
    device = torch.device(args.device)
    model_dir = tiny_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    prompts = [tokenizer.encode(p) for p in PROMPTS]
    trainer = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(device)
    generator = torch.Generator(device="cpu").manual_seed(7)
    with torch.no_grad():
        for param in trainer.parameters():
            noise = torch.randn(param.shape, generator=generator).to(device)
            param.add_(noise * param.std() * 0.5)
        expected = [
            trainer.generate(
                torch.tensor([p], device=device),
                attention_mask=torch.ones(1, len(p), dtype=torch.long, device=device),
                do_sample=False,
                max_new_tokens=MAX_TOKENS,
                pad_token_id=0,
            )[0, len(p) :].tolist()
            for p in prompts
        ]
    engine_args = ["--model", str(model_dir), "--dtype", "float32", "--num-blocks", "64"]
    if device.type == "cuda":
        engine_args += ["--device", "cuda"]
    with LocalCluster(
        roles=["both"], engine_args=engine_args, env={"TANDEM_ADMIN_TOKEN": TOKEN}
    ) as cluster:
        handles = ipc_handles((n, p.data) for n, p in trainer.named_parameters())

        async def sync():
            async with AsyncLLM(cluster.address, auth_token=TOKEN) as llm:
                await llm.pause_generation()
                await llm.update_weights(handles)
                await llm.update_weights(None)
                await llm.resume_generation()

        asyncio.run(sync())
        params = SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True)
        with LLM(cluster.address) as llm:
            served = [llm.generate(p, params, use_tqdm=False).outputs[0].token_ids for p in prompts]
    same = served == expected
    print(f"# bench/weight_sync_check.py --device {device.type}: keys {sorted(handles)}")
    print(f"greedy tokens after the sync equal transformers' on the trainer's weights: {same}")
    if not same:
        print("served  ", served)
        print("expected", expected)
        raise SystemExit(1)


if __name__ == "__main__":
    main()
