"""Serving speed of a Llama-3.1-8B-shaped model (issue 7's table), in one run beside its floors.

    python bench/serve.py                    # CUDA: the 8B shape, bf16, random weights
    python bench/serve.py --shape tiny       # CPU smoke run of the same script (numbers mean nothing)

1. Writes a Llama-3.1-8B-shaped bf16 checkpoint with random weights in Hugging Face format
   (what tandem's loader reads) unless it exists.
2. Measures the device copy bandwidth: a decode step must read the weights (15.0 GB for this
   shape), so weights / copy GB/s is the floor of one step.
3. Measures transformers' `generate` on the same checkpoint, warmed up (its first call per
   shape is 3-4x slower), at batch 1 and 64.
4. Profiles the engine in-process: per decode step the wall time, the GPU time of the replayed
   CUDA graph and of the sampler, an eager step, and the kernels of an eager step.
5. Serves the checkpoint through the router with the real client (one aggregated worker), then
   1 prefill + 1 decode worker, and prints each row of the table with its ratio to the floor
   and to transformers. Full output and worker logs go to $OUT (or --out).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import random
import shlex
import statistics
import sys
import tarfile
import time
import traceback
from datetime import datetime
from pathlib import Path

import torch

SEED = 0
SHAPES = {
    "llama-3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rope_theta=500000.0,
        rms_norm_eps=1e-5,
        rope_scaling={
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
            "rope_type": "llama3",
        },
    ),
    # Same structure, CPU-sized: checks that the script runs.
    "tiny": dict(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=4096,
        rope_theta=10000.0,
        rms_norm_eps=1e-5,
        rope_scaling=None,
    ),
}


def log(*args) -> None:
    print(*args, flush=True)


# -- 1. the checkpoint --------------------------------------------------------------------------
def write_checkpoint(out: Path, shape: dict, device: torch.device) -> Path:
    """Random bf16 weights in HF Llama format (sharded safetensors + index), a tokenizer, configs."""
    from safetensors.torch import save_file

    from tandem.engine.tiny_tokenizer import build_tiny_tokenizer

    if (out / "model.safetensors.index.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "bos_token_id": 1,
        "eos_token_id": 2,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "attention_bias": False,
        "mlp_bias": False,
        "use_cache": True,
        **shape,
    }
    if config["rope_scaling"] is None:
        del config["rope_scaling"]
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q_size = shape["num_attention_heads"] * shape["head_dim"]
    kv_size = shape["num_key_value_heads"] * shape["head_dim"]
    gen = torch.Generator(device).manual_seed(SEED)

    def randn(*dims, std):
        return (torch.randn(*dims, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    shards = [{"model.embed_tokens.weight": randn(vocab, hidden, std=1.0)}]
    for i in range(shape["num_hidden_layers"]):
        p = f"model.layers.{i}."
        layer = {
            p + "input_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            p + "post_attention_layernorm.weight": torch.ones(hidden, dtype=torch.bfloat16),
        }
        for name, rows in (("q", q_size), ("k", kv_size), ("v", kv_size)):
            layer[p + f"self_attn.{name}_proj.weight"] = randn(rows, hidden, std=hidden**-0.5)
        layer[p + "self_attn.o_proj.weight"] = randn(hidden, q_size, std=q_size**-0.5)
        layer[p + "mlp.gate_proj.weight"] = randn(inter, hidden, std=hidden**-0.5)
        layer[p + "mlp.up_proj.weight"] = randn(inter, hidden, std=hidden**-0.5)
        layer[p + "mlp.down_proj.weight"] = randn(hidden, inter, std=inter**-0.5)
        shards.append(layer)
    shards.append(
        {
            "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
            "lm_head.weight": randn(vocab, hidden, std=hidden**-0.5),
        }
    )
    weight_map = {}
    for index, shard in enumerate(shards):
        name = f"model-{index:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(out / name), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, name))
    build_tiny_tokenizer().save(str(out / "tokenizer.json"))
    for name, data in (
        ("config.json", config),
        ("generation_config.json", {"bos_token_id": 1, "eos_token_id": 2, "do_sample": False}),
        (
            "tokenizer_config.json",
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "pad_token": "<pad>",
            },
        ),
    ):
        (out / name).write_text(json.dumps(data, indent=2))
    (out / "model.safetensors.index.json").write_text(
        json.dumps({"metadata": {}, "weight_map": weight_map})
    )
    return out


def serving_engine_args(model_dir: Path, kv_cache_gb: float) -> list[str]:
    """The engine flags every served row uses (bench/split_one_gpu.py too)."""
    return [
        "--model",
        str(model_dir),
        "--dtype",
        "bfloat16",
        "--block-size",
        "16",
        "--max-model-len",
        "4096",
        "--max-num-seqs",
        "256",
        "--max-num-batched-tokens",
        "8192",
        "--kv-cache-gb",
        f"{kv_cache_gb:g}",
    ]


def decode_bytes(shape: dict) -> int:
    """Bytes a decode step must read: every weight but the embedding table (only its rows are read)."""
    hidden, inter, vocab = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"]
    q_size = shape["num_attention_heads"] * shape["head_dim"]
    kv_size = shape["num_key_value_heads"] * shape["head_dim"]
    per_layer = hidden * (q_size + 2 * kv_size) + q_size * hidden + 3 * hidden * inter + 2 * hidden
    return 2 * (shape["num_hidden_layers"] * per_layer + hidden + vocab * hidden)


# -- 2. the copy bandwidth ---------------------------------------------------------------------
def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large device-to-device copy, counting bytes read plus bytes written (median of 10)."""
    nbytes = (4 << 30) if device.type == "cuda" else (256 << 20)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    times = []
    for _ in range(12):
        _sync(device)
        start = time.perf_counter()
        dst.copy_(src)
        _sync(device)
        times.append(time.perf_counter() - start)
    del src, dst
    return 2 * nbytes / statistics.median(times[2:]) / 1e9


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# -- 3. transformers -------------------------------------------------------------------------
def transformers_rates(
    model_dir: Path, device: torch.device, vocab: int, batches=(1, 64), new_tokens=128
) -> dict:
    """Steady-state generate() tok/s per batch size (128-token prompts), after a warm-up call per shape."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16).to(device).eval()
    rates = {}
    rng = random.Random(SEED)
    for batch in batches:
        ids = torch.tensor(
            [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(batch)], device=device
        )
        kwargs = dict(attention_mask=torch.ones_like(ids), do_sample=False, pad_token_id=0)
        with torch.no_grad():
            # Warm-up with the very call that is timed: its first call per shape is 3-4x slower.
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            _sync(device)
            start = time.perf_counter()
            model.generate(ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, **kwargs)
            _sync(device)
        rates[batch] = batch * new_tokens / (time.perf_counter() - start)
        log(f"transformers generate bs{batch}: {rates[batch]:.1f} tok/s (steady, after warm-up)")
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return rates


# -- 4. the engine in-process ------------------------------------------------------------------
def gpu_ms(device: torch.device, fn, num: int = 20) -> float:
    """GPU milliseconds per call of fn (after one untimed call); nan off CUDA."""
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


def engine_profile(
    model_dir: Path, device: torch.device, vocab: int, batches=(1, 32, 64, 256)
) -> dict:
    """Per decode step: wall ms, GPU ms of the graph replay (its greedy draw included) and of an
    eager step's sampler (which makes that draw itself); an eager step for comparison; TTFT of a 2048-token prompt in-process; the kernels of an eager bs32 step."""
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    max_seqs = max(batches)
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype="bfloat16",
            kv_cache_memory_gb=30 if device.type == "cuda" else 0.5,
            max_num_seqs=max_seqs,
            max_num_batched_tokens=8192,
            max_model_len=4096,
        )
    )
    runner = engine.runner
    rng = random.Random(SEED)
    opts = SamplingOptions(max_tokens=4000, ignore_eos=True)
    results = {}

    def timed_steps(num):
        _sync(device)
        start = time.perf_counter()
        for _ in range(num):
            engine.step()
        _sync(device)
        return (time.perf_counter() - start) / num * 1e3

    for batch in batches:
        for i in range(batch):
            engine.add_request(f"p{batch}-{i}", [rng.randrange(3, vocab) for _ in range(128)], opts)
        while any(
            s.num_output_tokens == 0 for s in engine.scheduler.running + engine.scheduler.waiting
        ):
            engine.step()
        engine.step()
        wall = timed_steps(20)
        size = runner.graphs.size_for(batch) if runner.graphs else None
        replay = gpu_ms(device, lambda: runner.graphs.run(size)) if size else float("nan")
        seqs = engine.scheduler.running
        logits = torch.randn(batch, vocab, device=device)
        sample = gpu_ms(
            device,
            lambda: runner.sampler.sample(
                logits,
                [s.options for s in seqs],
                [0] * batch,
                [[]] * batch,
                [[]] * batch,
                [frozenset()] * batch,
            ),
        )
        graphs, runner.graphs = runner.graphs, None
        eager = timed_steps(3) if batch <= 64 else float("nan")
        runner.graphs = graphs
        results[batch] = dict(
            wall_ms=wall, replay_gpu_ms=replay, sample_gpu_ms=sample, eager_wall_ms=eager
        )
        log(
            f"engine bs{batch}: step {wall:.2f} ms wall, graph replay {replay:.2f} ms GPU, sampler {sample:.3f} ms "
            f"GPU, eager step {eager:.2f} ms wall"
        )
        if batch == 32 and device.type == "cuda":
            results["eager_bs32_kernels"] = _kernel_profile(engine, runner)
        for seq in list(engine.scheduler.running):
            engine.abort_request(seq.request_id)
    results["offline"] = _offline_in_process(engine, runner, rng, vocab)
    results["ttft_2048_ms"] = ttft_in_process(engine, rng, vocab)
    log(f"engine in-process TTFT, 2048 tokens: {results['ttft_2048_ms']:.1f} ms (best of 3)")
    results["graph_capture_s"] = runner.graphs.capture_seconds if runner.graphs else 0.0
    del engine, runner
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return results


def ttft_in_process(engine, rng, vocab, length: int = 2048) -> float:
    """Best of 3 ms from adding one fresh prompt of `length` tokens to its first token, in-process."""
    from tandem.engine.sampling_options import SamplingOptions

    device = engine.runner.device
    prompt = [rng.randrange(3, vocab) for _ in range(length)]
    ttfts = []
    for i in range(3):
        engine.add_request(f"ttft-{i}", [i + 3] + prompt[1:], SamplingOptions(max_tokens=1))
        _sync(device)
        start = time.perf_counter()
        while engine.num_unfinished:
            engine.step()
        ttfts.append((time.perf_counter() - start) * 1e3)
    return min(ttfts)


def _kernel_profile(engine, runner) -> list[tuple[str, float, int]]:
    """GPU time per kernel over 3 eager bs32 decode steps (a replayed graph hides its kernels)."""
    from torch.profiler import ProfilerActivity, profile

    graphs, runner.graphs = runner.graphs, None
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            engine.step()
        torch.cuda.synchronize()
    runner.graphs = graphs
    rows = []
    for event in prof.key_averages():
        total = getattr(event, "device_time_total", None) or getattr(event, "cuda_time_total", 0)
        if total > 0:
            rows.append((event.key[:60], total / 3 / 1e3, event.count // 3))
    rows.sort(key=lambda r: -r[1])
    log("kernels of one eager bs32 decode step (ms GPU, launches):")
    for name, ms, count in rows[:14]:
        log(f"  {ms:8.3f} ms  {count:5d}x  {name}")
    log(
        f"  total {sum(r[1] for r in rows):.3f} ms GPU in {sum(r[2] for r in rows)} kernel launches"
    )
    return rows[:30]


def _offline_in_process(
    engine, runner, rng, vocab, num=256, prompt_len=512, max_tokens=256
) -> dict:
    """The offline row's workload on the engine alone (no gRPC, no router): what serving it is
    held against. Its decode steps attend over 512-768 tokens each, 3-5x the context of the
    bs256 row above, so their GPU time is the replay measured here, once every request decodes."""
    from tandem.engine.sampling_options import SamplingOptions

    opts = SamplingOptions(max_tokens=max_tokens, ignore_eos=True)
    device = runner.device
    _sync(device)
    start = time.perf_counter()
    for i in range(num):
        engine.add_request(
            f"offline-{i}", [rng.randrange(3, vocab) for _ in range(prompt_len)], opts
        )
    last_first = replay = None
    generated = 0
    full_batch_ends: dict[
        int, float
    ] = {}  # step number -> its end, for the steps that ran the whole batch
    while engine.num_unfinished:
        generated += sum(len(o.new_token_ids) for o in engine.step())
        if last_first is not None and len(engine.scheduler.running) == num:
            full_batch_ends[engine.counters.num_steps] = time.perf_counter()
        if (
            last_first is None
            and not engine.scheduler.waiting
            and all(s.num_output_tokens for s in engine.scheduler.running)
        ):
            paused = time.perf_counter()
            batch = len(engine.scheduler.running)
            size = runner.graphs.size_for(batch) if runner.graphs else None
            replay = (
                gpu_ms(device, lambda: runner.graphs.run(size), num=5) if size else float("nan")
            )
            last_first = time.perf_counter()
            start += last_first - paused  # the replays are not the workload's
    _sync(device)
    wall = time.perf_counter() - start
    # The same estimate as the served row's: steps after the last first token (the replays' time left out).
    late_step_ms = (
        (time.perf_counter() - last_first) * 1e3 / (max_tokens - 1) if last_first else float("nan")
    )
    period = _median_period_ms(full_batch_ends)
    out = dict(
        tok_s=generated / wall,
        wall_s=wall,
        decode_step_ms=late_step_ms,
        replay_gpu_ms_full_batch=replay,
        full_batch_period_ms=period,
    )
    log(
        f"engine in-process offline {num} x {prompt_len}/{max_tokens}: {generated / wall:.0f} tok/s, wall {wall:.2f} s, "
        f"decode step after the last first token {late_step_ms:.2f} ms, graph replay at that point {replay:.2f} ms GPU, "
        f"full-batch step period {period:.2f} ms"
    )
    return out


# -- 5. serving ------------------------------------------------------------------------------
def _prompts(rng, num, length, vocab):
    return [[rng.randrange(3, vocab) for _ in range(length)] for _ in range(num)]


async def _run_requests(address, prompts, max_tokens, concurrent=True):
    from tandem.client import AsyncLLM, SamplingParams

    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    llm = await AsyncLLM(address)
    try:
        start = time.perf_counter()
        if concurrent:
            outs = await asyncio.gather(*(llm.generate_async(p, params) for p in prompts))
        else:
            outs = [await llm.generate_async(p, params) for p in prompts]
        return outs, time.perf_counter() - start
    finally:
        llm.close()


def _tpot_ms(out) -> float:
    n = len(out.outputs[0].token_ids)
    return (out.metrics.e2e_latency_s - out.metrics.time_to_first_token_s) / max(1, n - 1) * 1e3


def serve_rows(
    cluster_cls, engine_args, worker_device, vocab, rows, quick, log_dir, router_args=()
) -> dict:
    """Rows 1-5 and the aggregated half of row 6 through the router with one `both` worker."""
    rng = random.Random(SEED + 1)
    out = {}
    cluster = cluster_cls(
        roles=["both"],
        engine_args=engine_args,
        log_dir=log_dir / "aggregated",
        worker_args={"both-1": ["--device", worker_device]},
        router_args=list(router_args),
    )
    started = time.perf_counter()
    with contextlib.ExitStack() as stack:
        cluster.start(timeout=900)
        stack.callback(cluster.stop)
        log(f"aggregated cluster up in {time.perf_counter() - started:.0f} s")
        address = cluster.address
        asyncio.run(_run_requests(address, _prompts(rng, 4, 128, vocab), 16))  # warm-up
        out["kv_pool"] = _kv_pool(address)
        log(f"KV pool: {out['kv_pool']}")
        if "bs1" in rows:
            outs, _ = asyncio.run(
                _run_requests(address, _prompts(rng, 1, 128, vocab), 64 if quick else 256, False)
            )
            tpot = _tpot_ms(outs[0])
            out["bs1"] = dict(
                tok_s=1e3 / tpot, ms_step=tpot, ttft_ms=outs[0].metrics.time_to_first_token_s * 1e3
            )
            log(f"bs1 128/256: {out['bs1']['tok_s']:.1f} tok/s ({tpot:.2f} ms/step)")
        for name, num, prompt_len in (
            ("c32", 32, 128),
            ("c64", 64, 128),
            ("offline", 64 if quick else 256, 512),
        ):
            if name in rows:
                _step_stats(address)  # drain
                profilers = _profile(cluster, name, log_dir) if name == "offline" else []
                outs, wall = asyncio.run(
                    _run_requests(
                        address, _prompts(rng, num, prompt_len, vocab), 64 if quick else 256
                    )
                )
                for profiler in profilers:
                    profiler.wait()
                tokens = sum(len(o.outputs[0].token_ids) for o in outs)
                ttfts = sorted(o.metrics.time_to_first_token_s * 1e3 for o in outs)
                # Once the last request has its first token every request decodes: the step period
                # from there on is the serving decode step, to hold beside the in-process one.
                late_step_ms = (wall * 1e3 - ttfts[-1]) / (
                    max(len(o.outputs[0].token_ids) for o in outs) - 1
                )
                out[name] = dict(
                    tok_s=tokens / wall,
                    ms_step=statistics.median(_tpot_ms(o) for o in outs),
                    wall_s=wall,
                    ttft_median_ms=ttfts[len(ttfts) // 2],
                    ttft_max_ms=ttfts[-1],
                    decode_step_ms=late_step_ms,
                    **_step_stats(address, full_batch=num),
                )
                log(
                    f"{num} x {prompt_len}/256: {tokens / wall:.0f} tok/s, wall {wall:.2f} s, median TPOT "
                    f"{out[name]['ms_step']:.2f} ms, TTFT median {ttfts[len(ttfts) // 2]:.0f} / max {ttfts[-1]:.0f} ms, "
                    f"decode step after the last first token {late_step_ms:.2f} ms, the worker's full-batch step "
                    f"period {out[name].get('full_batch_period_ms', float('nan')):.2f} ms"
                )
        if "ttft" in rows:
            ttfts = []
            for prompt in _prompts(rng, 5, 2048, vocab):
                outs, _ = asyncio.run(_run_requests(address, [prompt], 1, False))
                ttfts.append(outs[0].metrics.time_to_first_token_s * 1e3)
            out["ttft"] = dict(ttft_ms=statistics.median(ttfts), all_ms=ttfts)
            log(
                f"TTFT 2048 tokens: median {statistics.median(ttfts):.1f} ms of {[round(t, 1) for t in ttfts]}"
            )
        if "split" in rows:
            out["aggregated_16"] = _split_workload(address, rng, vocab, quick)
            log(f"aggregated 16 x 1024/128: {out['aggregated_16']}")
    return out


def _profile(cluster, row: str, log_dir: Path) -> list:
    """py-spy (when on PATH) records the worker and the router through a row: where the host time
    of the serving path goes (raw stacks per thread, in the logs tarball)."""
    import shutil
    import subprocess

    spy = shutil.which("py-spy")
    if spy is None:
        return []
    log_dir.mkdir(parents=True, exist_ok=True)
    return [
        subprocess.Popen(
            [
                spy,
                "record",
                "-p",
                str(service.process.pid),
                "-d",
                "8",
                "-r",
                "100",
                "-f",
                "raw",
                "--threads",
                "--nonblocking",
                "-o",
                str(log_dir / f"py-spy-{row}-{service.name}.txt"),
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for service in (cluster.workers[0], cluster.router)
    ]


def _median_period_ms(ends: dict[int, float]) -> float:
    """Median ms between the ends (seconds, by step number) of consecutive steps that both count."""
    gaps = [(ends[step + 1] - end) * 1e3 for step, end in ends.items() if step + 1 in ends]
    return statistics.median(gaps) if gaps else float("nan")


def _step_stats(address, full_batch: int = 0) -> dict:
    """The worker's iteration stats since the last call: how many steps, and the median latency of the
    steps that ran the whole batch (launch to read-back: with overlap it spans parts of two periods)."""
    from tandem.client import LLM

    try:
        with LLM(address) as llm:
            stats = llm.get_stats(timeout=0.2)
    except Exception as exc:  # noqa: BLE001 - stats are a diagnosis, not the measurement
        return {"stats_error": str(exc)}
    full = [
        s
        for s in stats
        if s.get("inflightBatchingStats", {}).get("numScheduledRequests", 0) >= full_batch
    ]
    # The period between full-batch steps, from their records' times (iterLatencyMS, launch to
    # read-back, spans parts of two periods under overlap scheduling).
    ends = {
        s["iter"]: datetime.strptime(s["timestamp"], "%m-%d-%Y %H:%M:%S.%f").timestamp()
        for s in full
    }
    return {
        "steps": len(stats),
        "full_batch_latency_ms": statistics.median(s["iterLatencyMS"] for s in full)
        if full
        else None,
        "full_batch_period_ms": _median_period_ms(ends),
    }


def _kv_pool(address) -> dict:
    """What the worker's KV pool holds for its --kv-cache-gb (get_kv_cache_capacity): the FP8 KV
    cache's row compares it with bf16's."""
    from tandem.client import LLM

    try:
        with LLM(address) as llm:
            cap = llm.get_kv_cache_capacity()
    except Exception as exc:  # noqa: BLE001 - a diagnosis: the rows go on without it
        return {"kv_pool_error": str(exc)}
    return dict(max_num_blocks=cap["maxNumBlocks"], max_num_tokens=cap["maxNumTokens"])


def _split_workload(address, rng, vocab, quick) -> dict:
    outs, wall = asyncio.run(
        _run_requests(address, _prompts(rng, 16, 1024, vocab), 32 if quick else 128)
    )
    metrics = [o.metrics for o in outs]
    return dict(
        ttft_ms=statistics.median(m.time_to_first_token_s for m in metrics) * 1e3,
        tpot_ms=statistics.median(_tpot_ms(o) for o in outs),
        pull_ms=statistics.median(m.kv_transfer_s for m in metrics) * 1e3,
        pull_max_ms=max(m.kv_transfer_s for m in metrics) * 1e3,
        pull_mib=statistics.median(m.kv_transfer_bytes for m in metrics) / 2**20,
        wall_s=wall,
    )


def serve_split(
    cluster_cls, engine_args, prefill_device, decode_device, vocab, quick, log_dir
) -> dict:
    rng = random.Random(SEED + 2)
    cluster = cluster_cls(
        roles=["prefill", "decode"],
        engine_args=engine_args,
        log_dir=log_dir / "split",
        worker_args={
            "prefill-1": ["--device", prefill_device],
            "decode-1": ["--device", decode_device],
        },
    )
    with contextlib.ExitStack() as stack:
        cluster.start(timeout=900)
        stack.callback(cluster.stop)
        asyncio.run(
            _run_requests(cluster.address, _prompts(rng, 2, 1024, vocab), 8)
        )  # warm-up: peers, kernels
        one, _ = asyncio.run(
            _run_requests(cluster.address, _prompts(rng, 1, 1024, vocab), 8, False)
        )
        result = _split_workload(cluster.address, rng, vocab, quick)
        result["pull_alone_ms"] = one[0].metrics.kv_transfer_s * 1e3
    log(f"split 16 x 1024/128 ({prefill_device} -> {decode_device}): {result}")
    return result


# -- the table -------------------------------------------------------------------------------
GOALS = {
    "bs1": ">= 230 tok/s",
    "c32": ">= 5,000 tok/s",
    "c64": ">= 8,000 tok/s",
    "offline": ">= 12,000 tok/s",
    "ttft": "<= 45 ms",
    "split": "TPOT <= aggregated; pull <= 1.5x NIXL",
}


def print_table(res: dict, floor_ms: float, hf: dict) -> None:
    serve = res.get("serve", {})
    log("")
    log(
        f"floor: a decode step reads {res['decode_gb']:.2f} GB / {res['copy_gbs']:.0f} GB/s copy = {floor_ms:.2f} ms"
    )
    log(f"{'workload':<34}{'tandem':>22}{'x floor':>10}{'transformers':>16}{'x hf':>8}   goal")

    def row(name, label, value, unit, floor_value, hf_value):
        if name not in serve:
            log(f"{label:<34}{'not run':>22}")
            return
        ratio = f"{value / floor_value:.2f}" if floor_value else "-"
        hf_text = f"{hf_value:,.0f} tok/s" if hf_value else "-"
        hf_ratio = f"{value / hf_value:.2f}" if hf_value else "-"
        log(
            f"{label:<34}{f'{value:,.1f} {unit}':>22}{ratio:>10}{hf_text:>16}{hf_ratio:>8}   {GOALS[name]}"
        )

    for name, label, batch in (
        ("bs1", "decode bs1, 128/256", 1),
        ("c32", "32 concurrent, 128/256", 32),
        ("c64", "64 concurrent, 128/256", 64),
        ("offline", "offline 256 x 512/256", 256),
    ):
        if name in serve:
            row(name, label, serve[name]["tok_s"], "tok/s", batch * 1e3 / floor_ms, hf.get(batch))
        else:
            row(name, label, 0, "", 0, None)
    offline = res.get("profile", {}).get("offline")
    if offline and "offline" in serve:
        log(
            f"{'  offline, the engine alone':<34}{offline['tok_s']:>16,.1f} tok/s   served / alone "
            f"{serve['offline']['tok_s'] / offline['tok_s']:.2f}; decode step {serve['offline']['decode_step_ms']:.2f} ms "
            f"served, {offline['decode_step_ms']:.2f} alone, replay {offline['replay_gpu_ms_full_batch']:.2f} ms GPU; "
            f"full-batch step period {serve['offline'].get('full_batch_period_ms', float('nan')):.2f} ms served (worker "
            f"stats), {offline.get('full_batch_period_ms', float('nan')):.2f} alone"
        )
    if "ttft" in serve:
        log(
            f"{'TTFT one 2048-token prompt':<34}{serve['ttft']['ttft_ms']:>19.1f} ms{'-':>10}{'-':>16}{'-':>8}   "
            f"{GOALS['ttft']}"
        )
    split, agg = res.get("split"), serve.get("aggregated_16")
    if split and agg:
        log(
            f"{'split 1P+1D, 16 x 1024/128':<34} TTFT {split['ttft_ms']:.0f} ms, TPOT {split['tpot_ms']:.1f} ms, "
            f"pull {split['pull_ms']:.2f} ms ({split['pull_mib']:.0f} MiB; alone {split['pull_alone_ms']:.2f} ms)"
        )
        log(
            f"{'  aggregated, same workload':<34} TTFT {agg['ttft_ms']:.0f} ms, TPOT {agg['tpot_ms']:.1f} ms   "
            f"{GOALS['split']}"
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
    parser.add_argument("--device", default=None, help="default cuda:0 (cpu without CUDA)")
    parser.add_argument(
        "--decode-device",
        default=None,
        help="the split's decode worker (default: cuda:1 if present)",
    )
    parser.add_argument("--phases", default="transformers,profile,serve,split")
    parser.add_argument("--rows", default="bs1,c32,c64,offline,ttft,split")
    parser.add_argument("--quick", action="store_true", help="fewer tokens per row (smoke runs)")
    parser.add_argument(
        "--stream-interval",
        type=int,
        default=1,
        help="the router's --stream-interval for rows 1-5 (tokens per message to a client)",
    )
    parser.add_argument("--out", default=os.environ.get("OUT", "bench-out"))
    parser.add_argument(
        "--engine-extra",
        default="",
        help="engine flags added to every served row, e.g. '--quantization fp8 --kv-cache-dtype fp8'",
    )
    args = parser.parse_args()

    on_cuda = torch.cuda.is_available()
    device = torch.device(args.device or ("cuda:0" if on_cuda else "cpu"))
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    shape = SHAPES[shape_name]
    out_dir = Path(args.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    shm = (
        Path("/dev/shm")
        if Path("/dev/shm").is_dir() and on_cuda
        else Path(os.environ.get("TANDEM_HOME", "/tmp"))
    )
    model_dir = Path(args.model_dir or shm / f"tandem-{shape_name}-bf16")
    phases, rows = set(args.phases.split(",")), set(args.rows.split(","))
    decode_device = args.decode_device or (
        "cuda:1" if torch.cuda.device_count() > 1 else str(device)
    )
    log(
        f"# bench/serve.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}"
    )
    log(
        f"# device {torch.cuda.get_device_name(device) if on_cuda else 'cpu'} x{torch.cuda.device_count()}, "
        f"torch {torch.__version__}, shape {shape_name}, checkpoint {model_dir}"
    )

    res: dict = {"shape": shape_name, "decode_gb": decode_bytes(shape) / 1e9}
    started = time.perf_counter()
    write_checkpoint(model_dir, shape, device)
    log(f"checkpoint ready in {time.perf_counter() - started:.0f} s")
    res["copy_gbs"] = copy_bandwidth(device)
    floor_ms = res["decode_gb"] / res["copy_gbs"] * 1e3
    log(
        f"device copy {res['copy_gbs']:.0f} GB/s (read + write); decode floor {floor_ms:.2f} ms/step"
    )

    def phase(name, fn):
        if name not in phases:
            return
        try:
            res[name] = fn()
        except Exception:  # noqa: BLE001 - one failed phase must not cost the others
            log(f"phase {name} failed:\n{traceback.format_exc()}")
        (out_dir / "serve.json").write_text(json.dumps(res, indent=1, default=str))

    from tandem.testing.cluster import LocalCluster

    extra = shlex.split(args.engine_extra)
    engine_args = serving_engine_args(model_dir, 28 if on_cuda else 0.5) + extra
    log_dir = Path("/tmp/tandem-serve-logs")
    phase("transformers", lambda: transformers_rates(model_dir, device, shape["vocab_size"]))
    phase("profile", lambda: engine_profile(model_dir, device, shape["vocab_size"]))
    router_args = (
        ["--stream-interval", str(args.stream_interval)] if args.stream_interval > 1 else []
    )
    phase(
        "serve",
        lambda: serve_rows(
            LocalCluster,
            engine_args,
            str(device),
            shape["vocab_size"],
            rows,
            args.quick,
            log_dir,
            router_args,
        ),
    )
    split_args = serving_engine_args(model_dir, 10 if on_cuda else 0.5) + extra
    if "split" in rows:
        phase(
            "split",
            lambda: serve_split(
                LocalCluster,
                split_args,
                str(device),
                decode_device,
                shape["vocab_size"],
                args.quick,
                log_dir,
            ),
        )
    if log_dir.is_dir():
        with tarfile.open(out_dir / "serve-logs.tar.gz", "w:gz") as tar:
            tar.add(log_dir, arcname="logs")
    print_table(res, floor_ms, res.get("transformers") or {})


if __name__ == "__main__":
    main()
