"""FP8 on the GPU against the CPU reference (issue 30): greedy tokens of the tiny model with FP8
weights and an FP8 KV pool, the Triton kernels on the device against the torch reference on the
CPU, and the same with bf16 KV, per prompt. Prints the agreement; exits 1 when the device path
cannot run.

    python bench/fp8_check.py                # needs CUDA
"""

from __future__ import annotations

import random
import sys

import torch

from tandem.engine.checkpoints import tiny_model_dir
from tandem.engine.config import EngineConfig
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.sampling_options import SamplingOptions


def _tokens(device: str, **config) -> dict[str, list[int]]:
    engine = LLMEngine(
        EngineConfig(str(tiny_model_dir()), device=device, block_size=16, num_blocks=256, **config)
    )
    rng = random.Random(0)
    for i in range(8):
        prompt = [1] + [rng.randrange(4, 380) for _ in range(rng.randrange(20, 300))]
        engine.add_request(f"r{i}", prompt, SamplingOptions(max_tokens=32, ignore_eos=True))
    out: dict[str, list[int]] = {}
    while engine.num_unfinished:
        for step in engine.step():
            out.setdefault(step.request_id, []).extend(step.new_token_ids)
    engine.close()
    return out


def main() -> None:
    if not torch.cuda.is_available():
        sys.exit("needs CUDA")
    for name, config in (
        ("fp8 weights + fp8 KV", {"quantization": "fp8", "kv_cache_dtype": "fp8"}),
        ("fp8 KV", {"kv_cache_dtype": "fp8"}),
        ("fp32 (the baseline of the check)", {}),
    ):
        gpu, cpu = _tokens("cuda", **config), _tokens("cpu", **config)
        same = sum(gpu[r] == cpu[r] for r in cpu)
        agree = sum(a == b for r in cpu for a, b in zip(gpu[r], cpu[r])) / sum(
            map(len, cpu.values())
        )
        print(f"{name:<34} sequences equal {same}/{len(cpu)}, tokens agreeing {agree:.3f}")


if __name__ == "__main__":
    main()
