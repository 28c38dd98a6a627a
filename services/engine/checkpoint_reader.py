"""Reads a checkpoint's tensors from its *.safetensors files: whole, or only a tensor-parallel
rank's share of each (safetensors' get_slice reads just those bytes from the mapped file).

A rank's share is the cut parallel.shard_parameter makes of the full engine parameter: its rows
of each part of a column-parallel projection (q/k/v, gate/up; fused in the file too for Phi-3;
every MoE expert's gate/up), its columns of a row-parallel weight (o_proj, down_proj, every
expert's down), its vocabulary rows of the embedding and the LM head (zero-padded to the equal
share), a row-parallel bias on rank 0 only (zeros elsewhere), norms and MoE routers whole.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import TensorParallel, shard_range, vocab_range
from tandem.engine.progress import Progress


class CheckpointFiles:
    """The open files of a checkpoint, the names they hold, and the bytes read so far."""

    def __init__(self, files: list[Path], stack: contextlib.ExitStack):
        self.handles = {}
        for path in files:
            handle = stack.enter_context(safe_open(str(path), framework="pt"))
            for key in handle.keys():
                self.handles[key] = handle
        self.num_bytes_read = 0
        self.where = files[0].parent if files else "?"
        self.file_bytes = sum(path.stat().st_size for path in files)
        self.plan(len(self.handles), self.file_bytes)

    def plan(self, num_reads: int, num_bytes: int) -> None:
        """The reads and bytes the progress lines count towards (a load may skip some tensors,
        or read a share of each)."""
        self.progress = Progress(f"loading weights from {self.where}", num_reads, num_bytes)

    def names(self) -> set[str]:
        return set(self.handles)

    def _count(self, tensor: torch.Tensor) -> torch.Tensor:
        num_bytes = tensor.numel() * tensor.element_size()
        self.num_bytes_read += num_bytes
        self.progress.step(num_bytes)
        return tensor

    def whole(self, name: str) -> torch.Tensor:
        return self._count(self.handles[name].get_tensor(name))

    def rows(self, name: str, ranges: list[tuple[int, int]]) -> torch.Tensor:
        """Rows [start, end) of each range, concatenated along dim 0."""
        tensor_slice = self.handles[name].get_slice(name)
        return self._count(torch.cat([tensor_slice[start:end] for start, end in ranges]))

    def columns(self, name: str, start: int, end: int) -> torch.Tensor:
        return self._count(self.handles[name].get_slice(name)[:, start:end])

    def shape(self, name: str) -> list[int]:
        return self.handles[name].get_slice(name).get_shape()

    def is_fp8(self, name: str) -> bool:
        return self.handles[name].get_slice(name).get_dtype() == "F8_E4M3"


def _fused_part_rows(config: ModelConfig, module: str) -> list[int]:
    if module.endswith("self_attn.qkv_proj"):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return [q, kv, kv]
    return [config.intermediate_size] * 2  # mlp.gate_up_proj


def read_rank_share(
    files: CheckpointFiles,
    name: str,
    parts: tuple[str, ...],
    config: ModelConfig,
    tp: TensorParallel,
) -> torch.Tensor:
    """Rank tp.rank's share of engine parameter `name` (loader naming), made of the HF tensors
    `parts`, read slice by slice: equal to shard_parameter(name, cat(parts whole), ...)."""
    module = name.rsplit(".", 1)[0]
    # A MoE block's (moe.py): every expert's gate|up rows, or its down columns, part by part.
    moe_rows = name.endswith(("mlp.experts.gate_up_proj", "mlp.shared_expert.gate_up_proj.weight"))
    if name.endswith(("mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight")):
        return torch.cat(
            [files.columns(p, *shard_range(files.shape(p)[1], tp.rank, tp.size)) for p in parts]
        )
    if moe_rows or module.endswith(("self_attn.qkv_proj", "mlp.gate_up_proj")):
        if len(parts) == 1:  # fused in the file too: the rank's rows of each sub-part
            ranges, offset = [], 0
            for rows in _fused_part_rows(config, module):
                start, end = shard_range(rows, tp.rank, tp.size)
                ranges.append((offset + start, offset + end))
                offset += rows
            return files.rows(parts[0], ranges)
        pieces = []
        for part in parts:
            rows = files.shape(part)[0]
            pieces.append(files.rows(part, [shard_range(rows, tp.rank, tp.size)]))
        return torch.cat(pieces)
    (part,) = parts
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        start, end = shard_range(files.shape(part)[1], tp.rank, tp.size)
        return files.columns(part, start, end)
    if name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias")):
        bias = files.whole(part)  # a vector: cheap to read on every rank
        return bias if tp.rank == 0 else torch.zeros_like(bias)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        shape = files.shape(part)
        start, end = vocab_range(shape[0], tp.rank, tp.size)
        rows = files.rows(part, [(start, end)])
        padded = rows.new_zeros((-(-shape[0] // tp.size),) + tuple(shape[1:]))
        padded[: end - start] = rows
        return padded
    return files.whole(part)  # norms: replicated
