"""Small-batch decode with the next GEMM's weights prefetched into L2 (weight_prefetch.py), against the floor.

    python bench/l2_prefetch.py               # CUDA: the 8B shape (checkpoint written by serve.py's writer)
    python bench/l2_prefetch.py --shape tiny  # CPU smoke run (no graphs, no prefetch; numbers mean nothing)

1. Pairs, one CUDA graph each over 8 layers' worth of distinct weights (so L2 holds nothing
   between replays): GEMM A, a light stretch (torch.cuda._sleep, standing for rotary +
   attention or a norm), GEMM B; with and without B's weight prefetched on a side stream
   after A. Printed: B's time inside the pair (pair minus A and the sleep alone).
2. The engine on the 8B checkpoint: decode graphs recaptured per plan, each batch size's
   graph replay timed (GPU ms) and its step (wall ms), beside the floor (weights / copy rate),
   and the greedy tokens of every plan checked equal to the plan without prefetches.
"""
from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
import serve  # noqa: E402 - the checkpoint writer, copy rate and timers live there

PLANS = ("off", "o_proj=1", "o_proj=1,mode=bulk", "o_proj=1,gate_up_proj=0.15,down_proj=0.25,qkv_proj=0.3",
         "o_proj=1,gate_up_proj=0.15,down_proj=0.25,qkv_proj=0.3,mode=bulk")
GEMMS = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}
# (A, light stretch in us, B): the windows of a decode layer at batch 1
PAIRS = (("qkv", 8, "o"), ("o", 2, "gate_up"), ("gate_up", 2, "down"), ("down", 2, "qkv"))


def _graph_ms(fn, device) -> float:
    fn()
    torch.cuda.synchronize(device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return serve.gpu_ms(device, graph.replay, num=50)


def pair_rows(device: torch.device, rows: int, copy_gbs: float) -> None:
    from tandem.kernels.prefetch_triton import prefetch_l2
    gen = torch.Generator(device).manual_seed(serve.SEED)
    copies = 8
    weights = {name: [torch.randn(*shape, generator=gen, device=device, dtype=torch.bfloat16)
                      for _ in range(copies)] for name, shape in GEMMS.items()}
    x = {name: torch.randn(rows, shape[1], generator=gen, device=device, dtype=torch.bfloat16)
         for name, shape in GEMMS.items()}
    cycles_per_us = 1e6 / 1e3 / serve.gpu_ms(device, lambda: torch.cuda._sleep(1_000_000), num=5)
    print(f"L2 {torch.cuda.get_device_properties(device).L2_cache_size / 2**20:.0f} MiB; "
          f"sleep kernel {cycles_per_us:.0f} cycles/us")
    side = torch.cuda.Stream(device=device)
    print(f"GEMM pairs at {rows} row(s), {copies} copies per graph (ms per pair; B = pair - A - sleep):")
    print(f"  {'A -> B':<18}{'sleep us':>9}{'A alone':>9}{'B alone':>9}{'B x copy':>9}" +
          "".join(f"{m + ' B':>12}{'x copy':>8}" for m in ("prefetch", "bulk")))

    for a, sleep_us, b in PAIRS:
        cycles = int(sleep_us * cycles_per_us)

        def run(which, prefetch_mode=None):
            def fn():
                for i in range(copies):
                    if "A" in which:
                        F.linear(x[a], weights[a][i])
                    if prefetch_mode:
                        side.wait_stream(torch.cuda.current_stream())
                        with torch.cuda.stream(side):
                            prefetch_l2(weights[b][i], 1.0, prefetch_mode)
                    if "S" in which:
                        torch.cuda._sleep(cycles)
                    if "B" in which:
                        F.linear(x[b], weights[b][i])
                if prefetch_mode:
                    torch.cuda.current_stream().wait_stream(side)
            return _graph_ms(fn, device) / copies

        a_ms, s_ms, b_ms = run("A"), run("S"), run("B")
        line = f"  {a + ' -> ' + b:<18}{sleep_us:9d}{a_ms:9.4f}{b_ms:9.4f}{_x_copy(weights[b][0], b_ms, copy_gbs):9.2f}"
        for mode in ("line", "bulk"):
            b_in_pair = run("ASB", mode) - a_ms - s_ms
            line += f"{b_in_pair:12.4f}{_x_copy(weights[b][0], b_in_pair, copy_gbs):8.2f}"
        no_prefetch = run("ASB") - a_ms - s_ms
        print(line + f"   (B in the pair without prefetch {no_prefetch:.4f})")


def _x_copy(weight: torch.Tensor, ms: float, copy_gbs: float) -> float:
    return weight.numel() * weight.element_size() / ms / 1e6 / copy_gbs


def engine_rows(model_dir: Path, device: torch.device, vocab: int, floor_ms: float, batches, plans) -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions
    from tandem.engine.weight_prefetch import PrefetchPlan
    engine = LLMEngine(EngineConfig(str(model_dir), device=str(device), dtype="bfloat16",
                                    kv_cache_memory_gb=8 if device.type == "cuda" else 0.5,
                                    max_num_seqs=max(batches), max_num_batched_tokens=4096, max_model_len=4096))
    runner, model = engine.runner, engine.runner.model
    rng = random.Random(serve.SEED)
    prompts = {b: [[rng.randrange(3, vocab) for _ in range(128)] for _ in range(b)] for b in batches}
    greedy_prompt = [rng.randrange(3, vocab) for _ in range(64)]
    print(f"engine decode steps per plan (floor {floor_ms:.2f} ms/step = weights / copy rate):")
    print(f"  {'plan':<66}{'batch':>6}{'replay ms':>11}{'x floor':>9}{'step ms':>9}{'tok/s':>9}  greedy")
    baseline_tokens = None
    for plan_text in plans:
        model.prefetcher.plan = PrefetchPlan.parse(plan_text, max_rows=max(batches))
        if runner.graphs is not None:
            runner.graphs.clear()
            runner.graphs.capture()
        greedy = engine_greedy(engine, greedy_prompt)
        if baseline_tokens is None:
            baseline_tokens = greedy
        same = "same" if greedy == baseline_tokens else "DIFFERENT"
        for batch in batches:
            for i, prompt in enumerate(prompts[batch]):
                engine.add_request(f"{plan_text}-{batch}-{i}", prompt, SamplingOptions(max_tokens=4000, ignore_eos=True))
            while any(s.num_output_tokens == 0 for s in engine.scheduler.running + engine.scheduler.waiting):
                engine.step()
            engine.step()
            serve._sync(device)
            start = time.perf_counter()
            for _ in range(20):
                engine.step()
            serve._sync(device)
            step_ms = (time.perf_counter() - start) / 20 * 1e3
            size = runner.graphs.size_for(batch) if runner.graphs else None
            replay = serve.gpu_ms(device, lambda: runner.graphs.run(size), num=50) if size else float("nan")
            print(f"  {plan_text:<66}{batch:6d}{replay:11.3f}{replay / floor_ms:9.2f}{step_ms:9.2f}"
                  f"{batch * 1e3 / step_ms:9.0f}  {same}")
            for seq in list(engine.scheduler.running):
                engine.abort_request(seq.request_id)


def engine_greedy(engine, prompt) -> list[int]:
    """The greedy tokens of one prompt, run alone through the engine (decode steps replay graphs)."""
    from tandem.engine.sampling_options import SamplingOptions
    engine.add_request("greedy-check", prompt, SamplingOptions(max_tokens=32, ignore_eos=True))
    seq = next(s for s in engine.scheduler.waiting + engine.scheduler.running if s.request_id == "greedy-check")
    while engine.num_unfinished:
        engine.step()
    return list(seq.output_token_ids)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=sorted(serve.SHAPES), default=None)
    parser.add_argument("--model-dir", default=None)
    parser.add_argument("--batches", default="1,2,4,8")
    parser.add_argument("--plans", default=";".join(PLANS), help="';'-separated TANDEM_L2_PREFETCH plans")
    parser.add_argument("--skip-pairs", action="store_true")
    args = parser.parse_args()
    on_cuda = torch.cuda.is_available()
    device = torch.device("cuda:0" if on_cuda else "cpu")
    shape_name = args.shape or ("llama-3.1-8b" if on_cuda else "tiny")
    shape = serve.SHAPES[shape_name]
    base = Path("/dev/shm") if on_cuda else Path(os.environ.get("TANDEM_HOME", "/tmp"))
    model_dir = serve.write_checkpoint(Path(args.model_dir or base / f"tandem-{shape_name}-bf16"), shape, device)
    copy_gbs = serve.copy_bandwidth(device)
    floor_ms = serve.decode_bytes(shape) / 1e9 / copy_gbs * 1e3
    print(f"# bench/l2_prefetch.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
          f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu'}; copy {copy_gbs:.0f} GB/s (read + write)")
    if on_cuda and not args.skip_pairs:
        for rows in (1, 8):
            pair_rows(device, rows, copy_gbs)
    engine_rows(model_dir, device, shape["vocab_size"], floor_ms, [int(b) for b in args.batches.split(",")],
                args.plans.split(";"))


if __name__ == "__main__":
    main()
