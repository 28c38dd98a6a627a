"""Picks the kernel backend per call: Triton for CUDA tensors, the torch reference otherwise.

`TANDEM_ATTENTION_BACKEND=torch|triton` forces one (read at each call, so tests and
benchmarks can flip it); forcing triton on CPU tensors needs TRITON_INTERPRET=1.
Triton is imported lazily: a CPU-only install without it still serves.
"""

from __future__ import annotations

import functools
import importlib
import os
from types import ModuleType

import torch
import torch.nn.functional as F

from tandem.kernels import batch_invariant
from tandem.kernels import fp8 as fp8_reference
from tandem.kernels import fused as fused_reference
from tandem.kernels import greedy as greedy_reference
from tandem.kernels import lora as lora_reference
from tandem.kernels import moe as moe_reference
from tandem.kernels import paged_attention as reference
from tandem.kernels.attention_metadata import AttentionMetadata

_BACKENDS = ("torch", "triton")


@functools.cache
def _triton_module(name: str = "paged_attention_triton") -> ModuleType | None:
    try:
        return importlib.import_module(f"tandem.kernels.{name}")
    except ImportError:
        return None


def backend_for(device: torch.device) -> str:
    """The backend a call on `device` uses: the env override, else triton on CUDA when it imports."""
    forced = os.environ.get("TANDEM_ATTENTION_BACKEND", "").strip().lower()
    if forced:
        if forced not in _BACKENDS:
            raise ValueError(f"TANDEM_ATTENTION_BACKEND={forced!r}; expected one of {_BACKENDS}")
        if forced == "triton" and _triton_module() is None:
            raise ValueError("TANDEM_ATTENTION_BACKEND=triton but triton does not import")
        return forced
    return "triton" if device.type == "cuda" and _triton_module() is not None else "torch"


def _fused(device: torch.device) -> ModuleType:
    return _triton_module("fused_triton") if backend_for(device) == "triton" else fused_reference


def store_kv(
    key: torch.Tensor,
    value: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
) -> None:
    """Writes token i's key/value [T, Hkv, D] to slot `slot_mapping[i]` (-1: skip); an FP8 pool
    stores key / k_scale and value / v_scale."""
    if backend_for(kv_layer.device) == "triton":
        _triton_module().store_kv_triton(key, value, kv_layer, slot_mapping, kv_scales)
    else:
        reference.store_kv(key, value, kv_layer, slot_mapping, kv_scales)


def paged_attention(
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    window: int = 0,
    softcap: float = 0.0,
) -> torch.Tensor:
    """Causal GQA attention of each sequence's new tokens over its paged KV: [T, Hq, D] -> [T, Hq, D].
    window > 0: a sliding-window layer; softcap > 0: capped scores (paged_attention.py). Every
    backend applies both. Under batch_invariant.batch_invariant(): the fixed-chunk schedule."""
    if batch_invariant.is_enabled():
        return batch_invariant.paged_attention(
            query, kv_layer, meta, scale, kv_scales, window, softcap
        )
    if backend_for(kv_layer.device) == "triton":
        return _triton_module().paged_attention_triton(
            query, kv_layer, meta, scale, kv_scales, window, softcap
        )
    return reference.paged_attention(query, kv_layer, meta, scale, kv_scales, window, softcap)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _fused(x.device).rms_norm(x, weight, eps)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x)."""
    return _fused(x.device).add_rms_norm(x, residual, weight, eps)


def add_rms_norm_fp8(
    x: torch.Tensor,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    weight_scale: torch.Tensor,
) -> tuple[fp8_reference.QuantizedRows, torch.Tensor] | None:
    """add_rms_norm whose normed rows go straight into the FP8 activation quantizer (one kernel,
    the model-dtype rows never written) when the FP8 projection after it (weight_scale) would
    quantize them anyway: the Triton backend, more than one row (one goes to the FP8 GEMV unless
    TANDEM_GEMV=off), one scale a row, not batch invariant. None otherwise: the caller runs
    add_rms_norm."""
    if (
        batch_invariant.is_enabled()
        or weight_scale.shape[1] != 1
        or x.dim() != 2
        or x.shape[0] < 2
        or backend_for(x.device) != "triton"
    ):
        return None
    xq, scale, total = _triton_module("fused_triton").add_rms_norm_quantize(
        x, residual, weight, eps
    )
    return fp8_reference.QuantizedRows(xq, scale, x.dtype), total


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:
    return _fused(gate_up.device).silu_and_mul(gate_up)


def rope_store_kv(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    positions: torch.Tensor,
    cos_sin: torch.Tensor,
    kv_layer: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv_scales: tuple[float, float] = (1.0, 1.0),
    rotated_key: torch.Tensor | None = None,
) -> torch.Tensor:
    """Rotary embedding of query and key, the key and value stored to their slots; returns the
    rotated query (and writes the rotated key to rotated_key, when given)."""
    return _fused(kv_layer.device).rope_store_kv(
        query, key, value, positions, cos_sin, kv_layer, slot_mapping, kv_scales, rotated_key
    )


def _fresh_prefill_enabled() -> bool:
    """TANDEM_FRESH_PREFILL=on (the default) or off (every step through the paged kernel); read
    at each call, like the backend override."""
    value = os.environ.get("TANDEM_FRESH_PREFILL", "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"TANDEM_FRESH_PREFILL={value!r}; expected on or off")
    return value == "on"


def fresh_prefill(
    meta: AttentionMetadata,
    query: torch.Tensor,
    kv_layer: torch.Tensor,
    window: int = 0,
    softcap: float = 0.0,
) -> bool:
    """Whether a step's attention runs over its own keys (prefill_attention_triton.py) instead of
    the paged pool: fresh prompts only (AttentionMetadata.fresh_prompts), on the Triton backend,
    a full-attention layer without soft-capping, a pool in the query's dtype (an FP8 pool's
    prompts see their keys quantized, as the decode will), not batch-invariant, on a GPU a shape
    its tiles were measured for (prefill_attention_triton.tiled_on_gpu), unless
    TANDEM_FRESH_PREFILL=off."""
    return (
        meta.fresh_prompts
        and window == 0
        and softcap == 0.0
        and kv_layer.dtype == query.dtype
        and not batch_invariant.is_enabled()
        and backend_for(query.device) == "triton"
        and (
            query.device.type != "cuda"
            or _triton_module("prefill_attention_triton").tiled_on_gpu(query.shape[-1], query.dtype)
        )
        and _fresh_prefill_enabled()
    )


def fresh_prefill_attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    """Causal GQA attention of fresh prompts over their own rotated keys and values: [T, Hq, D]
    (for a step fresh_prefill() admits; the paged kernel's result within rounding)."""
    return _triton_module("prefill_attention_triton").fresh_prefill_attention(
        query, key, value, meta.query_start_loc, meta.max_query_len, scale
    )


# A step's greedy draws of its rows, on the device: (ids int64, log-probabilities float32, the
# rows' log-sum-exp float32), each [rows].
GreedyDraws = tuple[torch.Tensor, torch.Tensor, torch.Tensor]


def greedy_draw(logits: torch.Tensor, out: GreedyDraws | None = None) -> GreedyDraws:
    """float32 logits [R, V] -> (each row's argmax int64, the first on ties; its log-probability; the
    row's log-sum-exp): one read of the logits on the Triton backend (greedy_triton.py). out: three
    [R] tensors of those dtypes to write them into (a CUDA graph's buffers)."""
    if backend_for(logits.device) == "triton":
        return _triton_module("greedy_triton").greedy_draw(logits, out=out)
    return greedy_reference.greedy_draw(logits, out)


def lora_shrink(x: torch.Tensor, a_pool: torch.Tensor, meta) -> torch.Tensor:
    """Partial sums [splits, T, N] float32 of x[t] @ A[slot(t)]^T for the tokens that use an adapter."""
    if backend_for(x.device) == "triton":
        return _triton_module("lora_triton").lora_shrink(x, a_pool, meta)
    return lora_reference.lora_shrink(x, a_pool, meta)


def lora_expand(
    buf: torch.Tensor, b_pool: torch.Tensor, meta, y: torch.Tensor, slice_bounds: tuple[int, ...]
) -> None:
    """y[t, slice] += shrink result @ B[slot(t), slice]^T, in place, for the tokens that use an adapter."""
    if backend_for(y.device) == "triton":
        _triton_module("lora_triton").lora_expand(buf, b_pool, meta, y, slice_bounds)
    else:
        lora_reference.lora_expand(buf, b_pool, meta, y, slice_bounds)


def check_settings(device: torch.device) -> None:
    """The kernel settings read from the environment, checked once before a model loads: a bad
    value is a ValueError at start-up, not in the middle of a step."""
    backend_for(device)
    _gemv_enabled()
    _fresh_prefill_enabled()


def _gemv_enabled() -> bool:
    """TANDEM_GEMV=on (the default) or off (cuBLAS for every shape); read at each call, like the
    backend override, so set it before the decode graphs are captured."""
    value = os.environ.get("TANDEM_GEMV", "on").strip().lower()
    if value not in ("on", "off"):
        raise ValueError(f"TANDEM_GEMV={value!r}; expected on or off")
    return value == "on"


def _takes_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """One contiguous row with K >= 1 on the Triton backend, unless TANDEM_GEMV=off."""
    return (
        x.dim() == 2
        and x.shape[0] == 1
        and x.shape[1] > 0
        and x.is_contiguous()
        and weight.stride(1) == 1
        and (x.dtype == weight.dtype or weight.dtype == torch.float8_e4m3fn)
        and backend_for(x.device) == "triton"
        and _gemv_enabled()
    )


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [T, K] @ weight [N, K]^T (+ bias): one row goes to the Triton GEMV (gemv_triton.py), more to cuBLAS.
    Under batch_invariant.batch_invariant(): fixed row tiles on every backend."""
    if batch_invariant.is_enabled():
        return batch_invariant.linear(x, weight, bias)
    if _takes_gemv(x, weight):
        return _triton_module("gemv_triton").gemv(x, weight, bias)
    return F.linear(x, weight, bias)


def silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """silu_and_mul(gate_up) @ weight^T; for one row SwiGLU rides in the GEMV's loads (one kernel)."""
    if batch_invariant.is_enabled():
        return batch_invariant.linear(silu_and_mul(gate_up), weight)
    if _takes_gemv(gate_up, weight):
        return _triton_module("gemv_triton").silu_mul_gemv(gate_up, weight)
    return F.linear(silu_and_mul(gate_up), weight)


def fp8_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x [T, K] @ an FP8 weight [N, K] with scales [N, G] (fp8.py): one row goes to the Triton FP8
    GEMV (weight-only dequantization), more to torch._scaled_mm, whose activations Triton quantizes
    in one kernel on CUDA (fp8_triton.py) and torch on the CPU. So on a GPU a one-row step's
    numbers differ from a batched step's (W8A16 against W8A8), as the bf16 GEMV's reduction
    order already differs from cuBLAS's. Under batch_invariant.batch_invariant() (--deterministic):
    torch._scaled_mm in fixed row tiles (its per-token scales are per row), whatever the rows."""
    if batch_invariant.is_enabled():
        return batch_invariant.tiled_rows(
            lambda tile: fp8_reference.fp8_linear(tile, weight, weight_scale, bias), x
        )
    if _takes_gemv(x, weight):
        return _triton_module("gemv_triton").fp8_gemv(x, weight, weight_scale, bias)
    if backend_for(x.device) == "triton" and x.stride(1) == 1:
        quantize = _triton_module("fp8_triton").quantize_rows
        return fp8_reference.fp8_linear(x, weight, weight_scale, bias, quantize=quantize)
    return fp8_reference.fp8_linear(x, weight, weight_scale, bias)


def fp8_silu_mul_linear(
    gate_up: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor
) -> torch.Tensor:
    """silu_and_mul(gate_up) @ an FP8 weight; for one row SwiGLU rides in the FP8 GEMV's loads,
    for more on the Triton backend in the activations' quantizer (fp8_triton.py)."""
    if batch_invariant.is_enabled():
        return fp8_linear(silu_and_mul(gate_up), weight, weight_scale)
    if _takes_gemv(gate_up, weight):
        return _triton_module("gemv_triton").fp8_silu_mul_gemv(gate_up, weight, weight_scale)
    if backend_for(gate_up.device) == "triton" and gate_up.stride(1) == 1:
        # SwiGLU rides in the activations' quantizer: its model-dtype output is never written.
        xq, x_scale = _triton_module("fp8_triton").silu_mul_quantize_rows(
            gate_up, weight_scale.shape[1]
        )
        return fp8_reference.fp8_linear_quantized(xq, x_scale, weight, weight_scale, gate_up.dtype)
    return fp8_linear(silu_and_mul(gate_up), weight, weight_scale)


def fused_moe(
    x: torch.Tensor,
    w_gate_up: torch.Tensor,
    w_down: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
) -> torch.Tensor:
    """x [T, H] through its top-k experts' SwiGLU MLPs (w_gate_up [E, 2I, H], w_down [E, H, I]),
    weighted and summed per token: one grouped GEMM per projection on the Triton backend
    (moe_triton.py), the per-expert torch loop otherwise (moe.py). Under
    batch_invariant.batch_invariant(): the torch loop with fixed row tiles on every backend."""
    if batch_invariant.is_enabled():
        return moe_reference.fused_moe(
            x, w_gate_up, w_down, topk_weights, topk_ids, linear=batch_invariant.linear
        )
    if backend_for(x.device) == "triton":
        return _triton_module("moe_triton").fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
    return moe_reference.fused_moe(x, w_gate_up, w_down, topk_weights, topk_ids)
