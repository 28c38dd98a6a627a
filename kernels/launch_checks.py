"""Input checks for the Triton launchers: a bad shape, dtype or stride is a ValueError, not a wrong answer."""

from __future__ import annotations

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# A KV pool may also be FP8 (e4m3, with per-layer scales: paged_attention.py).
KV_DTYPES = FLOAT_DTYPES + (torch.float8_e4m3fn,)


def require(condition: bool, message: str) -> None:
    if not condition:
        raise ValueError(message)


def check_kv_layer(kv_layer: torch.Tensor) -> None:
    require(
        kv_layer.dim() == 5 and kv_layer.shape[1] == 2,
        f"kv_layer must be [num_blocks, 2, block_size, num_kv_heads, head_dim], got {tuple(kv_layer.shape)}",
    )
    require(
        kv_layer.dtype in KV_DTYPES,
        f"kv_layer dtype {kv_layer.dtype} is not fp16/bf16/fp32/float8_e4m3fn",
    )
    # Blocks may be strided (a layer view of the whole cache); each token's heads must be dense rows.
    require(
        kv_layer.stride(-1) == 1,
        f"kv_layer needs unit stride in head_dim, got strides {kv_layer.stride()}",
    )


def check_tokens(
    name: str, tensor: torch.Tensor, num_heads: int, head_dim: int, device: torch.device
) -> None:
    require(
        tensor.dim() == 3 and tensor.shape[1:] == (num_heads, head_dim),
        f"{name} must be [T, {num_heads}, {head_dim}], got {tuple(tensor.shape)}",
    )
    require(tensor.device == device, f"{name} is on {tensor.device}, kv_layer on {device}")
    require(tensor.dtype in FLOAT_DTYPES, f"{name} dtype {tensor.dtype} is not fp16/bf16/fp32")
    require(
        tensor.stride(-1) == 1,
        f"{name} needs unit stride in head_dim, got strides {tensor.stride()}",
    )


def check_index(
    name: str, tensor: torch.Tensor, dims: int, dtypes: tuple, device: torch.device
) -> None:
    require(tensor.dim() == dims, f"{name} must have {dims} dims, got shape {tuple(tensor.shape)}")
    require(tensor.dtype in dtypes, f"{name} dtype {tensor.dtype} not in {dtypes}")
    require(tensor.device == device, f"{name} is on {tensor.device}, kv_layer on {device}")
    require(
        tensor.stride(-1) == 1 or tensor.shape[-1] <= 1,
        f"{name} must be contiguous in its last dim",
    )
