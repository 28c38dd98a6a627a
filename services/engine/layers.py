"""The decoder's layers: norms, attention over the paged KV cache, the gated MLP, and the three
residual arrangements the supported families use.

Flat batches: every tensor is [num_tokens, ...] with no padding; AttentionMetadata says which rows
belong to which sequence. q/k/v and gate/up are fused into one matmul each. With a LoRABatch
(lora_pool.py) each projection adds its tokens' adapters to its output. Under tensor parallelism
(parallel.py) each rank builds its heads and its slice of the intermediate size; o_proj and
down_proj end in an all-reduce.

A layer hands the next one (its output, the residual stream before it): the next norm adds them,
so the residual adds ride in the norm kernels (kernels/fused*.py).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.linear import apply_linear, apply_silu_mul_linear, build_linear
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import TensorParallel
from tandem.kernels import dispatch as kernels


class RMSNorm(nn.Module):
    """offset 1.0: Gemma's norm, which multiplies by (1 + weight) (the checkpoint stores weight)
    in float32 before the cast back, unlike Llama's (cast, then weight): torch ops, not the fused
    kernel, so a bf16 Gemma rounds where transformers' does."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); with a residual, the add is folded in and (rms_norm(residual + x), residual + x) returned."""
        if self.offset:
            total = x if residual is None else residual + x
            normed = total.float()
            normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
            normed = (normed * (self.offset + self.weight.float())).to(total.dtype)
            return normed if residual is None else (normed, total)
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def _project(linear: nn.Module, x: torch.Tensor, lora, layer_index: int, kind: str) -> torch.Tensor:
    y = apply_linear(linear, x)
    if lora is not None:
        lora.apply(layer_index, kind, x, y)
    return y


class Attention(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.tp = tp
        self.num_heads = config.num_heads // tp.size
        self.num_kv_heads = config.num_kv_heads // tp.size
        self.head_dim = config.head_dim
        self.q_size = self.num_heads * config.head_dim
        self.kv_size = self.num_kv_heads * config.head_dim
        self.scale = config.softmax_scale
        self.window = config.layer_window(layer_index)
        self.softcap = config.attn_softcap
        # Gemma 3's sliding layers rotate with their own table (CausalLM passes both).
        self.uses_local_rope = config.local_rope is not None and self.window > 0
        self.qkv_proj = build_linear(
            config.hidden_size,
            self.q_size + 2 * self.kv_size,
            config.attention_bias,
            fp8_group_size,
        )
        self.o_proj = build_linear(
            self.q_size, config.hidden_size, config.has_o_proj_bias, fp8_group_size
        )
        # What an FP8 KV pool stores is k / k_scale and v / v_scale (1.0 unless the checkpoint
        # gives calibrated scales; the loader sets them). Unused by a pool in the model dtype.
        self.k_scale = self.v_scale = 1.0
        self.q_norm = self.k_norm = None
        self.norm_all_heads = config.qk_norm and config.qk_norm_scope == "all"
        if self.norm_all_heads:
            # OLMo 2 normalizes the whole projection: a rank holding some heads cannot.
            if tp.is_parallel:
                raise ValueError(
                    f"{config.model_type} normalizes q and k over all heads: tensor parallelism "
                    f"is not supported for it (give tensor_parallel_size 1)"
                )
            self.q_norm = RMSNorm(self.q_size, config.rms_norm_eps)
            self.k_norm = RMSNorm(self.kv_size, config.rms_norm_eps)
        elif config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps, config.norm_offset)

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        meta,
        kv_layer: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        """cos_sin: the (global, local) rotary tables; meta: the step's AttentionMetadata."""
        qkv = apply_linear(self.qkv_proj, hidden)
        if lora is not None:
            lora.apply(self.layer_index, "qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None and not self.norm_all_heads:
            q, k = self.q_norm(q), self.k_norm(k)
        kv_scales = (self.k_scale, self.v_scale)
        table = cos_sin[1] if self.uses_local_rope else cos_sin[0]
        q = kernels.rope_store_kv(q, k, v, positions, table, kv_layer, meta.slot_mapping, kv_scales)
        out = kernels.paged_attention(
            q, kv_layer, meta, self.scale, kv_scales, self.window, self.softcap
        )
        out = out.reshape(-1, self.q_size)
        return self.tp.all_reduce(_project(self.o_proj, out, lora, self.layer_index, "o_proj"))


class MLP(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.layer_index = layer_index
        self.tp = tp
        self.is_gelu = config.hidden_act == "gelu_pytorch_tanh"
        intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = build_linear(
            config.hidden_size, 2 * intermediate_size, False, fp8_group_size
        )
        self.down_proj = build_linear(intermediate_size, config.hidden_size, False, fp8_group_size)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gate_up = _project(self.gate_up_proj, x, lora, self.layer_index, "gate_up_proj")
        if self.is_gelu:  # Gemma: GeGLU, tanh-approximated gelu on the gate
            gate, up = gate_up.chunk(2, dim=-1)
            act = F.gelu(gate, approximate="tanh") * up
            down = _project(self.down_proj, act, lora, self.layer_index, "down_proj")
        elif lora is None:
            down = apply_silu_mul_linear(self.down_proj, gate_up)
        else:  # the down adapters read the activation
            down = _project(
                self.down_proj, kernels.silu_and_mul(gate_up), lora, self.layer_index, "down_proj"
            )
        return self.tp.all_reduce(down)


class DecoderLayer(nn.Module):
    """Llama's arrangement: norm -> attention -> add, norm -> MLP -> add. Granite scales each
    block's output by residual_multiplier before its add."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = Attention(config, layer_index, tp, fp8_group_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_index, tp, fp8_group_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, hidden, residual, positions, cos_sin, meta, kv_layer, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP's output and the residual stream before it; the next layer's norm adds them
        (the residual adds ride in the norm kernels)."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(normed, positions, cos_sin, meta, kv_layer, lora)
        if self.residual_multiplier != 1.0:
            attn_out = attn_out * self.residual_multiplier
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        out = self.mlp(normed, lora)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual


class SandwichDecoderLayer(nn.Module):
    """Gemma 2/3: norms before and after each block, the residual added after the second."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        dim, eps, offset = config.hidden_size, config.rms_norm_eps, config.norm_offset
        self.input_layernorm = RMSNorm(dim, eps, offset)
        self.self_attn = Attention(config, layer_index, tp, fp8_group_size)
        self.post_attention_layernorm = RMSNorm(dim, eps, offset)
        self.pre_feedforward_layernorm = RMSNorm(dim, eps, offset)
        self.mlp = MLP(config, layer_index, tp, fp8_group_size)
        self.post_feedforward_layernorm = RMSNorm(dim, eps, offset)

    def forward(
        self, hidden, residual, positions, cos_sin, meta, kv_layer, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(hidden, residual)
        attn_out = self.self_attn(normed, positions, cos_sin, meta, kv_layer, lora)
        attn_out = self.post_attention_layernorm(attn_out)
        normed, residual = self.pre_feedforward_layernorm(attn_out, residual)
        return self.post_feedforward_layernorm(self.mlp(normed, lora)), residual


class PostNormDecoderLayer(nn.Module):
    """OLMo 2: no norm before a block; each block's output is normalized, then added."""

    def __init__(
        self,
        config: ModelConfig,
        layer_index: int,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.self_attn = Attention(config, layer_index, tp, fp8_group_size)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = MLP(config, layer_index, tp, fp8_group_size)
        self.post_feedforward_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self, hidden, residual, positions, cos_sin, meta, kv_layer, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        stream = hidden if residual is None else residual + hidden
        attn_out = self.self_attn(stream, positions, cos_sin, meta, kv_layer, lora)
        stream = stream + self.post_attention_layernorm(attn_out)
        return self.post_feedforward_layernorm(self.mlp(stream, lora)), stream


DECODER_LAYERS = {
    "pre": DecoderLayer,
    "sandwich": SandwichDecoderLayer,
    "post": PostNormDecoderLayer,
}
