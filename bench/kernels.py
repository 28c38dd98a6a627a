"""Paged attention and KV store: Triton vs the torch reference, against the H200 roofline.

    python bench/kernels.py            # CUDA: Llama-3.1-8B shapes (32 q / 8 kv heads, head_dim 128, bf16)
    python bench/kernels.py --tiny     # small shapes; on a CPU, Triton runs under TRITON_INTERPRET
    python bench/kernels.py --dense-prefill  # CUDA: also fresh prompts on cuDNN and FlashAttention-2
    python bench/kernels.py --fresh-prefill  # also fresh prompts over their own keys (the engine's
                                             # path for them) against the paged kernel, tiles swept
    python bench/kernels.py --linear         # CUDA: also the decode GEMMs under cuBLAS and cuBLASLt

Decode rows report KV bytes read over time (GB/s) against HBM bandwidth; prefill rows
report causal attention FLOPs over time (TFLOP/s) against dense bf16. On a CPU the shapes
are always tiny and the Triton column is filled only with --tiny (the interpreter is
slow and its timings mean nothing); the point there is that the script itself runs.
"""

from __future__ import annotations

import argparse
import os
import time
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tandem.kernels import paged_attention as reference
from tandem.kernels.attention_metadata import AttentionMetadata

HBM_PEAK_TBS = 4.8  # H200 datasheet
HBM_COPY_TBS = 4.1  # device-to-device copy measured on an H200 (read + write)
BF16_DENSE_TFLOPS = 989.0  # H200 datasheet, dense


@dataclass(frozen=True)
class Shapes:
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_sizes: tuple[int, ...]
    decode_batches: tuple[int, ...]
    decode_contexts: tuple[int, ...]
    prefill_lens: tuple[int, ...]


LLAMA_8B = Shapes(32, 8, 128, (16, 32), (1, 16, 64), (1024, 4096), (2048,))
TINY = Shapes(4, 2, 32, (16,), (1, 4), (64, 256), (128,))


class Bench:
    """Builds random paged batches (blocks scattered over a multi-layer cache) and times both backends."""

    NUM_LAYERS = 2  # enough for a strided layer view, as the engine passes it

    def __init__(self, num_heads, num_kv_heads, head_dim, dtype, device, seed, run_triton):
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.dtype, self.device, self.run_triton = dtype, device, run_triton
        self.gen = torch.Generator(device).manual_seed(seed)
        if run_triton:
            from tandem.kernels import paged_attention_triton

            self.triton = paged_attention_triton

    def _randn(self, *shape):
        return torch.randn(*shape, generator=self.gen, device=self.device, dtype=self.dtype)

    def _batch(self, block_size, query_lens, seq_lens):
        num_blocks = [-(-s // block_size) for s in seq_lens]
        total = sum(num_blocks)
        cache = self._randn(total, self.NUM_LAYERS, 2, block_size, self.num_kv_heads, self.head_dim)
        order = torch.randperm(total, generator=torch.Generator().manual_seed(total)).tolist()
        tables, start = [], 0
        for n in num_blocks:
            tables.append(order[start : start + n])
            start += n
        meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=self.device)
        query = self._randn(sum(query_lens), self.num_heads, self.head_dim)
        return query, cache[:, 1], meta

    def _time(self, fn, graph: bool = False) -> float:
        """Median ms. CUDA: do_bench flushes L2 before each call; with `graph`, a captured
        CUDA graph is replayed (the engine's decode path), which leaves out Python launch cost."""
        if self.device.type == "cuda":
            import triton.testing

            if graph:
                fn()  # compile outside the capture
                cuda_graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(cuda_graph):
                    fn()
                fn = cuda_graph.replay
            return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")
        fn()
        times = []
        for _ in range(3):
            start = time.perf_counter()
            fn()
            times.append((time.perf_counter() - start) * 1e3)
        return sorted(times)[1]

    def _row(self, kernel, case, block_size, torch_fn, triton_fn, work, unit, roofline):
        error = None
        if self.run_triton and kernel != "store_kv":
            # Correct before fast: the relative error at the very shapes being timed.
            expected, actual = torch_fn().float(), triton_fn().float()
            error = float((actual - expected).norm() / expected.norm())
        torch_ms = self._time(torch_fn)
        triton_ms = self._time(triton_fn, graph=True) if self.run_triton else None
        rate = work / (triton_ms * 1e-3) / (1e9 if unit == "GB/s" else 1e12) if triton_ms else None
        return dict(
            kernel=kernel,
            case=case,
            block=block_size,
            torch_ms=torch_ms,
            triton_ms=triton_ms,
            rate=rate,
            unit=unit,
            roofline=roofline,
            error=error,
        )

    def decode(self, block_size, batch, context):
        query, kv_layer, meta = self._batch(block_size, [1] * batch, [context] * batch)
        scale = self.head_dim**-0.5
        kv_bytes = batch * context * 2 * self.num_kv_heads * self.head_dim * kv_layer.element_size()
        return self._row(
            "decode",
            f"batch {batch} ctx {context}",
            block_size,
            lambda: reference.paged_attention(query, kv_layer, meta, scale),
            lambda: self.triton.paged_attention_triton(query, kv_layer, meta, scale),
            kv_bytes,
            "GB/s",
            HBM_PEAK_TBS * 1e3,
        )

    def prefill(self, block_size, length):
        query, kv_layer, meta = self._batch(block_size, [length], [length])
        scale = self.head_dim**-0.5
        flops = self._causal_flops([length], [length])
        return self._row(
            "prefill",
            f"1 x {length} tokens",
            block_size,
            lambda: reference.paged_attention(query, kv_layer, meta, scale),
            lambda: self.triton.paged_attention_triton(query, kv_layer, meta, scale),
            flops,
            "TFLOP/s",
            BF16_DENSE_TFLOPS,
        )

    def mixed(self, block_size, context, num_decodes):
        chunk = context // 2
        query, kv_layer, meta = self._batch(
            block_size, [chunk] + [1] * num_decodes, [context] * (num_decodes + 1)
        )
        scale = self.head_dim**-0.5
        flops = self._causal_flops([chunk] + [1] * num_decodes, [context] * (num_decodes + 1))
        decode_bytes = (
            num_decodes * context * 2 * self.num_kv_heads * self.head_dim * kv_layer.element_size()
        )
        # The chunk is compute-bound and the decode rows memory-bound: the ceiling is each
        # part at its own roofline, expressed as the FLOP rate that finishes in that time.
        floor_s = flops / (BF16_DENSE_TFLOPS * 1e12) + decode_bytes / (HBM_PEAK_TBS * 1e12)
        return self._row(
            "mixed",
            f"{chunk} chunk + {num_decodes} dec",
            block_size,
            lambda: reference.paged_attention(query, kv_layer, meta, scale),
            lambda: self.triton.paged_attention_triton(query, kv_layer, meta, scale),
            flops,
            "TFLOP/s",
            flops / floor_s / 1e12,
        )

    def _causal_flops(self, query_lens, seq_lens) -> int:
        pairs = sum(q * s - q * (q - 1) // 2 for q, s in zip(query_lens, seq_lens))
        return 4 * self.num_heads * self.head_dim * pairs

    def store(self, block_size, num_tokens):
        _, kv_layer, meta = self._batch(block_size, [num_tokens], [num_tokens])
        key, value = (self._randn(num_tokens, self.num_kv_heads, self.head_dim) for _ in range(2))
        moved = 2 * 2 * key.numel() * key.element_size()  # k and v, read once and written once
        return self._row(
            "store_kv",
            f"{num_tokens} tokens",
            block_size,
            lambda: reference.store_kv(key, value, kv_layer, meta.slot_mapping),
            lambda: self.triton.store_kv_triton(key, value, kv_layer, meta.slot_mapping),
            moved,
            "GB/s",
            HBM_PEAK_TBS * 1e3,
        )

    def fused(self, name, num_tokens, hidden, inter):
        """A fused element-wise kernel against its torch reference (several kernels), bytes moved once."""
        from tandem.kernels import fused as ref
        from tandem.kernels import fused_triton

        size = self.dtype.itemsize
        x, res, weight = (
            self._randn(num_tokens, hidden),
            self._randn(num_tokens, hidden),
            self._randn(hidden),
        )
        if name == "add_rms_norm":
            args, moved = (x, res, weight, 1e-5), (4 * num_tokens * hidden + hidden) * size
        elif name == "silu_and_mul":
            args, moved = (self._randn(num_tokens, 2 * inter),), 3 * num_tokens * inter * size
        else:  # rope_store_kv: q, k, v read; q and the k/v cache rows written; cos/sin rows read
            qkv = self._randn(num_tokens, (self.num_heads + 2 * self.num_kv_heads) * self.head_dim)
            q, k, v = (
                t.view(num_tokens, -1, self.head_dim)
                for t in qkv.split(
                    [
                        self.num_heads * self.head_dim,
                        self.num_kv_heads * self.head_dim,
                        self.num_kv_heads * self.head_dim,
                    ],
                    -1,
                )
            )
            _, kv_layer, meta = self._batch(16, [num_tokens], [num_tokens])
            positions = torch.arange(num_tokens, device=self.device)
            inv_freq = 1.0 / (
                500000
                ** (torch.arange(0, self.head_dim, 2, device=self.device).float() / self.head_dim)
            )
            cos_sin = ref.rope_cos_sin(inv_freq, num_tokens, self.dtype)
            args = (q, k, v, positions, cos_sin, kv_layer, meta.slot_mapping)
            moved = 2 * qkv.numel() * size + cos_sin.numel() * size
        first = lambda out: out[0] if isinstance(out, tuple) else out  # noqa: E731
        return self._row(
            name,
            f"{num_tokens} tokens",
            "-",
            lambda: first(getattr(ref, name)(*args)),
            lambda: first(getattr(fused_triton, name)(*args)),
            moved,
            "GB/s",
            HBM_PEAK_TBS * 1e3,
        )


def sweep_prefill(bench: Bench, length: int) -> None:
    """Times the prefill attention under other tile shapes (rows, keys per tile, warps, stages)."""
    module = bench.triton
    default = module.launch_config
    print(f"prefill launch-config sweep, 1 x {length} tokens, block 16:")
    for rows, tile_n, warps, stages in (
        (64, 64, 4, 2),
        (128, 64, 8, 2),
        (128, 64, 4, 2),
        (128, 64, 8, 3),
        (64, 64, 4, 3),
        (128, 128, 8, 2),
        (64, 32, 4, 2),
    ):
        module.launch_config = (
            lambda has_prefill, dim_pad, c=module.LaunchConfig(rows, tile_n, warps, stages): (
                c if has_prefill else default(has_prefill, dim_pad)
            )
        )
        try:
            row = bench.prefill(16, length)
            print(
                f"  rows {rows:4d} tile {tile_n:4d} warps {warps} stages {stages}: {row['triton_ms']:.4f} ms, "
                f"{row['rate']:.1f} TFLOP/s, rel err {row['error']:.1e}"
            )
        except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is a row, not the end
            print(
                f"  rows {rows:4d} tile {tile_n:4d} warps {warps} stages {stages}: failed ({type(exc).__name__})"
            )
    module.launch_config = default


def _gather_blocks(
    kv_layer: torch.Tensor, table: torch.Tensor, seq_len: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """One fresh prompt's keys and values, [seq_len, Hkv, D] each, copied block by block from the cache."""
    block_size = kv_layer.shape[2]
    blocks = table[: -(-seq_len // block_size)].long()
    return tuple(kv_layer[:, i].index_select(0, blocks).flatten(0, 1)[:seq_len] for i in (0, 1))


def dense_prefill_rows(bench: Bench) -> None:
    """Fresh prompts' attention: the paged Triton kernel against dense kernels that need the keys
    gathered out of the paged cache first (PyTorch's cuDNN SDPA backend, one call per prompt, and its
    FlashAttention-2 varlen kernel, one call per step). Tried as an engine path on 2026-12-02 and
    reverted: with the gather neither beats the paged kernel below ~8k tokens (bench/RESULTS.md)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    print("fresh prompts' attention, block 16 (cuDNN and FA2 timed with the gather they need):")
    print(
        f"  {'case':<18}{'paged ms':>10}{'gather ms':>11}{'cuDNN ms':>10}{'FA2 ms':>9}{'cuDNN err':>11}{'FA2 err':>9}"
    )
    scale = bench.head_dim**-0.5
    for lens in ([2048], [512] * 16, [8192], [300, 700, 1024]):
        query, kv_layer, meta = bench._batch(16, lens, lens)
        starts = meta.host_query_start_loc()
        paged = lambda: bench.triton.paged_attention_triton(query, kv_layer, meta, scale)  # noqa: E731
        gather = lambda: [  # noqa: E731
            _gather_blocks(kv_layer, meta.block_tables[b], n) for b, n in enumerate(lens)
        ]  # noqa: E731

        def cudnn():
            out = torch.empty_like(query)
            with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                for b, (key, value) in enumerate(gather()):
                    q, k, v = (
                        t.transpose(0, 1)[None]
                        for t in (query[starts[b] : starts[b + 1]], key, value)
                    )
                    out[starts[b] : starts[b + 1]] = F.scaled_dot_product_attention(
                        q, k, v, is_causal=True, scale=scale, enable_gqa=True
                    )[0].transpose(0, 1)
            return out

        def fa2():
            key, value = (torch.cat(parts) for parts in zip(*gather()))
            return torch.ops.aten._flash_attention_forward(
                query,
                key,
                value,
                meta.query_start_loc,
                meta.query_start_loc,
                max(lens),
                max(lens),
                0.0,
                True,
                False,
                scale=scale,
            )[0]

        expected = paged().float()
        errors = [float((fn().float() - expected).norm() / expected.norm()) for fn in (cudnn, fa2)]
        name = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
        print(
            f"  {name:<18}{bench._time(paged):10.4f}{bench._time(gather):11.4f}{bench._time(cudnn):10.4f}"
            f"{bench._time(fa2):9.4f}{errors[0]:11.1e}{errors[1]:9.1e}"
        )


FRESH_SWEEP = [  # (block_m, block_n, warps, stages), the kernel's DEFAULT_CONFIG among them
    (64, 64, 4, 3),
    (128, 64, 8, 3),
    (128, 64, 8, 2),
    (128, 64, 4, 3),
    (128, 128, 8, 3),
    (128, 32, 4, 3),
    (64, 64, 4, 2),
    (64, 32, 4, 3),
]


def fresh_prefill_rows(bench: Bench) -> None:
    """Fresh prompts' attention over their own keys (prefill_attention_triton.py, what the engine
    runs for a step of fresh prompts) against the paged kernel over the same keys in the pool,
    with the fresh kernel's tiles swept; TFLOP/s of causal attention against dense bf16. On CUDA
    also cuDNN's SDPA on dense [B, H, T, D] tensors, one prompt at a time (the kernel rate the
    engine cannot use: it plans per prompt length). Error: relative to the paged kernel."""
    from tandem.kernels import prefill_attention_triton as fresh

    on_cuda = bench.device.type == "cuda"
    print(
        f"\nfresh prompts' attention (ms, TFLOP/s of causal attention; {BF16_DENSE_TFLOPS:.0f} dense "
        "bf16 peak); the fresh kernel's tiles (block_m/block_n/warps/stages) swept:"
    )
    cases = ([2048], [512] * 16, [4096], [300, 700, 1024]) if on_cuda else ([40], [9, 17])
    sweep = (
        [fresh.FreshConfig(*tiles) for tiles in FRESH_SWEEP] if on_cuda else [fresh.DEFAULT_CONFIG]
    )
    for lens in cases:
        query, kv_layer, meta = bench._batch(16, lens, lens)
        key, value = (
            torch.cat(parts)
            for parts in zip(
                *(_gather_blocks(kv_layer, meta.block_tables[b], n) for b, n in enumerate(lens))
            )
        )
        flops = bench._causal_flops(lens, lens)
        scale = bench.head_dim**-0.5
        name = f"{len(lens)} x {lens[0]}" if len(set(lens)) == 1 else "+".join(map(str, lens))
        paged = lambda: bench.triton.paged_attention_triton(query, kv_layer, meta, scale)  # noqa: E731
        expected = paged().float()
        ms = bench._time(paged)
        print(f"  {name}: paged kernel {ms:.4f} ms ({flops / ms / 1e9:.1f} TFLOP/s)")
        for config in sweep:
            run = lambda: fresh.fresh_prefill_attention(  # noqa: E731
                query, key, value, meta.query_start_loc, max(lens), scale, config
            )
            error = float((run().float() - expected).norm() / expected.norm())
            ms = bench._time(run)
            tag = " (default)" if config == fresh.DEFAULT_CONFIG else ""
            tiles = (config.block_m, config.block_n, config.num_warps, config.num_stages)
            print(
                f"    fresh {'/'.join(map(str, tiles)):<14}{ms:9.4f} ms {flops / ms / 1e9:7.1f} "
                f"TFLOP/s  err {error:.1e}{tag}"
            )
        if on_cuda:
            from torch.nn.attention import SDPBackend, sdpa_kernel

            starts = meta.host_query_start_loc()
            dense = [
                tuple(
                    t[starts[b] : starts[b + 1]].transpose(0, 1)[None].contiguous()
                    for t in (query, key, value)
                )
                for b in range(len(lens))
            ]

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    for q, k, v in dense:
                        F.scaled_dot_product_attention(
                            q, k, v, is_causal=True, scale=scale, enable_gqa=True
                        )

            ms = bench._time(cudnn)
            print(
                f"    cuDNN, dense [1, H, T, D] per prompt {ms:.4f} ms {flops / ms / 1e9:7.1f} TFLOP/s"
            )


def linear_rows(bench: Bench) -> None:
    """The 8B decode GEMMs at small batch under each BLAS library PyTorch can pick (cuBLAS,
    cuBLASLt), as weight bytes read per second against the copy rate."""
    shapes = {
        "qkv": (6144, 4096),
        "o": (4096, 4096),
        "gate_up": (28672, 4096),
        "down": (4096, 14336),
        "lm_head": (128256, 4096),
    }
    print(f"decode GEMMs (weights read once; against the {HBM_COPY_TBS} TB/s copy rate):")
    print(
        f"  {'gemm':<9}{'rows':>5}"
        + "".join(f"{lib + ' ms':>13}{'x copy':>8}" for lib in ("cublas", "cublaslt"))
    )
    weights = {name: bench._randn(*shape) for name, shape in shapes.items()}
    for rows in (1, 8, 32):
        for name, weight in weights.items():
            x = bench._randn(rows, weight.shape[1])
            line = f"  {name:<9}{rows:5d}"
            for lib in ("cublas", "cublaslt"):
                torch.backends.cuda.preferred_blas_library(lib)
                ms = bench._time(lambda: F.linear(x, weight))
                line += f"{ms:13.4f}{weight.numel() * weight.element_size() / ms / 1e9 / HBM_COPY_TBS:8.2f}"
            print(line)
    torch.backends.cuda.preferred_blas_library("cublas")


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="small shapes; Triton through the interpreter on CPU"
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--sweep-prefill", action="store_true", help="also time other prefill tile shapes"
    )
    parser.add_argument(
        "--dense-prefill",
        action="store_true",
        help="CUDA: also time fresh prompts' attention on cuDNN and FlashAttention-2 (after a gather)",
    )
    parser.add_argument(
        "--fresh-prefill",
        action="store_true",
        help="also time fresh prompts over their own keys against the paged kernel (tiles swept on CUDA)",
    )
    parser.add_argument(
        "--skip-table", action="store_true", help="only the sections asked for, not the main table"
    )
    parser.add_argument(
        "--linear", action="store_true", help="CUDA: also time the decode GEMMs per BLAS library"
    )
    return parser.parse_args()


def main_rows(bench: Bench, shapes, run_triton: bool) -> list[dict]:
    """The main table: decode, prefill and store rows per block size, a mixed step, and on Triton
    the fused element-wise kernels."""
    rows = []
    for block_size in shapes.block_sizes:
        for batch in shapes.decode_batches:
            for context in shapes.decode_contexts:
                rows.append(bench.decode(block_size, batch, context))
        for prefill_len in shapes.prefill_lens:
            rows.append(bench.prefill(block_size, prefill_len))
        rows.append(bench.store(block_size, max(shapes.prefill_lens)))
    # A chunk continuing a cached prefix next to decode rows: the engine's mixed steps.
    rows.append(
        bench.mixed(shapes.block_sizes[0], max(shapes.decode_contexts), max(shapes.decode_batches))
    )
    if run_triton:
        hidden, inter = (4096, 14336) if shapes is LLAMA_8B else (64, 128)
        for name in ("add_rms_norm", "silu_and_mul", "rope_store_kv"):
            for num_tokens in (1, 64, 2048) if shapes is LLAMA_8B else (1, 8, 32):
                rows.append(bench.fused(name, num_tokens, hidden, inter))
    return rows


def main() -> None:
    args = parse_args()
    on_cuda = torch.cuda.is_available()
    run_triton = on_cuda or args.tiny
    if run_triton and not on_cuda:
        os.environ["TRITON_INTERPRET"] = "1"  # read when the kernels are decorated, i.e. at import

    shapes = LLAMA_8B if on_cuda and not args.tiny else TINY
    device = torch.device("cuda" if on_cuda else "cpu")
    dtype = torch.bfloat16
    bench = Bench(
        shapes.num_heads, shapes.num_kv_heads, shapes.head_dim, dtype, device, args.seed, run_triton
    )
    print(
        f"device: {torch.cuda.get_device_name() if on_cuda else 'cpu'}; heads {shapes.num_heads}/"
        f"{shapes.num_kv_heads}, head_dim {shapes.head_dim}, {dtype}; roofline: H200 HBM {HBM_PEAK_TBS} TB/s "
        f"peak, {HBM_COPY_TBS} TB/s measured copy, {BF16_DENSE_TFLOPS:.0f} TFLOP/s bf16 dense"
    )
    if not args.skip_table:
        print_table(main_rows(bench, shapes, run_triton))
    if args.sweep_prefill and run_triton:
        sweep_prefill(bench, max(shapes.prefill_lens))
    if args.dense_prefill and on_cuda:
        dense_prefill_rows(bench)
    if args.fresh_prefill and run_triton:
        fresh_prefill_rows(bench)
    if args.linear and on_cuda:
        linear_rows(bench)


def print_table(rows: list[dict]) -> None:
    header = f"{'kernel':<14}{'case':<24}{'block':>6}{'torch ms':>11}{'triton ms':>11}{'triton rate':>16}{'roofline':>16}{'% roof':>8}{'rel err':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        rate, roof, unit = row["rate"], row["roofline"], row["unit"]
        triton_ms = f"{row['triton_ms']:.4f}" if row["triton_ms"] is not None else "-"
        achieved = f"{rate:.1f} {unit}" if rate is not None else "-"
        percent = f"{100 * rate / roof:.1f}" if rate is not None else "-"
        error = f"{row['error']:.1e}" if row["error"] is not None else "-"
        print(
            f"{row['kernel']:<14}{row['case']:<24}{row['block']:>6}{row['torch_ms']:>11.4f}{triton_ms:>11}"
            f"{achieved:>16}{f'{roof:.0f} {unit}':>16}{percent:>8}{error:>10}"
        )
    print(
        f"roofline: GB/s rows against HBM peak {HBM_PEAK_TBS} TB/s (a measured device copy reaches "
        f"{HBM_COPY_TBS}); TFLOP/s rows against {BF16_DENSE_TFLOPS:.0f} bf16 dense, causal FLOPs = "
        "4*Hq*D per visible query-key pair; the mixed row's ceiling is the chunk at the FLOP "
        "roofline plus the decode rows' KV at HBM peak. CUDA: triton timed as CUDA-graph replay, torch eager."
    )


if __name__ == "__main__":
    main()
