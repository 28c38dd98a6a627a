"""The fused MoE kernel (kernels/moe_triton.py) against its torch reference (kernels/moe.py).

    python bench/moe.py --device cuda                  # Qwen3-30B-A3B's MoE layer shape
    python bench/moe.py --device cpu --shape small     # interpreter, small shapes; numbers mean little
    python bench/moe.py --device cuda --served-layers 4  # also a served Qwen3-MoE-shaped engine row

1. One MoE layer at Qwen3-30B-A3B's shape (hidden 2048, 128 experts, top-8, moe_intermediate
   768, bf16; routing from random router logits, renormalised) for 1..1024 tokens: ms per call
   of the Triton path (routing tiles + two grouped GEMMs + the per-token sum), eager and replayed
   as a CUDA graph, and of the torch reference; the floor is the expert weights the call
   actually touches (experts hit x 3 x I x H x 2 bytes) over the device copy rate measured in the
   same run; max |triton - reference| beside.
2. --served-layers N: an engine (LLMEngine, in process) on a random Qwen3-MoE checkpoint of
   that layer shape cut to N layers: decode step ms at batch 1 and 32 against the floor of
   every weight it reads per step.
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

SEED = 0
SHAPES = {
    "qwen3-30b-a3b": dict(hidden=2048, experts=128, top_k=8, inter=768),
    "small": dict(hidden=128, experts=16, top_k=4, inter=64),
}
TOKENS = {"qwen3-30b-a3b": (1, 16, 64, 256, 1024), "small": (1, 16, 64)}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _ms(device: torch.device, fn, num: int) -> float:
    """ms per call after one untimed call: CUDA events on a GPU, the wall clock on the CPU."""
    fn()
    _sync(device)
    if device.type == "cuda":
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        for _ in range(num):
            fn()
        end.record()
        end.synchronize()
        return begin.elapsed_time(end) / num
    start = time.perf_counter()
    for _ in range(num):
        fn()
    return (time.perf_counter() - start) / num * 1e3


def _graph_ms(device: torch.device, fn, num: int) -> float:
    """ms per replay of fn captured as a CUDA graph (nan off CUDA): also proves it captures."""
    if device.type != "cuda":
        return float("nan")
    stream = torch.cuda.Stream(device)
    stream.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(stream):
        fn()  # warm-up compiles outside the capture
    torch.cuda.current_stream(device).wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return _ms(device, graph.replay, num)


def copy_bandwidth(device: torch.device) -> float:
    """GB/s of a large device copy, bytes read plus bytes written (median of 10)."""
    nbytes = (2 << 30) if device.type == "cuda" else (128 << 20)
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
    return 2 * nbytes / sorted(times[2:])[len(times[2:]) // 2] / 1e9


def kernel_rows(device, shape: dict, tokens: tuple[int, ...], dtype, copy_gbs: float) -> None:
    from tandem.kernels import moe as reference
    from tandem.kernels import moe_triton

    hidden, experts, top_k, inter = (shape[k] for k in ("hidden", "experts", "top_k", "inter"))
    gen = torch.Generator(device).manual_seed(SEED)
    w_gate_up = (
        torch.randn(experts, 2 * inter, hidden, generator=gen, device=device) * hidden**-0.5
    ).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, generator=gen, device=device) * inter**-0.5).to(
        dtype
    )
    expert_bytes = 3 * inter * hidden * w_down.element_size()
    num = 20 if device.type == "cuda" else 2
    print(
        f"MoE layer: hidden {hidden}, {experts} experts, top-{top_k}, moe_intermediate {inter}, "
        f"{dtype}; floor = experts touched x {expert_bytes / 1e6:.2f} MB / copy rate"
    )
    print(
        f"  {'tokens':>6}{'experts hit':>12}{'MB touched':>11}{'floor ms':>9}{'triton ms':>10}"
        f"{'x floor':>8}{'graph ms':>9}{'x floor':>8}{'torch ms':>9}{'speed-up':>9}{'max diff':>10}"
    )
    for num_tokens in tokens:
        x = torch.randn(num_tokens, hidden, generator=gen, device=device).to(dtype)
        logits = torch.randn(num_tokens, experts, generator=gen, device=device)
        weights, ids = reference.route(logits, top_k, renormalize=True)
        hit = int(torch.unique(ids).numel())
        touched = hit * expert_bytes
        floor_ms = touched / copy_gbs / 1e6
        fused = lambda: moe_triton.fused_moe(x, w_gate_up, w_down, weights, ids)  # noqa: E731
        torch_fn = lambda: reference.fused_moe(x, w_gate_up, w_down, weights, ids)  # noqa: E731
        diff = (fused().float() - torch_fn().float()).abs().max().item()
        triton_ms = _ms(device, fused, num)
        graph_ms = _graph_ms(device, fused, num)
        torch_ms = _ms(device, torch_fn, max(2, num // 4))
        print(
            f"  {num_tokens:>6}{hit:>12}{touched / 1e6:>11.1f}{floor_ms:>9.3f}{triton_ms:>10.3f}"
            f"{triton_ms / floor_ms:>8.2f}{graph_ms:>9.3f}{graph_ms / floor_ms:>8.2f}"
            f"{torch_ms:>9.3f}{torch_ms / triton_ms:>9.2f}{diff:>10.2e}"
        )


def write_served_checkpoint(out: Path, shape: dict, num_layers: int, device) -> tuple[Path, int]:
    """A random bf16 Qwen3-MoE checkpoint of the layer shape, num_layers deep; (dir, weight bytes)."""
    from safetensors.torch import save_file

    from tandem.engine.tiny_tokenizer import build_tiny_tokenizer

    hidden, experts, top_k, inter = (shape[k] for k in ("hidden", "experts", "top_k", "inter"))
    heads, kv_heads, head_dim, vocab = 32, 4, 128, 151936
    config = {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": vocab,
        "hidden_size": hidden,
        "intermediate_size": 6144,
        "moe_intermediate_size": inter,
        "num_experts": experts,
        "num_experts_per_tok": top_k,
        "norm_topk_prob": True,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "num_hidden_layers": num_layers,
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "max_position_embeddings": 40960,
        "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "bos_token_id": 1,
        "eos_token_id": 2,
    }
    gen = torch.Generator(device).manual_seed(SEED)

    def randn(*dims, std):
        return (torch.randn(*dims, generator=gen, device=device) * std).to(torch.bfloat16).cpu()

    tensors = {
        "model.embed_tokens.weight": randn(vocab, hidden, std=1.0),
        "lm_head.weight": randn(vocab, hidden, std=hidden**-0.5),
        "model.norm.weight": torch.ones(hidden, dtype=torch.bfloat16),
    }
    for i in range(num_layers):
        p = f"model.layers.{i}."
        for name in ("input_layernorm", "post_attention_layernorm"):
            tensors[p + name + ".weight"] = torch.ones(hidden, dtype=torch.bfloat16)
        for name in ("q_norm", "k_norm"):
            tensors[p + f"self_attn.{name}.weight"] = torch.ones(head_dim, dtype=torch.bfloat16)
        for name, rows in (("q", heads), ("k", kv_heads), ("v", kv_heads)):
            tensors[p + f"self_attn.{name}_proj.weight"] = randn(
                rows * head_dim, hidden, std=hidden**-0.5
            )
        tensors[p + "self_attn.o_proj.weight"] = randn(
            hidden, heads * head_dim, std=(heads * head_dim) ** -0.5
        )
        tensors[p + "mlp.gate.weight"] = randn(experts, hidden, std=hidden**-0.5)
        for e in range(experts):
            q = p + f"mlp.experts.{e}."
            tensors[q + "gate_proj.weight"] = randn(inter, hidden, std=hidden**-0.5)
            tensors[q + "up_proj.weight"] = randn(inter, hidden, std=hidden**-0.5)
            tensors[q + "down_proj.weight"] = randn(hidden, inter, std=inter**-0.5)
    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())
    if not (out / "model.safetensors").is_file():
        out.mkdir(parents=True, exist_ok=True)
        (out / "config.json").write_text(json.dumps(config, indent=2))
        save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
        build_tiny_tokenizer().save(str(out / "tokenizer.json"))
    return out, nbytes


def served_rows(device, shape: dict, num_layers: int, copy_gbs: float) -> None:
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.sampling_options import SamplingOptions

    base = Path("/dev/shm") if device.type == "cuda" else Path("/tmp")
    model_dir, nbytes = write_served_checkpoint(
        base / f"tandem-qwen3-moe-{num_layers}l", shape, num_layers, device
    )
    engine = LLMEngine(
        EngineConfig(
            str(model_dir),
            device=str(device),
            dtype="bfloat16",
            kv_cache_memory_gb=4 if device.type == "cuda" else 0.5,
            max_num_seqs=32,
            max_num_batched_tokens=4096,
            max_model_len=2048,
            enable_prefix_caching=False,
            max_loras=0,
        )
    )
    hidden, experts, top_k, inter = (shape[k] for k in ("hidden", "experts", "top_k", "inter"))
    expert_bytes = 3 * inter * hidden * 2
    embedding_bytes = engine.model_config.vocab_size * hidden * 2  # a step reads a few rows
    dense_bytes = nbytes - num_layers * experts * expert_bytes - embedding_bytes
    rng = random.Random(SEED)
    print(
        f"served Qwen3-MoE-shaped engine, {num_layers} layers, {nbytes / 1e9:.2f} GB of weights "
        f"(floor = attention, norms and LM head + the experts a step touches, "
        f"~min(batch x {top_k}, {experts}) a layer, / copy rate):"
    )
    print(f"  {'batch':>6}{'step ms':>9}{'floor ms':>9}{'x floor':>8}{'tok/s':>9}")
    for batch in (1, 32):
        for i in range(batch):
            prompt = [rng.randrange(3, 300) for _ in range(64)]
            engine.add_request(
                f"b{batch}-{i}", prompt, SamplingOptions(max_tokens=1000, ignore_eos=True)
            )
        for _ in range(3):  # prefill, then decode steps (graphs captured at start-up)
            engine.step()
        num = 20
        _sync(device)
        start = time.perf_counter()
        for _ in range(num):
            engine.step()
        _sync(device)
        step_ms = (time.perf_counter() - start) / num * 1e3
        hit = min(batch * top_k, experts)
        floor_ms = (dense_bytes + num_layers * hit * expert_bytes) / copy_gbs / 1e6
        print(
            f"  {batch:>6}{step_ms:>9.2f}{floor_ms:>9.3f}{step_ms / floor_ms:>8.2f}"
            f"{batch / step_ms * 1e3:>9.1f}"
        )
        for seq in list(engine.scheduler.running):
            engine.abort_request(seq.request_id)
        while engine.num_unfinished:
            engine.step()
    engine.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None)
    parser.add_argument("--shape", choices=sorted(SHAPES), default=None)
    parser.add_argument("--tokens", default=None, help="comma-separated token counts")
    parser.add_argument("--served-layers", type=int, default=0, help="0: no served row")
    args = parser.parse_args()
    on_cuda = (args.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    if not on_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at import
    device = torch.device("cuda:0" if on_cuda else "cpu")
    shape_name = args.shape or ("qwen3-30b-a3b" if on_cuda else "small")
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else TOKENS[shape_name]
    torch.manual_seed(SEED)
    copy_gbs = copy_bandwidth(device)
    print(
        f"# bench/moe.py {' '.join(sys.argv[1:])}; {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}; "
        f"{torch.cuda.get_device_name(device) if on_cuda else 'cpu (Triton interpreter)'}; "
        f"copy {copy_gbs:.0f} GB/s (read + write)"
    )
    dtype = torch.bfloat16
    kernel_rows(device, SHAPES[shape_name], tokens, dtype, copy_gbs)
    if args.served_layers:
        served_rows(device, SHAPES[shape_name], args.served_layers, copy_gbs)


if __name__ == "__main__":
    main()
