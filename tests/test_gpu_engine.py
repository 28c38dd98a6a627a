"""The GPU engine on a GPU: decode CUDA graphs and GPU sampling give the eager path's and
transformers' greedy tokens, the Triton kernels match their references on real shapes, and a
worker's engine runs on its own device from any thread.

Skipped without CUDA (CI has no GPU; the CPU runs the same code paths in test_model_runner.py,
test_sampler.py and test_fused_kernels.py). Run it in its own pytest process: the interpreter
tests set TRITON_INTERPRET for the whole session.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

from conftest import run_to_completion  # noqa: E402

from tandem.engine.config import EngineConfig  # noqa: E402
from tandem.engine.llm_engine import LLMEngine  # noqa: E402
from tandem.engine.sampler import Sampler  # noqa: E402
from tandem.engine.sampling_options import SamplingOptions  # noqa: E402
from tandem.kernels import fused  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402


def _engine(model_dir, device="cuda", **kwargs) -> LLMEngine:
    config = dict(block_size=16, num_blocks=256, max_num_seqs=16, max_num_batched_tokens=512)
    config.update(kwargs)
    return LLMEngine(EngineConfig(str(model_dir), device=device, **config))


def _hf_greedy(model_dir, prompts, max_new_tokens, eos) -> dict:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda().eval()
    out = {}
    for rid, ids in prompts.items():
        with torch.no_grad():
            tokens = model.generate(
                torch.tensor([ids], device="cuda"),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long, device="cuda"),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=eos,
            )[0, len(ids) :].tolist()
        out[rid] = tokens[: tokens.index(eos) + 1] if eos in tokens else tokens
    return out


@pytest.mark.parametrize("model", ["llama", "qwen2", "qwen3"])
def test_graphs_and_gpu_sampling_match_eager_and_transformers(model_dirs, model):
    rng = random.Random(3)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(3, 40))]
        for i in range(11)
    }
    greedy = {rid: SamplingOptions(max_tokens=24, eos_token_ids=(2,)) for rid in prompts}
    graphed = _engine(model_dirs[model])
    got = run_to_completion(graphed, prompts, greedy)
    assert graphed.runner.graphs.is_captured
    assert got == run_to_completion(_engine(model_dirs[model], enforce_eager=True), prompts, greedy)
    assert got == _hf_greedy(model_dirs[model], prompts, 24, eos=2)
    # Seeded sampling: the same tokens through graphs or eagerly, and on the CPU.
    seeded = {
        rid: SamplingOptions(max_tokens=12, ignore_eos=True, temperature=0.8, top_p=0.95, seed=i)
        for i, rid in enumerate(prompts)
    }
    on_gpu = run_to_completion(graphed, prompts, seeded)
    assert on_gpu == run_to_completion(
        _engine(model_dirs[model], enforce_eager=True), prompts, seeded
    )
    assert on_gpu == run_to_completion(_engine(model_dirs[model], device="cpu"), prompts, seeded)


@pytest.mark.parametrize("method", ["ngram", "suffix"])
def test_drafted_steps_in_graphs_match_plain_decoding(model_dirs, method):
    """Speculative decoding on the GPU in float32: drafted steps replay the decode graphs (each
    of k + 1 rows a decode query) and give plain decoding's tokens, greedy and seeded, with the
    graphs captured for the draft rows' ladder too."""
    import json

    from test_speculative import drafted_steps_in_graphs

    rng = random.Random(5)
    prompts = {}
    for i in range(10):
        phrase = [rng.randrange(4, 300) for _ in range(rng.randrange(3, 7))]
        prompts[f"r{i}"] = [1] + phrase * rng.randrange(2, 6)
    spec = json.dumps({"method": method, "num_speculative_tokens": 4, "prompt_lookup_min": 1})
    drafting = _engine(model_dirs["llama"], speculative_config=spec)
    in_graph = drafted_steps_in_graphs(drafting)
    for options in (
        SamplingOptions(max_tokens=32, ignore_eos=True),
        SamplingOptions(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7),
    ):
        got = run_to_completion(drafting, prompts, options)
        assert got == run_to_completion(_engine(model_dirs["llama"]), prompts, options)
    assert drafting.runner.graphs.is_captured and max(drafting.runner.graphs.sizes) > 16
    assert sum(in_graph) >= len(in_graph) // 2 > 0
    assert drafting.counters.num_accepted_draft_tokens > 0


def _outputs_with_logprobs(engine, prompts, options) -> dict[str, list[tuple[int, dict]]]:
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, options)
    outputs = {rid: [] for rid in prompts}
    while engine.num_unfinished:
        for out in engine.step():
            outputs[out.request_id] += list(zip(out.new_token_ids, out.new_logprobs))
    return outputs


def test_bf16_graphs_match_eager_under_batching_pressure(model_dirs):
    """Few blocks: preemption, chunked prefill and decode batches of changing sizes, in bf16. The graph's
    attention splits its keys differently from the eager launch, so bf16 sums may round apart: the
    streams must agree until a near-tie, where each side's token is in the other's top two (vLLM's
    check_logprobs_close), and most must agree to the end."""
    rng = random.Random(7)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(10, 60))]
        for i in range(12)
    }
    options = SamplingOptions(max_tokens=32, ignore_eos=True, logprobs=2)
    kwargs = dict(dtype="bfloat16", num_blocks=24, max_num_batched_tokens=64)
    graphed = _engine(model_dirs["llama"], **kwargs)
    got = _outputs_with_logprobs(graphed, prompts, options)
    want = _outputs_with_logprobs(
        _engine(model_dirs["llama"], enforce_eager=True, **kwargs), prompts, options
    )
    assert graphed.scheduler.num_preemptions > 0
    num_equal = 0
    for rid in prompts:
        for (token, top), (want_token, want_top) in zip(got[rid], want[rid]):
            if token != want_token:
                assert token in want_top and want_token in top, (
                    rid,
                    token,
                    want_token,
                    top,
                    want_top,
                )
                break
        else:
            num_equal += 1
    assert num_equal >= len(prompts) - 2


def test_sampler_on_gpu_draws_what_the_cpu_draws():
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(48, 5000, generator=gen) * 3
    options = [
        SamplingOptions(
            temperature=0.5 + (i % 4) / 4,
            top_k=(0, 50)[i % 2],
            top_p=(1.0, 0.9)[i % 3 == 0],
            seed=100 + i,
            logprobs=(None, 5)[i % 2],
        )
        for i in range(48)
    ]

    def run(device):
        sampler = Sampler(vocab_size=5000, max_rows=48, device=device)
        return sampler.sample(
            logits.to(device), options, list(range(48)), [[]] * 48, [[]] * 48, [frozenset()] * 48
        ).to_host()

    gpu, cpu = run("cuda"), run("cpu")
    assert gpu.token_ids == cpu.token_ids
    assert gpu.logprobs == pytest.approx(cpu.logprobs, abs=1e-4)
    for a, b in zip(gpu.top_logprobs, cpu.top_logprobs):
        assert (a is None) == (b is None) and (a is None or set(a) == set(b))


def test_greedy_draw_matches_torch_on_the_8b_vocabulary():
    """greedy_triton's two kernels against torch's logsumexp / argmax / gather at the Llama-3
    vocabulary, batch 1 to 256: the same ids (ties planted inside a chunk and across chunks), the
    log-probabilities and lse within float32 summation order."""
    from tandem.kernels import greedy, greedy_triton

    gen = torch.Generator("cuda").manual_seed(0)
    for rows in (1, 7, 256):
        logits = torch.randn(rows, 128256, generator=gen, device="cuda") * 4
        logits[0, [70000, 5, 2049]] = 60.0  # chunks 34, 0, 1: 5 wins
        if rows > 1:
            logits[1, [128255, 4097, 4096]] = 60.0  # 4096 wins, inside chunk 2
            logits[2, ::2] = float("-inf")
        ids, logprobs, lse = greedy_triton.greedy_draw(logits)
        want_ids, want_logprobs, want_lse = greedy.greedy_draw(logits)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(lse, want_lse, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(logprobs, want_logprobs, atol=1e-5, rtol=1e-5)
    assert ids[:2].tolist() == [5, 4096]


def _close_bf16(got, want):
    """Equal up to two bf16 rounding steps: a float32 sum in another order may round the statistic,
    and then the product with the weight, the other way."""
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=2**-6)


def test_fused_kernels_match_references_on_llama_8b_shapes():
    from tandem.kernels import fused_triton

    gen = torch.Generator("cuda").manual_seed(0)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).bfloat16()

    for tokens in (1, 64, 2048):
        x, residual, weight = randn(tokens, 4096), randn(tokens, 4096, std=4.0), randn(4096)
        for got, want in zip(
            fused_triton.add_rms_norm(x, residual, weight, 1e-5),
            fused.add_rms_norm(x, residual, weight, 1e-5),
        ):
            _close_bf16(got, want)
        _close_bf16(fused_triton.rms_norm(x, weight, 1e-5), fused.rms_norm(x, weight, 1e-5))
        gate_up = randn(tokens, 2 * 14336, std=2.0)
        _close_bf16(fused_triton.silu_and_mul(gate_up), fused.silu_and_mul(gate_up))
        qkv = randn(tokens, (32 + 16) * 128)
        q, k, v = (t.view(tokens, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
        positions = torch.randint(0, 8192, (tokens,), generator=gen, device="cuda")
        slots = (
            torch.randperm(64 * 16, generator=gen, device="cuda")[:tokens]
            if tokens <= 1024
            else torch.arange(tokens, device="cuda")
        )
        cache = randn(max(64, tokens // 16 + 1), 2, 2, 16, 8, 128)
        want_cache = cache.clone()
        inv_freq = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
        cos_sin = fused.rope_cos_sin(inv_freq, 8192, torch.bfloat16)
        got_q = fused_triton.rope_store_kv(q, k, v, positions, cos_sin, cache[:, 1], slots)
        want_q = fused.rope_store_kv(q, k, v, positions, cos_sin, want_cache[:, 1], slots)
        _close_bf16(got_q, want_q)
        _close_bf16(cache, want_cache)


def test_fresh_prompts_attention_matches_sdpa_on_llama_8b_shapes():
    """The fresh-prompt kernel (prefill_attention_triton.py) on the 8B layer's heads, key and
    value strided views of one qkv projection as the model has them, against SDPA per prompt in
    float32, with its default tiles and three other settings; and the rope kernel's
    rotated key is the key it stores."""
    import torch.nn.functional as F

    from tandem.kernels import fused_triton
    from tandem.kernels import prefill_attention_triton as fresh

    gen = torch.Generator("cuda").manual_seed(1)
    for lens in ([2048], [300, 700, 1024], [1, 17, 129, 5]):
        num = sum(lens)
        qkv = torch.randn(num, (32 + 16) * 128, generator=gen, device="cuda").bfloat16()
        q, k, v = (t.view(num, -1, 128) for t in qkv.split([32 * 128, 8 * 128, 8 * 128], dim=-1))
        q = q.contiguous()
        starts = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
        want, start = [], 0
        for n in lens:
            qs, ks, vs = (t[start : start + n].float().transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(4, 0), vs.repeat_interleave(4, 0)
            want.append(F.scaled_dot_product_attention(qs, ks, vs, is_causal=True).transpose(0, 1))
            start += n
        want = torch.cat(want)
        configs = [fresh.DEFAULT_CONFIG] + [
            fresh.FreshConfig(*tiles)
            for tiles in [(128, 64, 8, 3), (64, 32, 4, 3), (128, 128, 8, 3)]
        ]
        for config in configs:
            got = fresh.fresh_prefill_attention(
                q, k, v, starts.cuda(), max(lens), 128**-0.5, config
            )
            torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)
        positions = torch.arange(num, device="cuda")
        inv_freq = 1.0 / (500000 ** (torch.arange(0, 128, 2, device="cuda").float() / 128))
        cos_sin = fused.rope_cos_sin(inv_freq, 8192, torch.bfloat16)
        cache = torch.zeros(num // 16 + 1, 2, 16, 8, 128, dtype=torch.bfloat16, device="cuda")
        slots = torch.arange(num, device="cuda")
        rotated = torch.empty(num, 8, 128, dtype=torch.bfloat16, device="cuda")
        fused_triton.rope_store_kv(q, k, v, positions, cos_sin, cache, slots, (1.0, 1.0), rotated)
        assert torch.equal(rotated, cache[:, 0].flatten(0, 1)[:num])


def test_no_fresh_prompt_variant_compiles_after_the_warm_up(model_dirs):
    """The warm-up's prompt compiles the fresh-prompt kernel and the rope kernel that writes the
    rotated key out: prompts of any length and batch after it compile neither again. (bf16: on a
    GPU the fresh path runs for 2-byte dtypes only, prefill_attention_triton.tiled_on_gpu.)"""
    from tandem.kernels import fused_triton
    from tandem.kernels import prefill_attention_triton as fresh

    engine = _engine(
        model_dirs["llama"], dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=512
    )
    engine.warm_up()
    before = (
        _num_compiled(fresh._fresh_attention_kernel),
        _num_compiled(fused_triton._rope_store_kv_kernel),
    )
    assert before[0] >= 1
    rng = random.Random(6)
    for round_ in range(3):
        prompts = {
            f"f{round_}-{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(2, 300))]
            for i in range(rng.randrange(1, 12))
        }
        run_to_completion(engine, prompts, SamplingOptions(max_tokens=3, ignore_eos=True))
    after = (
        _num_compiled(fresh._fresh_attention_kernel),
        _num_compiled(fused_triton._rope_store_kv_kernel),
    )
    assert after == before


def test_gemvs_match_cublas_on_llama_8b_shapes():
    """One-row GEMVs (gemv_triton.py) on the 8B decode shapes: within bf16 output rounding of cuBLAS,
    and the SwiGLU-fused one within that of SwiGLU then cuBLAS."""
    from tandem.kernels import gemv, gemv_triton

    gen = torch.Generator("cuda").manual_seed(1)

    def randn(*shape, std=1.0):
        return (torch.randn(*shape, generator=gen, device="cuda") * std).bfloat16()

    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (128256, 4096)):
        x, weight = randn(1, K), randn(N, K, std=K**-0.5)
        _close_bf16(gemv_triton.gemv(x, weight), gemv.gemv(x, weight))
    # SmolLM2-135M's shapes (K not a multiple of the tile: the masked loads), with a bias, and fp16.
    for N, K in ((960, 576), (576, 1536), (49152, 576)):
        x, weight, bias = randn(1, K), randn(N, K, std=K**-0.5), randn(N)
        _close_bf16(gemv_triton.gemv(x, weight, bias), gemv.gemv(x, weight, bias))
        x, weight = x.half(), weight.half()
        torch.testing.assert_close(
            gemv_triton.gemv(x, weight).float(), gemv.gemv(x, weight).float(), atol=1e-2, rtol=2**-9
        )
    gate_up, down = randn(1, 2 * 14336, std=2.0), randn(4096, 14336, std=14336**-0.5)
    _close_bf16(gemv_triton.silu_mul_gemv(gate_up, down), gemv.silu_mul_gemv(gate_up, down))


def _same_bytes(got_q, want_q, x, scale) -> None:
    """The FP8 bytes equal; else the first few that differ, with what produced them."""
    differ = (got_q.view(torch.uint8) != want_q.view(torch.uint8)).nonzero().tolist()
    if not differ:
        return
    group = x.shape[1] // scale.shape[1]
    lines = []
    for row, col in differ[:6]:
        value, s = x[row, col].float(), scale[row, col // group]
        lines.append(
            f"[{row},{col}] x={value.item()!r} scale={s.item()!r} x/scale={(value / s).item()!r} "
            f"x*(1/scale)={(value * (1 / s)).item()!r} torch={want_q[row, col].float().item()!r} "
            f"(0x{want_q.view(torch.uint8)[row, col].item():02x}) "
            f"kernel={got_q[row, col].float().item()!r} (0x{got_q.view(torch.uint8)[row, col].item():02x})"
        )
    raise AssertionError(f"{len(differ)} of {x.numel()} FP8 bytes differ:\n" + "\n".join(lines))


def test_fp8_products_with_fast_accumulation_on_llama_8b_shapes():
    """The FP8 product a prefill step runs (torch._scaled_mm with fast accumulation: partial sums
    not promoted to float32 along K) within bf16 output rounding of float32 arithmetic on the
    same FP8 operands and scales, per-channel and 128-column block scales, K up to 14,336."""
    from tandem.kernels import fp8

    gen = torch.Generator("cuda").manual_seed(3)
    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)):
        x = torch.randn(2048, K, generator=gen, device="cuda").bfloat16()
        for groups in (1, K // 128):
            w, s = fp8.quantize_rows(
                torch.randn(N, K, generator=gen, device="cuda") / K**0.5, groups
            )
            xq, x_scale = fp8.quantize_rows(x, groups)
            got = fp8.fp8_linear_quantized(xq, x_scale, w, s, torch.bfloat16).float()
            want = fp8.dequantize_rows(xq, x_scale) @ fp8.dequantize_rows(w, s).t()
            rel = ((got - want).norm() / want.norm()).item()
            worst = ((got - want).abs().max() / want.pow(2).mean().sqrt()).item()
            # bf16 rounds each output (each group's, block-scaled) to 2^-9 of itself: on the CPU,
            # which accumulates in float32, 1.7e-3 of the norm row-scaled and 2.4e-3 block-scaled,
            # the worst element 1.5e-2 / 2.0e-2 of the RMS (smaller shapes).
            assert rel < 5e-3 and worst < 5e-2, (N, K, groups, rel, worst)


def test_fp8_gemvs_and_the_activation_quantizer_on_llama_8b_shapes():
    """The FP8 GEMVs (weight-only dequantization) within bf16 output rounding of the dequantized
    product, row- and block-scaled; the one-kernel activation quantizer bit for bit as torch's, and
    with SwiGLU or the norm before it in its kernel as the two kernels each replaces."""
    from tandem.kernels import fp8, fp8_triton, gemv, gemv_triton

    gen = torch.Generator("cuda").manual_seed(2)
    for N, K in ((6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336), (960, 576)):
        x = torch.randn(1, K, generator=gen, device="cuda").bfloat16()
        for groups in (1, K // 128 if K % 128 == 0 else 1):
            w, s = fp8.quantize_rows(
                torch.randn(N, K, generator=gen, device="cuda") / K**0.5, groups
            )
            _close_bf16(gemv_triton.fp8_gemv(x, w, s), gemv.fp8_gemv(x, w, s))
        acts = torch.randn(256, K, generator=gen, device="cuda").bfloat16() * 3
        for groups in (1, K // 128 if K % 128 == 0 else 1):
            want_q, want_s = fp8.quantize_rows(acts, groups)
            got_q, got_s = fp8_triton.quantize_rows(acts, groups)
            assert torch.equal(got_s, want_s)
            _same_bytes(got_q, want_q, acts, want_s)
    from tandem.kernels import fused_triton

    # The norm before qkv / gate_up quantizing in its own kernel, as the norm then the quantizer.
    # 5,120 columns (a 13B/Qwen-14B width) leave masked lanes; a row whose sum is zero.
    for hidden in (4096, 5120):
        x, residual = torch.randn(2, 256, hidden, generator=gen, device="cuda").bfloat16()
        residual[0] = -x[0]
        weight = (torch.rand(hidden, generator=gen, device="cuda") + 0.5).bfloat16()
        normed, want_total = fused_triton.add_rms_norm(x, residual, weight, 1e-5)
        want_q, want_s = fp8_triton.quantize_rows(normed, 1)
        got_q, got_s, got_total = fused_triton.add_rms_norm_quantize(x, residual, weight, 1e-5)
        assert torch.equal(got_total, want_total) and torch.equal(got_s, want_s)
        assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
    # SwiGLU quantized in the quantizer (a prefill step's down_proj input), as the two kernels do;
    # 28,672 columns (a 70B down_proj's input) are wider than one pass: read twice.
    for inter in (14336, 28672):
        gate_up = torch.randn(256, 2 * inter, generator=gen, device="cuda").bfloat16() * 2
        for groups in (1, inter // 128):
            want_q, want_s = fp8_triton.quantize_rows(fused_triton.silu_and_mul(gate_up), groups)
            got_q, got_s = fp8_triton.silu_mul_quantize_rows(gate_up, groups)
            assert torch.equal(got_s, want_s)
            assert torch.equal(got_q.view(torch.uint8), want_q.view(torch.uint8))
            if groups == 1:  # the plain quantizer on the same width, against torch
                acts = gate_up[:, :inter]
                want_q, want_s = fp8.quantize_rows(acts, 1)
                got_q, got_s = fp8_triton.quantize_rows(acts, 1)
                assert torch.equal(got_s, want_s)
                _same_bytes(got_q, want_q, acts, want_s)
    gate_up = torch.randn(1, 2 * 14336, generator=gen, device="cuda").bfloat16() * 2
    for groups in (1, 14336 // 128):  # row-scaled and block-scaled down_proj
        w, s = fp8.quantize_rows(
            torch.randn(4096, 14336, generator=gen, device="cuda") / 120, groups
        )
        _close_bf16(
            gemv_triton.fp8_silu_mul_gemv(gate_up, w, s), gemv.fp8_silu_mul_gemv(gate_up, w, s)
        )


def test_graph_attention_splits_match_eager():
    """A captured decode attention uses a split count fixed per batch size and per-sequence segment
    lengths; it must agree with the eager choice on the same inputs."""
    from tandem.kernels import paged_attention as reference
    from tandem.kernels.paged_attention_triton import graph_num_splits, paged_attention_triton

    gen = torch.Generator().manual_seed(1)
    seq_lens = [1, 17, 300, 4097, 64]
    tables = [
        list(
            range(
                sum(-(-s // 16) for s in seq_lens[:i]), sum(-(-s // 16) for s in seq_lens[: i + 1])
            )
        )
        for i in range(len(seq_lens))
    ]
    cache = torch.randn(sum(len(t) for t in tables), 2, 16, 8, 128, generator=gen).bfloat16().cuda()
    query = torch.randn(len(seq_lens), 32, 128, generator=gen).bfloat16().cuda()
    meta = AttentionMetadata.build([1] * len(seq_lens), seq_lens, tables, 16, device="cuda")
    want = reference.paged_attention(query.float(), cache.float(), meta, 128**-0.5)
    for splits in (None, graph_num_splits(len(seq_lens), 8, torch.device("cuda")), 3):
        meta.num_kv_splits = splits
        got = paged_attention_triton(query, cache, meta, 128**-0.5)
        torch.testing.assert_close(got.float(), want, atol=2e-2, rtol=2e-2)


def test_engine_steps_from_another_thread(model_dirs):
    """Built on one thread and stepped on another (as a worker does): the step binds its device."""
    engine = _engine(model_dirs["llama"])
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(
            out=run_to_completion(engine, {"a": [1, 5, 6, 7]}, {"a": SamplingOptions(max_tokens=8)})
        )
    )
    thread.start()
    thread.join()
    assert len(box["out"]["a"]) >= 1


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_cuda1_engine_works_after_the_process_touched_cuda0(model_dirs):
    torch.zeros(1, device="cuda:0")
    box = {}
    thread = threading.Thread(
        target=lambda: box.update(engine=_engine(model_dirs["llama"], device="cuda:1"))
    )
    thread.start()
    thread.join()
    engine = box["engine"]
    assert engine.runner.kv_cache.device == torch.device("cuda", 1)
    torch.cuda.set_device(0)  # the stepping thread's current device is the wrong one
    out = run_to_completion(
        engine, {"a": [1, 5, 6, 7]}, {"a": SamplingOptions(max_tokens=8, eos_token_ids=(2,))}
    )
    ref = run_to_completion(
        _engine(model_dirs["llama"], device="cpu"),
        {"a": [1, 5, 6, 7]},
        {"a": SamplingOptions(max_tokens=8, eos_token_ids=(2,))},
    )
    assert out == ref


def _num_compiled(kernel) -> int:
    """Variants of a Triton kernel compiled so far in this process (Triton 3.x keeps them per device)."""
    return sum(len(cache[0]) for cache in kernel.device_caches.values())


def test_no_attention_variant_compiles_after_the_warm_up(model_dirs):
    """After precompile_kernels (the worker's warm-up), mixed batches of any shape launch only
    variants compiled already: a compile mid-serving stalled a burst for ~1 s."""
    from tandem.kernels import paged_attention_triton as kernel

    engine = _engine(model_dirs["llama"], max_num_seqs=16, max_num_batched_tokens=512)
    engine.runner.precompile_kernels()
    before = _num_compiled(kernel._attention_kernel), _num_compiled(kernel._merge_splits_kernel)
    rng = random.Random(5)
    for round_ in range(4):
        prompts = {
            f"c{round_}-{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(2, 200))]
            for i in range(rng.randrange(1, 16))
        }
        run_to_completion(
            engine,
            prompts,
            {
                rid: SamplingOptions(max_tokens=rng.randrange(1, 30), ignore_eos=True)
                for rid in prompts
            },
        )
    assert (
        _num_compiled(kernel._attention_kernel),
        _num_compiled(kernel._merge_splits_kernel),
    ) == before


def test_fused_moe_matches_the_reference_on_qwen3_30b_a3b_shapes():
    """The grouped-GEMM MoE kernel (moe_triton.py) against the torch loop (moe.py): Qwen3-30B-A3B's
    layer (hidden 2048, 128 experts, top-8, intermediate 768) in bf16 for a decode row up to a
    prefill chunk, a small float32 one, and a CUDA graph captured with one routing replayed with
    another (the grid depends on the token count only)."""
    from tandem.kernels import moe, moe_triton

    gen = torch.Generator("cuda").manual_seed(2)

    def layer(hidden, experts, inter, dtype):
        w_gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen, device="cuda")
        w_down = torch.randn(experts, hidden, inter, generator=gen, device="cuda")
        return (w_gate_up * hidden**-0.5).to(dtype), (w_down * inter**-0.5).to(dtype)

    def routing(tokens, experts, top_k):
        logits = torch.randn(tokens, experts, generator=gen, device="cuda")
        return moe.route(logits, top_k, renormalize=True)

    w_gate_up, w_down = layer(2048, 128, 768, torch.bfloat16)
    for tokens in (1, 37, 300):
        x = torch.randn(tokens, 2048, generator=gen, device="cuda").bfloat16()
        weights, ids = routing(tokens, 128, 8)
        got = moe_triton.fused_moe(x, w_gate_up, w_down, weights, ids)
        want = moe.fused_moe(x, w_gate_up, w_down, weights, ids)
        torch.testing.assert_close(got.float(), want.float(), atol=3e-2, rtol=3e-2)
    small_gate_up, small_down = layer(96, 6, 40, torch.float32)
    x = torch.randn(19, 96, generator=gen, device="cuda")
    weights, ids = routing(19, 6, 2)
    torch.testing.assert_close(
        moe_triton.fused_moe(x, small_gate_up, small_down, weights, ids),
        moe.fused_moe(x, small_gate_up, small_down, weights, ids),
        atol=1e-4,
        rtol=1e-4,
    )
    x = torch.randn(16, 2048, generator=gen, device="cuda").bfloat16()
    weights, ids = routing(16, 128, 8)
    moe_triton.fused_moe(x, w_gate_up, w_down, weights, ids)  # compiled before the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = moe_triton.fused_moe(x, w_gate_up, w_down, weights, ids)
    new_weights, new_ids = routing(16, 128, 8)
    weights.copy_(new_weights)
    ids.copy_(new_ids)
    graph.replay()
    torch.testing.assert_close(out, moe_triton.fused_moe(x, w_gate_up, w_down, weights, ids))


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_moe_graphs_match_eager_and_transformers(tmp_path, model_type):
    """A tiny MoE checkpoint written by transformers, served with decode graphs (the fused MoE
    kernel inside them) and eagerly: transformers' greedy tokens."""
    from moe_checkpoints import write_tiny_moe_checkpoint

    model_dir = write_tiny_moe_checkpoint(tmp_path / model_type, model_type, seed=1)
    rng = random.Random(5)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(3, 40))]
        for i in range(7)
    }
    greedy = {rid: SamplingOptions(max_tokens=16, eos_token_ids=(2,)) for rid in prompts}
    graphed = _engine(model_dir)
    got = run_to_completion(graphed, prompts, greedy)
    assert graphed.runner.graphs.is_captured
    assert got == run_to_completion(_engine(model_dir, enforce_eager=True), prompts, greedy)
    assert got == _hf_greedy(model_dir, prompts, 16, eos=2)


def test_no_moe_variant_compiles_after_the_warm_up(tmp_path):
    """precompile_kernels compiles the fused MoE kernel's row tiles: prompts of any length and
    decode batches of any size launch no new variant."""
    from moe_checkpoints import write_tiny_moe_checkpoint

    from tandem.kernels import moe_triton

    model_dir = write_tiny_moe_checkpoint(tmp_path / "qwen3_moe", "qwen3_moe", seed=2)
    engine = _engine(model_dir, dtype="bfloat16", max_num_seqs=16, max_num_batched_tokens=512)
    engine.runner.precompile_kernels()
    kernels = (moe_triton._gate_up_kernel, moe_triton._down_kernel)
    before = [_num_compiled(k) for k in kernels]
    rng = random.Random(6)
    prompts = {
        f"m{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(2, 400))]
        for i in range(12)
    }
    run_to_completion(engine, prompts, SamplingOptions(max_tokens=8, ignore_eos=True))
    assert [_num_compiled(k) for k in kernels] == before


def test_eagle3_drafts_in_graphs_match_plain_decoding(model_dirs, tmp_path):
    """An EAGLE-3 head on the GPU in float32: the decode graphs, captured with the head's three
    layers' states copied out, replay the drafted steps, and the tokens are plain decoding's,
    greedy and seeded."""
    import json

    from eagle3_reference import head_config, random_weights, save_head
    from test_speculative import drafted_steps_in_graphs

    target = json.loads((model_dirs["llama"] / "config.json").read_text())
    config = head_config(target, draft_vocab=target["vocab_size"] // 2)
    head = save_head(tmp_path / "head", config, random_weights(config, 1, target["hidden_size"]))
    rng = random.Random(5)
    prompts = {
        f"r{i}": [1] + [rng.randrange(4, 300) for _ in range(rng.randrange(3, 30))]
        for i in range(10)
    }
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    drafting = _engine(model_dirs["llama"], speculative_config=spec)
    in_graph = drafted_steps_in_graphs(drafting)
    for options in (
        SamplingOptions(max_tokens=32, ignore_eos=True),
        SamplingOptions(max_tokens=24, ignore_eos=True, temperature=0.8, top_p=0.9, seed=7),
    ):
        got = run_to_completion(drafting, prompts, options)
        assert got == run_to_completion(_engine(model_dirs["llama"]), prompts, options)
    assert drafting.runner.graphs.is_captured
    assert sum(in_graph) >= len(in_graph) // 2 > 0
    assert drafting.counters.num_draft_tokens > 0


def test_the_host_tier_on_the_gpu_gives_the_tokens_of_no_tier(model_dirs):
    """The host tier's copies run on a stream of their own (written through when a block is
    freed, up ahead of the step that reads it): a pool too small for the sessions, sessions one
    at a time and all at once, float32 so that any KV a copy got wrong shows in the tokens."""
    from test_host_kv_tier import _turns

    rng = random.Random(7)
    sessions = [
        [1] + [rng.randrange(4, 380) for _ in range(rng.randrange(90, 140))] for _ in range(5)
    ]
    kwargs = dict(dtype="float32", num_blocks=24, block_size=8, max_num_seqs=8)
    plain = _engine(model_dirs["llama"], **kwargs)
    tiered = _engine(model_dirs["llama"], host_kv_cache_gb=0.01, **kwargs)
    want, _ = _turns(plain, [list(s) for s in sessions], 3)
    got, cached = _turns(tiered, [list(s) for s in sessions], 3)
    assert got == want
    assert all(c >= 88 for c in cached[5:]), cached  # later rounds' histories came from the tier
    # All at once: copies down of finished sessions overlap other sessions' steps.
    histories = [s + w for s, w in zip(sessions, want[-5:])]
    options = {f"b{i}": SamplingOptions(max_tokens=12, ignore_eos=True) for i in range(5)}
    prompts = {f"b{i}": h for i, h in enumerate(histories)}
    want_all = run_to_completion(plain, prompts, options)
    for _ in range(2):
        assert run_to_completion(tiered, prompts, options) == want_all
    tier = tiered.block_manager.host_tier
    assert tier.num_copied_up > 0 and tier.num_copied_down > 0
