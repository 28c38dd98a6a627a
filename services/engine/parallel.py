"""Tensor parallelism: how a rank's share of the weights is cut, and the collectives its layers call.

Megatron's split: q/k/v and gate/up are column-parallel (each rank owns whole heads and a slice of
the intermediate size), o_proj and down_proj are row-parallel (each rank multiplies its slice and an
all-reduce sums the partial products), the embedding and the LM head are vocab-parallel (each rank
owns ceil(vocab / size) rows, zero-padded at the end; lookups outside a rank's rows give zeros that
the all-reduce fills, logits are all-gathered). Norms and rotary tables are replicated. MoE
experts (moe.py) are cut like the dense MLP, each rank a slice of every expert's intermediate
size; the router is replicated.

Every cut here is a pure function of (tensor, rank, size) so the math is tested without processes.
A TensorParallel of size 1 is the identity: no collective runs and no tensor is copied.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine.model_config import ModelConfig


@dataclass(frozen=True)
class TensorParallel:
    """This process's place in the tensor-parallel group; group is the torch.distributed group of
    the model's collectives (NCCL on GPU, gloo on CPU), None at size 1."""

    rank: int = 0
    size: int = 1
    group: Any = None

    @property
    def is_parallel(self) -> bool:
        return self.size > 1

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sums x over the ranks in place (the row-parallel layers' partial products)."""
        if self.size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        """[..., n] on every rank -> [..., size * n], rank r's columns at r * n."""
        if self.size == 1:
            return x
        x = x.contiguous()
        if x.is_cuda:  # one NCCL call, capturable in a CUDA graph
            out = torch.empty((self.size,) + tuple(x.shape), dtype=x.dtype, device=x.device)
            dist.all_gather_into_tensor(out, x, group=self.group)
            parts = out.unbind(0)
        else:
            parts = [torch.empty_like(x) for _ in range(self.size)]
            dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=-1)

    def broadcast(self, x: torch.Tensor) -> torch.Tensor:
        """Rank 0's x on every rank (the sampled token ids the followers feed back next step)."""
        if self.size > 1:
            dist.broadcast(x, src=0, group=self.group)
        return x


def check_divisible(config: ModelConfig, size: int) -> None:
    """Refuses a split this engine cannot make, naming the field (replicating KV heads when the
    group outnumbers them is not implemented)."""
    if size < 1:
        raise ValueError(f"tensor_parallel_size must be >= 1, got {size}")
    sizes = {
        name: getattr(config, name) for name in ("num_heads", "num_kv_heads", "intermediate_size")
    }
    if config.moe is not None:  # every expert is cut along its intermediate size
        sizes["moe_intermediate_size"] = config.moe.moe_intermediate_size
        sizes["shared_expert_intermediate_size"] = config.moe.shared_expert_intermediate_size
    for name, value in sizes.items():
        if value % size:
            raise ValueError(
                f"tensor_parallel_size={size} does not divide the model's {name}={value}: each rank "
                f"must own a whole share (choose a tensor_parallel_size that divides {value})"
            )


def shard_range(total: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of rank's equal share of total (size divides total)."""
    if total % size:
        raise ValueError(f"{total} does not split into {size} equal shares")
    share = total // size
    return rank * share, (rank + 1) * share


def vocab_range(vocab_size: int, rank: int, size: int) -> tuple[int, int]:
    """[start, end) of the token ids rank owns: ceil(vocab / size) each, the last rank fewer (or none)."""
    per_rank = -(-vocab_size // size)
    start = min(rank * per_rank, vocab_size)
    return start, min(start + per_rank, vocab_size)


def shard_rows(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's equal share of dim 0 (a column-parallel weight or bias)."""
    start, end = shard_range(tensor.shape[0], rank, size)
    return tensor[start:end]


def shard_columns(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's equal share of dim 1 (a row-parallel weight)."""
    start, end = shard_range(tensor.shape[1], rank, size)
    return tensor[:, start:end]


def shard_fused(tensor: torch.Tensor, part_sizes: list[int], rank: int, size: int) -> torch.Tensor:
    """A fused column-parallel tensor (q|k|v, gate|up along dim 0): rank's share of each part, fused again."""
    parts = tensor.split(part_sizes, dim=0)
    return torch.cat([shard_rows(part, rank, size) for part in parts])


def shard_vocab(tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """Rank's rows of an embedding or LM head [vocab, hidden], zero-padded to ceil(vocab / size) rows."""
    vocab = tensor.shape[0]
    per_rank = -(-vocab // size)
    start, end = vocab_range(vocab, rank, size)
    out = tensor.new_zeros((per_rank,) + tuple(tensor.shape[1:]))
    out[: end - start] = tensor[start:end]
    return out


def shard_row_bias(bias: torch.Tensor, rank: int) -> torch.Tensor:
    """A row-parallel layer's bias is added once: rank 0 keeps it, the others add zeros before the sum."""
    return bias if rank == 0 else torch.zeros_like(bias)


def shard_parameter(
    name: str, tensor: torch.Tensor, config: ModelConfig, rank: int, size: int
) -> torch.Tensor:
    """Rank's share of the full engine parameter `name` (fused names, loader.py)."""
    if size == 1:
        return tensor
    leaf = name.rsplit(".", 1)[-1]
    if config.moe is not None and ".mlp." in name:
        moe = config.moe
        if name.endswith("mlp.experts.gate_up_proj"):  # [E * 2I, H]: each expert's gate, up
            return shard_fused(
                tensor, [moe.moe_intermediate_size] * (2 * moe.num_experts), rank, size
            )
        if name.endswith("mlp.shared_expert.gate_up_proj.weight"):
            return shard_fused(tensor, [moe.shared_expert_intermediate_size] * 2, rank, size)
        if name.endswith(("mlp.experts.down_proj", "mlp.shared_expert.down_proj.weight")):
            return shard_columns(tensor, rank, size)  # [E * H, I]: every expert's columns at once
    if name.endswith("self_attn.qkv_proj." + leaf):
        q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
        return shard_fused(tensor, [q, kv, kv], rank, size)
    if name.endswith("mlp.gate_up_proj." + leaf):
        return shard_fused(tensor, [config.intermediate_size] * 2, rank, size)
    if name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight")):
        return shard_columns(tensor, rank, size)
    if name.endswith(("self_attn.o_proj.weight_scale", "mlp.down_proj.weight_scale")):
        # FP8 scales [rows, groups] of a row-parallel weight: one per row stays whole on every
        # rank; block scales follow their columns.
        return tensor if tensor.shape[1] == 1 else shard_columns(tensor, rank, size)
    if name.endswith(("self_attn.o_proj.bias", "mlp.down_proj.bias")):
        return shard_row_bias(tensor, rank)
    if name in ("embed_tokens.weight", "lm_head.weight"):
        return shard_vocab(tensor, rank, size)
    return tensor  # norms: replicated


def vocab_parallel_embedding(
    input_ids: torch.Tensor, weight: torch.Tensor, vocab_start: int, tp: TensorParallel
) -> torch.Tensor:
    """Embeddings of input_ids from rank shards [per_rank, hidden]: each rank looks up the ids it
    owns (zeros for the others) and the all-reduce adds the one non-zero row per token."""
    if tp.size == 1:
        return torch.nn.functional.embedding(input_ids, weight)
    local = input_ids - vocab_start
    owned = (local >= 0) & (local < weight.shape[0])
    hidden = torch.nn.functional.embedding(local.clamp(0, weight.shape[0] - 1), weight)
    hidden = hidden * owned.unsqueeze(-1).to(hidden.dtype)
    return tp.all_reduce(hidden)
