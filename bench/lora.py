"""Decode speed with LoRA adapters (issue 13): 0, 1 and 8 distinct adapters in a batch of 32, one run.

    python bench/lora.py                  # CUDA: Llama-3.1-8B shape, bf16, rank-16 adapters on every projection
    python bench/lora.py --shape tiny     # CPU smoke run of the same script (numbers mean nothing)

In-process engine steps, as bench/serve.py's profile phase: one engine (max_loras 8, max_lora_rank
16) serves 32 sequences of 128-token prompts; in each row they use N distinct adapters round-robin
(N = 0: the base model). Once every sequence has its first token, decode steps are timed: wall ms
per step (tok/s = 32 / step), GPU ms of the replayed CUDA graph, and the LoRA bytes a step reads
(each distinct adapter's A and B of every layer) next to the floor: (base weights + those bytes) /
device copy bandwidth. An eager row (graphs off) shows what the graph-safe LoRA path saves.

The adapters are PEFT directories written here in PEFT's layout (adapter_config.json +
adapter_model.safetensors with base_model.model.model.layers.N.*.lora_A/B.weight), random weights.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from serve import SHAPES, _sync, copy_bandwidth, decode_bytes, write_checkpoint  # noqa: E402

SEED = 0
RANK = 16
BATCH = 32
PROMPT_LEN = 128
MODULES = {
    "self_attn": ("q_proj", "k_proj", "v_proj", "o_proj"),
    "mlp": ("gate_proj", "up_proj", "down_proj"),
}


def log(*args) -> None:
    print(*args, flush=True)


def module_shapes(shape: dict) -> dict[str, tuple[int, int]]:
    """PEFT module name -> (in_features, out_features)."""
    hidden, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = (
        shape["num_attention_heads"] * shape["head_dim"],
        shape["num_key_value_heads"] * shape["head_dim"],
    )
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def write_adapter(out: Path, shape: dict, seed: int, device: torch.device) -> Path:
    """A rank-16 LoRA on every projection of every layer, as PEFT saves one."""
    from safetensors.torch import save_file

    if (out / "adapter_model.safetensors").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator(device).manual_seed(seed)

    def randn(*dims, std):
        return (torch.randn(*dims, generator=gen, device=device) * std).bfloat16().cpu()

    tensors = {}
    for layer in range(shape["num_hidden_layers"]):
        for parent, names in MODULES.items():
            for name in names:
                fan_in, fan_out = module_shapes(shape)[name]
                key = f"base_model.model.model.layers.{layer}.{parent}.{name}"
                tensors[f"{key}.lora_A.weight"] = randn(RANK, fan_in, std=fan_in**-0.5)
                tensors[f"{key}.lora_B.weight"] = randn(fan_out, RANK, std=0.01)
    save_file(tensors, str(out / "adapter_model.safetensors"), metadata={"format": "pt"})
    (out / "adapter_config.json").write_text(
        json.dumps(
            {
                "peft_type": "LORA",
                "r": RANK,
                "lora_alpha": 2 * RANK,
                "lora_dropout": 0.0,
                "bias": "none",
                "target_modules": [n for names in MODULES.values() for n in names],
                "use_rslora": False,
                "use_dora": False,
                "task_type": "CAUSAL_LM",
            }
        )
    )
    return out


def adapter_bytes(shape: dict) -> int:
    """Bytes of one adapter's A and B (bf16): what a decode step reads per distinct adapter."""
    per_layer = sum(RANK * (fan_in + fan_out) for fan_in, fan_out in module_shapes(shape).values())
    return 2 * per_layer * shape["num_hidden_layers"]


def gpu_ms(fn, device: torch.device, num: int = 20) -> float:
    if device.type != "cuda":
        return float("nan")
    fn()
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(num):
        fn()
    end.record()
    end.synchronize()
    return begin.elapsed_time(end) / num


def run_rows(
    model_dir: Path, adapter_dirs: list[Path], device: torch.device, vocab: int, steps: int
) -> dict:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.lora_adapter import AdapterStore
    from tandem.engine.sampling_options import SamplingOptions

    started = time.perf_counter()
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype="bfloat16",
            kv_cache_memory_gb=16 if device.type == "cuda" else 0.25,
            max_num_seqs=BATCH,
            max_num_batched_tokens=BATCH * PROMPT_LEN,
            max_model_len=2048,
            max_loras=len(adapter_dirs),
            max_lora_rank=RANK,
        )
    )
    runner = engine.runner
    log(f"engine loaded in {time.perf_counter() - started:.1f} s")
    store = AdapterStore(engine.model_config, RANK, runner.dtype, capacity=len(adapter_dirs))
    started = time.perf_counter()
    adapters = [store.load(f"bench-{i}", i, str(path)) for i, path in enumerate(adapter_dirs)]
    log(
        f"{len(adapters)} adapters read from disk in {time.perf_counter() - started:.2f} s "
        f"({adapters[0].nbytes / 1e6:.1f} MB each in the pool's layout)"
    )
    rng = random.Random(SEED)
    opts = SamplingOptions(max_tokens=100_000, ignore_eos=True)
    results = {}

    def timed_steps(num: int) -> float:
        _sync(device)
        start = time.perf_counter()
        for _ in range(num):
            engine.step()
        _sync(device)
        return (time.perf_counter() - start) / num * 1e3

    def row(name: str, num_adapters: int, eager: bool = False) -> None:
        for i in range(BATCH):
            adapter = adapters[i % num_adapters] if num_adapters else None
            engine.add_request(
                f"{name}-{i}",
                [rng.randrange(3, vocab) for _ in range(PROMPT_LEN)],
                opts,
                adapter=adapter,
            )
        load_started = time.perf_counter()
        while any(
            s.num_output_tokens == 0 for s in engine.scheduler.running + engine.scheduler.waiting
        ):
            engine.step()
        engine.step()  # the first pure decode step (captures the graphs the first time)
        _sync(device)
        first_s = time.perf_counter() - load_started
        graphs = runner.lora_graphs if num_adapters else runner.graphs
        saved = runner.graphs, runner.lora_graphs
        if eager:
            runner.graphs = runner.lora_graphs = None
            engine.step()  # Triton compiles the kernels' eager specializations (other strides) here, untimed
        wall = timed_steps(3 if eager else steps)
        runner.graphs, runner.lora_graphs = saved
        size = graphs.size_for(BATCH) if graphs is not None and not eager else None
        replay = gpu_ms(lambda: graphs.run(size), device) if size else float("nan")
        results[name] = dict(
            num_adapters=num_adapters,
            eager=eager,
            step_ms=wall,
            tok_s=BATCH / wall * 1e3,
            replay_gpu_ms=replay,
            prefill_and_first_step_s=first_s,
        )
        log(
            f"{name:<22} step {wall:7.2f} ms wall ({BATCH / wall * 1e3:8.0f} tok/s), graph replay {replay:.2f} ms GPU"
        )
        for seq in list(engine.scheduler.running):
            engine.abort_request(seq.request_id)

    row("0 adapters", 0)
    row("1 adapter", 1)
    row("8 adapters", 8)
    row("8 adapters, eager", 8, eager=True)
    results["pool"] = dict(
        loads=runner.lora_pool.num_loads,
        evictions=runner.lora_pool.num_evictions,
        pool_mb=runner.lora_pool.nbytes / 1e6,
    )
    results["graph_capture_s"] = {
        "base": runner.graphs.capture_seconds if runner.graphs else 0.0,
        "lora": runner.lora_graphs.capture_seconds if runner.lora_graphs else 0.0,
    }
    return results


def print_table(res: dict, shape: dict, copy_gbs: float) -> None:
    base_gb = decode_bytes(shape) / 1e9
    lora_gb = adapter_bytes(shape) / 1e9  # per distinct adapter
    base = res["rows"]["0 adapters"]["step_ms"]
    log("")
    log(
        f"| batch of {BATCH}, rank {RANK} | decode tok/s | step ms | graph replay ms GPU | LoRA MB read per step "
        f"| floor ms (weights / {copy_gbs:.0f} GB/s) | step / floor | vs 0 adapters |"
    )
    log("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, r in res["rows"].items():
        if not isinstance(r, dict) or "step_ms" not in r:
            continue
        extra = lora_gb * r["num_adapters"]
        floor = (base_gb + extra) / copy_gbs * 1e3
        log(
            f"| {name} | {r['tok_s']:.0f} | {r['step_ms']:.2f} | {r['replay_gpu_ms']:.2f} | {extra * 1e3:.0f} "
            f"| {floor:.2f} | {r['step_ms'] / floor:.2f} | {r['step_ms'] / base:.2f}x |"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="default: llama-3.1-8b on CUDA, tiny on CPU",
    )
    parser.add_argument(
        "--model-dir", default=None, help="where the checkpoint is (written if missing)"
    )
    parser.add_argument("--steps", type=int, default=30, help="decode steps timed per row")
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if on_cuda else "cpu")
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    shape = SHAPES[shape_name]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    scratch = (
        Path("/dev/shm")
        if on_cuda and Path("/dev/shm").is_dir()
        else Path(os.environ.get("TANDEM_HOME", "/tmp"))
    )
    model_dir = Path(args.model_dir or scratch / f"tandem-{shape_name}-bf16")
    log(
        f"# bench/lora.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
    )
    log(
        f"# device {torch.cuda.get_device_name(device) if on_cuda else 'cpu'}, torch {torch.__version__}, "
        f"shape {shape_name}, rank {RANK}, batch {BATCH}, prompts {PROMPT_LEN} tokens"
    )
    started = time.perf_counter()
    write_checkpoint(model_dir, shape, device)
    adapter_dirs = [
        write_adapter(scratch / f"tandem-lora-{shape_name}-r{RANK}-{i}", shape, SEED + i, device)
        for i in range(8)
    ]
    log(
        f"checkpoint and 8 adapters ready in {time.perf_counter() - started:.0f} s "
        f"({adapter_bytes(shape) / 1e6:.1f} MB of LoRA weights per adapter)"
    )
    res: dict = {
        "shape": shape_name,
        "decode_gb": decode_bytes(shape) / 1e9,
        "adapter_gb": adapter_bytes(shape) / 1e9,
        "copy_gbs": copy_bandwidth(device),
    }
    log(
        f"device copy {res['copy_gbs']:.0f} GB/s (read + write); base decode floor "
        f"{res['decode_gb'] / res['copy_gbs'] * 1e3:.2f} ms/step"
    )
    res["rows"] = run_rows(model_dir, adapter_dirs, device, shape["vocab_size"], args.steps)
    (out_dir / "lora.json").write_text(json.dumps(res, indent=1, default=str))
    print_table(res, shape, res["copy_gbs"])


if __name__ == "__main__":
    main()
