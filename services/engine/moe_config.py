"""The mixture-of-experts fields of a Hugging Face `config.json` (Mixtral, Qwen2-MoE, Qwen3-MoE).

Each family spells the same block its own way; MoEConfig is the one shape the engine reads:
how many experts, how many a token takes, their width, whether the top-k weights are
renormalised, the shared expert (Qwen2-MoE), which layers are sparse, and the checkpoint's
tensor names. Routing follows transformers for each family: softmax over the router logits in
float32, top-k, renormalise when the config says so (Mixtral always does); Mixtral keeps the
weights in float32 when it scales an expert's output, the Qwen families cast them to the
model dtype first.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

# model_type -> architecture name in config.json, for the families with a native MoE path.
MOE_ARCHITECTURES = {
    "mixtral": "MixtralForCausalLM",
    "qwen2_moe": "Qwen2MoeForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
}


@dataclass(frozen=True)
class MoEConfig:
    """hf_block: the checkpoint's name of a layer's MoE module (`block_sparse_moe` in Mixtral,
    `mlp` in Qwen); hf_expert_names: its experts' (gate, up, down) projections."""

    num_experts: int
    num_experts_per_tok: int
    moe_intermediate_size: int
    norm_topk_prob: bool
    shared_expert_intermediate_size: int  # 0: no shared expert
    sparse_layers: tuple[int, ...]
    hf_block: str
    hf_expert_names: tuple[str, str, str]
    float32_routing_weights: bool

    def __post_init__(self) -> None:
        if self.num_experts < 1 or self.moe_intermediate_size < 1:
            raise ValueError(
                f"a MoE model needs num_experts >= 1 and moe_intermediate_size >= 1, got "
                f"{self.num_experts} and {self.moe_intermediate_size}"
            )
        if not 1 <= self.num_experts_per_tok <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.num_experts_per_tok} must be between 1 and "
                f"num_experts={self.num_experts}"
            )

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    def is_sparse(self, layer_index: int) -> bool:
        return layer_index in self.sparse_layers


def _sparse_layers(raw: dict[str, Any], num_layers: int) -> tuple[int, ...]:
    # As transformers' Qwen decoder layers decide it: not listed in mlp_only_layers and every
    # decoder_sparse_step-th layer.
    step = int(raw.get("decoder_sparse_step") or 1)
    dense = set(raw.get("mlp_only_layers") or [])
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def parse_moe(model_type: str, raw: dict[str, Any]) -> MoEConfig | None:
    """The MoE fields of a config.json, or None for a dense model_type."""
    if model_type not in MOE_ARCHITECTURES:
        return None
    num_layers = int(raw["num_hidden_layers"])
    # transformers 5 writes `num_local_experts` for every family; Qwen's own configs `num_experts`.
    num_experts = int(raw.get("num_experts") or raw.get("num_local_experts") or 0)
    top_k = int(raw.get("num_experts_per_tok") or 0)
    if model_type == "mixtral":
        return MoEConfig(
            num_experts=num_experts,
            num_experts_per_tok=top_k,
            moe_intermediate_size=int(raw["intermediate_size"]),
            norm_topk_prob=True,
            shared_expert_intermediate_size=0,
            sparse_layers=tuple(range(num_layers)),
            hf_block="block_sparse_moe",
            hf_expert_names=("w1", "w3", "w2"),
            float32_routing_weights=True,
        )
    return MoEConfig(
        num_experts=num_experts,
        num_experts_per_tok=top_k,
        moe_intermediate_size=int(raw.get("moe_intermediate_size") or 0),
        norm_topk_prob=bool(raw.get("norm_topk_prob", False)),
        shared_expert_intermediate_size=(
            int(raw.get("shared_expert_intermediate_size") or 0) if model_type == "qwen2_moe" else 0
        ),
        sparse_layers=_sparse_layers(raw, num_layers),
        hf_block="mlp",
        hf_expert_names=("gate_proj", "up_proj", "down_proj"),
        float32_routing_weights=False,
    )
