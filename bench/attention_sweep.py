"""Attention launch sweeps on the GPU (issue 7): which tiles and which inner loop the engine's
paged attention should use.

    python3 bench/attention_sweep.py            # CUDA: Llama-3.1-8B heads (32 q / 8 kv, 128), bf16, block 16
    python3 bench/attention_sweep.py --tiny     # CPU: tiny shapes under TRITON_INTERPRET (correctness only)

Decode: the engine's kernel under each (keys per tile, warps, stages) at the batch x context
shapes the serving rows reach (offline 256 x ~640, 32-64 x ~256, batch 1), replayed as CUDA
graphs with the key-segment count a captured decode graph uses; KV GB/s against the copy rate.

Prefill: fresh prompts (the 2048-token TTFT row, the offline row's 16 x 512 steps) under the
engine's kernel and under variants of its inner loop (`_variant_kernel` below, a copy of the
engine kernel's loop with switches: no load masks on whole tiles, keys loaded transposed, the
next tile's block ids loaded a tile ahead, and keys read from the step's dense K/V instead of
the pages, which prices the paging), against cuDNN's fused attention on dense tensors; TFLOP/s
against dense bf16. Each row's relative error against the torch reference is printed beside it.
In the raw files of runs 23-24 (bench/results) the decode "variant" lines print above their
case's header; this version prints them below it.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

if "--tiny" in sys.argv:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from tandem.kernels import paged_attention as reference  # noqa: E402
from tandem.kernels import paged_attention_triton as engine  # noqa: E402
from tandem.kernels.attention_metadata import AttentionMetadata  # noqa: E402
from tandem.kernels.paged_attention_triton import _dot  # noqa: E402

BF16_DENSE_TFLOPS = 989.0  # H200 datasheet
_LOG2E = 1.4426950408889634


@triton.jit
def _tile_block_ids(table, start, kv_hi, BLOCK_SIZE: tl.constexpr, TILE_N: tl.constexpr):
    pos = start + tl.arange(0, TILE_N)
    return tl.load(table + pos // BLOCK_SIZE, mask=pos < kv_hi, other=0).to(tl.int64)


@triton.jit
def _variant_tile(
    q,
    k_base,
    v_base,
    table,
    block_ids,
    start,
    kv_hi,
    q_pos,
    kv_col,
    dims,
    m_i,
    l_i,
    acc,
    scale_log2,
    stride_block,
    stride_slot,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    DENSE: tl.constexpr,
    TRANS_K: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    pos = start + tl.arange(0, TILE_N)
    valid = pos < kv_hi
    if DENSE:
        offs = pos.to(tl.int64) * stride_kt + kv_col
    else:
        if PREFETCH_IDS:
            block_id = block_ids
        elif MASKED:
            block_id = tl.load(table + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
        else:
            block_id = tl.load(table + pos // BLOCK_SIZE).to(tl.int64)
        offs = block_id * stride_block + (pos % BLOCK_SIZE) * stride_slot + kv_col
    if TRANS_K:
        k_ptrs = k_base + offs[None, :] + dims[:, None]
    else:
        k_ptrs = k_base + offs[:, None] + dims[None, :]
    v_ptrs = v_base + offs[:, None] + dims[None, :]
    if MASKED:
        if TRANS_K:
            k = tl.load(k_ptrs, mask=valid[None, :], other=0.0)
        else:
            k = tl.load(k_ptrs, mask=valid[:, None], other=0.0)
        v = tl.load(v_ptrs, mask=valid[:, None], other=0.0)
    else:
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if TRANS_K:
        scores = _dot(q, k, UPCAST) * scale_log2
    else:
        scores = _dot(q, tl.trans(k), UPCAST) * scale_log2
    if MASKED:
        scores = tl.where(valid[None, :] & (pos[None, :] <= q_pos[:, None]), scores, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(scores, 1))
    p = tl.exp2(scores - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, UPCAST)
    return m_new, l_i, acc


@triton.jit
def _variant_span(
    q,
    k_base,
    v_base,
    table,
    block_ids,
    lo,
    hi,
    kv_hi,
    q_pos,
    kv_col,
    dims,
    m_i,
    l_i,
    acc,
    scale_log2,
    stride_block,
    stride_slot,
    stride_kt,
    BLOCK_SIZE: tl.constexpr,
    TILE_N: tl.constexpr,
    MASKED: tl.constexpr,
    DENSE: tl.constexpr,
    TRANS_K: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The tiles of keys [lo, hi). PREFETCH_IDS: the next tile's block ids are loaded while this
    tile computes, so the key loads do not wait on a table load each step."""
    for start in range(lo, hi, TILE_N):
        next_ids = block_ids
        if PREFETCH_IDS:
            next_ids = _tile_block_ids(table, start + TILE_N, kv_hi, BLOCK_SIZE, TILE_N)
        m_i, l_i, acc = _variant_tile(
            q,
            k_base,
            v_base,
            table,
            block_ids,
            start,
            kv_hi,
            q_pos,
            kv_col,
            dims,
            m_i,
            l_i,
            acc,
            scale_log2,
            stride_block,
            stride_slot,
            stride_kt,
            BLOCK_SIZE,
            TILE_N,
            MASKED,
            DENSE,
            TRANS_K,
            PREFETCH_IDS,
            UPCAST,
        )
        block_ids = next_ids
    return m_i, l_i, acc, block_ids


@triton.jit(do_not_specialize=["stride_table"])
def _variant_kernel(
    q_ptr,
    kv_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    query_start_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_block,
    stride_kv,
    stride_slot,
    stride_head,
    stride_table,
    stride_kt,
    stride_kh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    TILE_N: tl.constexpr,
    DENSE: tl.constexpr,
    TRANS_K: tl.constexpr,
    PREFETCH_IDS: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """The engine's prefill loop (GQA rows packed, online softmax in base 2), one segment, with
    the variants' switches. GROUP and HEAD_DIM are powers of two here. DENSE: the sequence's keys
    and values are rows query_start + position of k/v [T, Hkv, D] (fresh prompts only)."""
    seq = tl.program_id(0)
    q_block = tl.program_id(1)
    kv_head = tl.program_id(2)
    query_start = tl.load(query_start_ptr + seq)
    query_len = tl.load(query_start_ptr + seq + 1) - query_start
    if q_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + seq)
    context_len = seq_len - query_len
    rows = tl.arange(0, BLOCK_Q * GROUP)
    q_index = q_block * BLOCK_Q + rows // GROUP
    head = kv_head * GROUP + rows % GROUP
    row_valid = q_index < query_len
    q_pos = context_len + q_index
    dims = tl.arange(0, HEAD_DIM)
    token = (query_start + q_index).to(tl.int64)
    q = tl.load(
        q_ptr + token[:, None] * stride_qt + head[:, None] * stride_qh + dims[None, :],
        mask=row_valid[:, None],
        other=0.0,
    )
    kv_hi = tl.minimum(seq_len, context_len + (q_block + 1) * BLOCK_Q)
    m_i = tl.full([BLOCK_Q * GROUP], -1.0e30, tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP, HEAD_DIM], tl.float32)
    table = block_tables_ptr + seq.to(tl.int64) * stride_table
    if DENSE:
        k_base = k_ptr + query_start.to(tl.int64) * stride_kt
        v_base = v_ptr + query_start.to(tl.int64) * stride_kt
        kv_col = kv_head * stride_kh
    else:
        k_base = kv_ptr
        v_base = kv_ptr + stride_kv
        kv_col = kv_head * stride_head
    unmasked_hi = (tl.minimum(kv_hi, context_len + q_block * BLOCK_Q + 1) // TILE_N) * TILE_N
    # PREFETCH_IDS: the next tile's block ids are loaded while this tile computes, so the key
    # loads do not wait on a table load each step.
    block_ids = _tile_block_ids(table, 0, kv_hi, BLOCK_SIZE, TILE_N)
    m_i, l_i, acc, block_ids = _variant_span(
        q,
        k_base,
        v_base,
        table,
        block_ids,
        0,
        unmasked_hi,
        kv_hi,
        q_pos,
        kv_col,
        dims,
        m_i,
        l_i,
        acc,
        scale_log2,
        stride_block,
        stride_slot,
        stride_kt,
        BLOCK_SIZE,
        TILE_N,
        False,
        DENSE,
        TRANS_K,
        PREFETCH_IDS,
        UPCAST,
    )
    m_i, l_i, acc, block_ids = _variant_span(
        q,
        k_base,
        v_base,
        table,
        block_ids,
        unmasked_hi,
        kv_hi,
        kv_hi,
        q_pos,
        kv_col,
        dims,
        m_i,
        l_i,
        acc,
        scale_log2,
        stride_block,
        stride_slot,
        stride_kt,
        BLOCK_SIZE,
        TILE_N,
        True,
        DENSE,
        TRANS_K,
        PREFETCH_IDS,
        UPCAST,
    )
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_ot + head[:, None] * stride_oh + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None],
    )


def variant_attention(
    query, kv_layer, meta, scale, config, *, dense_kv=None, trans_k=False, prefetch_ids=False
):
    """Launches `_variant_kernel`; dense_kv = (key, value) [T, Hkv, D] switches DENSE on."""
    _, _, block_size, num_kv_heads, head_dim = kv_layer.shape
    group = query.shape[1] // num_kv_heads
    block_q = config.rows // group
    out = torch.empty_like(query)
    key, value = dense_kv if dense_kv is not None else (query, query)
    _variant_kernel[(meta.num_seqs, triton.cdiv(meta.max_query_len, block_q), num_kv_heads)](
        query,
        kv_layer,
        key,
        value,
        out,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        scale * _LOG2E,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        kv_layer.stride(0),
        kv_layer.stride(1),
        kv_layer.stride(2),
        kv_layer.stride(3),
        meta.block_tables.stride(0),
        key.stride(0),
        key.stride(1),
        GROUP=group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_Q=block_q,
        TILE_N=config.tile_n,
        DENSE=dense_kv is not None,
        TRANS_K=trans_k,
        PREFETCH_IDS=prefetch_ids,
        UPCAST=engine._IS_INTERPRETED and query.dtype != torch.float32,
        num_warps=config.num_warps,
        num_stages=config.num_stages,
    )
    return out


class Case:
    """A random paged batch (blocks scattered over a two-layer cache, as a strided layer view)."""

    def __init__(
        self, heads, kv_heads, head_dim, block_size, query_lens, seq_lens, dtype, device, seed=0
    ):
        gen = torch.Generator(device).manual_seed(seed)
        num_blocks = [-(-s // block_size) for s in seq_lens]
        total = sum(num_blocks)
        cache = torch.randn(
            total, 2, 2, block_size, kv_heads, head_dim, generator=gen, device=device, dtype=dtype
        )
        order = torch.randperm(total, generator=torch.Generator().manual_seed(total)).tolist()
        tables, start = [], 0
        for n in num_blocks:
            tables.append(order[start : start + n])
            start += n
        self.meta = AttentionMetadata.build(query_lens, seq_lens, tables, block_size, device=device)
        self.kv_layer = cache[:, 1]
        self.query = torch.randn(
            sum(query_lens), heads, head_dim, generator=gen, device=device, dtype=dtype
        )
        self.scale = head_dim**-0.5
        self.pairs = sum(q * s - q * (q - 1) // 2 for q, s in zip(query_lens, seq_lens))
        self.kv_bytes = sum(seq_lens) * 2 * kv_heads * head_dim * dtype.itemsize
        if all(
            q == s for q, s in zip(query_lens, seq_lens)
        ):  # fresh prompts: their K/V as the step has them
            key, value = (
                torch.empty(sum(seq_lens), kv_heads, head_dim, device=device, dtype=dtype)
                for _ in range(2)
            )
            for b, (first, last) in enumerate(
                zip(self.meta.host_query_start_loc(), self.meta.host_query_start_loc()[1:])
            ):
                blocks = torch.tensor(tables[b], device=device)
                for i, dst in enumerate((key, value)):
                    dst[first:last] = self.kv_layer[blocks, i].flatten(0, 1)[: last - first]
            self.dense_kv = (key, value)
        self.expected = reference.paged_attention(
            self.query, self.kv_layer, self.meta, self.scale
        ).float()

    def error(self, out: torch.Tensor) -> float:
        return float((out.float() - self.expected).norm() / self.expected.norm())


def time_ms(fn, device) -> float:
    """Median ms of a CUDA graph replay of fn (do_bench flushes L2 before each); one call on a CPU."""
    fn()
    if device.type != "cuda":
        return float("nan")
    import triton.testing

    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return triton.testing.do_bench(graph.replay, warmup=25, rep=100, return_mode="median")


def with_config(config, has_prefill, fn):
    """Runs fn with the engine kernel's launch_config for one step kind replaced by config."""
    default = engine.launch_config
    engine.launch_config = lambda prefill, dim_pad: (
        config if prefill == has_prefill else default(prefill, dim_pad)
    )
    try:
        return fn()
    finally:
        engine.launch_config = default


def decode_sweep(args, device, dtype, copy_gbs):
    print(
        f"decode, CUDA graph replays with the engine's key segments; GB/s of KV read (copy rate {copy_gbs:,.0f}):"
    )
    default = engine.launch_config(False, args.head_dim)
    shapes = (
        [(1, 4)]
        if args.tiny
        else [(256, 640), (256, 128), (64, 256), (32, 256), (1, 256), (1, 2048)]
    )
    configs = [
        engine.LaunchConfig(16, t, w, s)
        for t in (32, 64, 128)
        for w in (2, 4, 8)
        for s in (2, 3, 4)
    ]
    if args.tiny:
        configs = configs[:2]
    for batch, context in shapes:
        case = Case(
            args.heads,
            args.kv_heads,
            args.head_dim,
            args.block_size,
            [1] * batch,
            [context] * batch,
            dtype,
            device,
        )
        if device.type == "cuda":
            case.meta.num_kv_splits = engine.graph_num_splits(batch, args.kv_heads, device)
        rows = []
        for config in configs:

            def run(config=config):
                out = with_config(
                    config,
                    False,
                    lambda: engine.paged_attention_triton(
                        case.query, case.kv_layer, case.meta, case.scale
                    ),
                )
                return out

            try:
                error = case.error(run())
                ms = time_ms(run, device)
            except Exception as exc:  # noqa: BLE001 - a config the compiler rejects is a row, not the end
                print(
                    f"  batch {batch} ctx {context} {config}: failed ({type(exc).__name__}: {exc})"[
                        :200
                    ]
                )
                continue
            rows.append((ms, config, error))
        variants = []
        if case.meta.num_kv_splits in (None, 1):  # the variant kernel has no key segments
            for prefetch in (False, True):
                fn = lambda prefetch=prefetch: variant_attention(  # noqa: E731
                    case.query, case.kv_layer, case.meta, case.scale, default, prefetch_ids=prefetch
                )
                variants.append((prefetch, time_ms(fn, device), case.error(fn())))
        rows.sort(key=lambda r: r[0])
        base = next((r for r in rows if r[1] == default), None)
        print(
            f"  batch {batch:3d} ctx {context:5d} splits {case.meta.num_kv_splits}: engine's {default.tile_n}/"
            f"{default.num_warps}/{default.num_stages} {base[0] if base else float('nan'):.4f} ms "
            f"({case.kv_bytes / (base[0] * 1e-3) / 1e9 if base else 0:,.0f} GB/s)"
        )
        for ms, config, error in rows[:4]:
            print(
                f"      tile {config.tile_n:4d} warps {config.num_warps} stages {config.num_stages}: {ms:.4f} ms, "
                f"{case.kv_bytes / (ms * 1e-3) / 1e9:,.0f} GB/s, err {error:.1e}"
            )
        for prefetch, ms, error in variants:
            print(
                f"      variant, block ids {'a tile ahead' if prefetch else 'per tile    '}: {ms:.4f} ms, "
                f"{case.kv_bytes / (ms * 1e-3) / 1e9 if ms == ms else 0:,.0f} GB/s, err {error:.1e}"
            )


def prefill_sweep(args, device, dtype):
    print(
        "prefill, fresh prompts, CUDA graph replays; TFLOP/s of causal attention (dense bf16 "
        f"{BF16_DENSE_TFLOPS:.0f}):"
    )
    configs = [
        engine.LaunchConfig(*c)
        for c in ((64, 64, 4, 2), (64, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3))
    ]
    lens_list = [[200], [37, 100]] if args.tiny else [[2048], [512] * 16, [4096]]
    if args.tiny:
        configs = configs[:1]
    for lens in lens_list:
        case = Case(
            args.heads, args.kv_heads, args.head_dim, args.block_size, lens, lens, dtype, device
        )
        flops = 4 * args.heads * args.head_dim * case.pairs
        print(
            f"  {len(lens)} x {lens[0]} tokens:"
            if len(set(lens)) == 1
            else f"  prompts of {lens} tokens:"
        )
        rate = lambda ms: flops / (ms * 1e-3) / 1e12  # noqa: E731
        if device.type == "cuda":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            key, value = case.dense_kv
            qd, kd, vd = (
                t.view(len(lens), lens[0], t.shape[1], -1).transpose(1, 2).contiguous()
                for t in (case.query, key, value)
            )

            def cudnn():
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    return torch.nn.functional.scaled_dot_product_attention(
                        qd, kd, vd, is_causal=True, enable_gqa=True
                    )

            def cudnn_on_views():  # the step's own [T, H, D] tensors, output back as [T, H * D] for o_proj
                views = [t.transpose(0, 1).unsqueeze(0) for t in (case.query, key, value)]
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out = torch.nn.functional.scaled_dot_product_attention(
                        *views, is_causal=True, enable_gqa=True
                    )
                return out.squeeze(0).transpose(0, 1).reshape(out.shape[2], -1)

            runs = [("cuDNN (dense, contiguous [B, H, T, D])", cudnn)]
            if len(lens) == 1:
                runs.append(("cuDNN on [T, H, D] views, out to [T, H*D]", cudnn_on_views))
            for name, fn in runs:
                try:
                    ms = time_ms(fn, device)
                    print(f"    {name:<47} {ms:.4f} ms {rate(ms):6.1f} TFLOP/s")
                except Exception as exc:  # noqa: BLE001
                    print(f"    {name}: failed ({type(exc).__name__}: {exc})"[:160])
        kinds = [
            ("engine kernel", None),
            ("variant: no load masks", dict(trans_k=False)),
            ("variant: + keys transposed", dict(trans_k=True)),
            ("variant: + block ids a tile ahead", dict(trans_k=False, prefetch_ids=True)),
            ("variant: dense K/V", dict(trans_k=False, dense=True)),
        ]
        for name, kw in kinds:
            for config in configs:
                if kw is None:
                    fn = lambda config=config: with_config(  # noqa: E731
                        config,
                        True,
                        lambda: engine.paged_attention_triton(  # noqa: E731
                            case.query, case.kv_layer, case.meta, case.scale
                        ),
                    )
                else:
                    fn = lambda config=config, kw=kw: variant_attention(  # noqa: E731
                        case.query,
                        case.kv_layer,
                        case.meta,
                        case.scale,
                        config,
                        dense_kv=case.dense_kv if kw.get("dense") else None,
                        trans_k=kw["trans_k"],
                        prefetch_ids=kw.get("prefetch_ids", False),
                    )
                try:
                    error = case.error(fn())
                    ms = time_ms(fn, device)
                except Exception as exc:  # noqa: BLE001
                    print(
                        f"    {name:<42} {config.rows}/{config.tile_n}/{config.num_warps}/{config.num_stages}: "
                        f"failed ({type(exc).__name__})"
                    )
                    continue
                print(
                    f"    {name:<42} rows {config.rows:3d} tile {config.tile_n:3d} warps {config.num_warps} "
                    f"stages {config.num_stages}: {ms:.4f} ms {rate(ms):6.1f} TFLOP/s err {error:.1e}"
                )


def copy_rate_gbs(device) -> float:
    if device.type != "cuda":
        return float("nan")
    import triton.testing

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), warmup=10, rep=50, return_mode="median")
    return 2 * src.numel() / (ms * 1e-3) / 1e9


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--tiny", action="store_true", help="small shapes on the CPU interpreter: checks only"
    )
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--skip-prefill", action="store_true")
    args = parser.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() and not args.tiny else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args.heads, args.kv_heads, args.head_dim, args.block_size = (
        (4, 1, 32, 16) if args.tiny else (32, 8, 128, 16)
    )
    torch.manual_seed(0)
    print(
        f"# bench/attention_sweep.py{' --tiny' if args.tiny else ''}; "
        f"{torch.cuda.get_device_name(device) if device.type == 'cuda' else 'CPU'}; triton {triton.__version__}"
    )
    copy_gbs = copy_rate_gbs(device)
    if not args.skip_decode:
        decode_sweep(args, device, dtype, copy_gbs)
    if not args.skip_prefill:
        prefill_sweep(args, device, dtype)


if __name__ == "__main__":
    main()
