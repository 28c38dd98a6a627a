"""The residual arrangements of the families whose layers are not Llama's (model.DecoderLayer):
Gemma 2/3's sandwich norms and OLMo 2's post-norms, built from model.py's blocks.

A layer hands the next one (its output, the residual stream before it): the next norm adds them,
so the residual adds ride in the norm kernels where the arrangement allows.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.model import MLP, Attention, RMSNorm
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import TensorParallel


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


FAMILY_DECODER_LAYERS = {"sandwich": SandwichDecoderLayer, "post": PostNormDecoderLayer}
