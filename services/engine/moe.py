"""The sparse MoE block of Mixtral, Qwen2-MoE and Qwen3-MoE, in place of a layer's dense MLP.

A router picks each token's top-k experts (kernels/moe.py `route`, as transformers computes it
per family: moe_config.py); the experts run as one fused grouped GEMM on CUDA
(kernels/moe_triton.py) and as the torch reference elsewhere. Qwen2-MoE adds a shared expert
that every token takes, scaled by sigmoid(shared_expert_gate(x)).

Parameters: `gate.weight` [E, H] (the router), `experts.gate_up_proj` [E * 2I, H] (expert e's
gate rows then its up rows at e * 2I) and `experts.down_proj` [E * H, I], flat so that the
loader fills them as it fills any fused projection: the checkpoint's per-expert tensors one
after the other along dim 0 (hf_tensor_names). Under tensor parallelism each rank holds a slice
of every expert's intermediate size (parallel.shard_parameter), and the block ends in one
all-reduce, as the dense MLP does; the router is replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.linear import apply_linear, apply_silu_mul_linear
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import TensorParallel
from tandem.kernels import dispatch as kernels
from tandem.kernels.moe import route


class Experts(nn.Module):
    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.num_experts, self.hidden_size = num_experts, hidden_size
        self.intermediate_size = intermediate_size
        self.gate_up_proj = nn.Parameter(
            torch.empty(num_experts * 2 * intermediate_size, hidden_size), False
        )
        self.down_proj = nn.Parameter(
            torch.empty(num_experts * hidden_size, intermediate_size), False
        )

    def stacked(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(w_gate_up [E, 2I, H], w_down [E, H, I]): views of the flat parameters."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        return self.gate_up_proj.view(e, 2 * i, h), self.down_proj.view(e, h, i)


class SharedExpert(nn.Module):
    """Qwen2-MoE's shared expert: a SwiGLU MLP with gate/up fused, no all-reduce of its own."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return apply_silu_mul_linear(self.down_proj, apply_linear(self.gate_up_proj, x))


class SparseMoeBlock(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        moe = config.moe
        if moe is None or not moe.is_sparse(layer_index):
            raise ValueError(f"layer {layer_index} of {config.model_type} has no MoE block")
        if fp8_group_size is not None:
            raise ValueError(
                f"FP8 weights are not supported for {config.model_type}'s experts yet: serve the "
                f"bf16/fp16 checkpoint without --quantization fp8"
            )
        self.layer_index = layer_index
        self.tp = tp
        self.top_k = moe.num_experts_per_tok
        self.renormalize = moe.norm_topk_prob
        self.float32_routing_weights = moe.float32_routing_weights
        self.gate = nn.Linear(config.hidden_size, moe.num_experts, bias=False)
        self.experts = Experts(
            moe.num_experts, config.hidden_size, moe.moe_intermediate_size // tp.size
        )
        if moe.has_shared_expert:
            self.shared_expert = SharedExpert(
                config.hidden_size, moe.shared_expert_intermediate_size // tp.size
            )
            self.shared_expert_gate = nn.Linear(config.hidden_size, 1, bias=False)
        else:
            self.shared_expert = self.shared_expert_gate = None

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        """x [T, H] -> [T, H]. lora: unused (adapters target attention only on MoE models:
        lora_adapter.lora_modules)."""
        router_logits = kernels.linear(x, self.gate.weight)
        weights, ids = route(router_logits, self.top_k, self.renormalize)
        if not self.float32_routing_weights:
            weights = weights.to(x.dtype)
        w_gate_up, w_down = self.experts.stacked()
        out = kernels.fused_moe(x, w_gate_up, w_down, weights, ids)
        if self.shared_expert is not None:
            shared = self.shared_expert(x)
            gate = torch.sigmoid(kernels.linear(x, self.shared_expert_gate.weight))
            out = out + gate * shared
        return self.tp.all_reduce(out)


def precompile(model: nn.Module) -> None:
    """Compiles the fused MoE kernel's variants for model's sparse layers (they share one shape)
    before serving; a no-op for a dense model. Only where the Triton backend runs."""
    from tandem.kernels import moe_triton

    block = next((m for m in model.modules() if isinstance(m, SparseMoeBlock)), None)
    if block is not None:
        w_gate_up, w_down = block.experts.stacked()
        dtype = torch.float32 if block.float32_routing_weights else w_down.dtype
        moe_triton.precompile_variants(w_gate_up, w_down, block.top_k, dtype)


def _layer_and_rest(engine_name: str) -> tuple[int, str] | None:
    parts = engine_name.split(".", 3)
    if len(parts) < 4 or parts[0] != "layers" or parts[2] != "mlp":
        return None
    return int(parts[1]), parts[3]


def hf_tensor_names(engine_name: str, config: ModelConfig) -> tuple[str, ...] | None:
    """The checkpoint tensors an engine parameter of a MoE block is made of, concatenated along
    dim 0 in this order; None for every other parameter (the loader's own rules)."""
    moe = config.moe
    located = _layer_and_rest(engine_name) if moe is not None else None
    if located is None or not moe.is_sparse(located[0]):
        return None
    layer, rest = located
    block = f"model.layers.{layer}.{moe.hf_block}"
    gate, up, down = moe.hf_expert_names
    experts = range(moe.num_experts)
    if rest == "experts.gate_up_proj":
        return tuple(f"{block}.experts.{e}.{name}.weight" for e in experts for name in (gate, up))
    if rest == "experts.down_proj":
        return tuple(f"{block}.experts.{e}.{down}.weight" for e in experts)
    if rest == "shared_expert.gate_up_proj.weight":
        return (f"{block}.shared_expert.gate_proj.weight", f"{block}.shared_expert.up_proj.weight")
    return (f"{block}.{rest}",)
