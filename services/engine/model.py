"""Llama-family decoder (Llama 2/3, Mistral, Qwen2, Qwen3; with moe.py's sparse MoE block in
place of the MLP: Mixtral, Qwen2-MoE, Qwen3-MoE) over the paged KV cache.

Flat batches: every tensor is [num_tokens, ...] with no padding; AttentionMetadata says
which rows belong to which sequence. q/k/v and gate/up are fused into one matmul each.
With a LoRABatch (lora_pool.py) each projection adds its tokens' adapters to its output.
Under tensor parallelism (parallel.py) each rank builds the layers of its share: its heads, its
slice of the intermediate size and of the vocabulary; o_proj, down_proj and the embedding end in
an all-reduce, the logits in an all-gather.
With fp8_group_size set, the q/k/v, o, gate/up and down projections hold FP8 weights (linear.py);
the embedding, the norms and the LM head stay in the model dtype.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from tandem.engine.linear import apply_linear, apply_silu_mul_linear, build_linear
from tandem.engine.model_config import ModelConfig
from tandem.engine.moe import SparseMoeBlock
from tandem.engine.parallel import TensorParallel, vocab_parallel_embedding, vocab_range
from tandem.kernels import dispatch as kernels
from tandem.kernels.attention_metadata import AttentionMetadata
from tandem.kernels.fused import rope_cos_sin


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None):
        """rms_norm(x); with a residual, the add is folded in and (rms_norm(residual + x), residual + x) returned."""
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


def rope_inv_freq(config: ModelConfig) -> torch.Tensor:
    dim = config.head_dim
    inv_freq = 1.0 / (
        config.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim)
    )
    scaling = config.rope_scaling
    if scaling is None:
        return inv_freq
    # Llama 3.1: keep high frequencies, divide low ones by `factor`, blend in between.
    factor = scaling["factor"]
    low_freq_factor = scaling["low_freq_factor"]
    high_freq_factor = scaling["high_freq_factor"]
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) & ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to the context length, looked up per token by the KV-store kernel."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        # Computed where the model runs: cos/sin there round as transformers' per-step ones do.
        inv_freq = rope_inv_freq(config).to(device)
        self.register_buffer(
            "cos_sin",
            rope_cos_sin(inv_freq, config.max_position_embeddings, dtype or config.torch_dtype),
            persistent=False,
        )


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
        self.scale = config.head_dim**-0.5
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
        if config.qk_norm:
            self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None

    def forward(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        cos_sin: torch.Tensor,
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        qkv = apply_linear(self.qkv_proj, hidden)
        if lora is not None:
            lora.apply(self.layer_index, "qkv_proj", hidden, qkv)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = q.view(-1, self.num_heads, self.head_dim)
        k = k.view(-1, self.num_kv_heads, self.head_dim)
        v = v.view(-1, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        kv_scales = (self.k_scale, self.v_scale)
        q = kernels.rope_store_kv(
            q, k, v, positions, cos_sin, kv_layer, meta.slot_mapping, kv_scales
        )
        out = kernels.paged_attention(q, kv_layer, meta, self.scale, kv_scales)
        out = out.reshape(-1, self.q_size)
        return self.tp.all_reduce(_project(self.o_proj, out, lora, self.layer_index, "o_proj"))


def _project(linear: nn.Module, x: torch.Tensor, lora, layer_index: int, kind: str) -> torch.Tensor:
    y = apply_linear(linear, x)
    if lora is not None:
        lora.apply(layer_index, kind, x, y)
    return y


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
        intermediate_size = config.intermediate_size // tp.size
        self.gate_up_proj = build_linear(
            config.hidden_size, 2 * intermediate_size, False, fp8_group_size
        )
        self.down_proj = build_linear(intermediate_size, config.hidden_size, False, fp8_group_size)

    def forward(self, x: torch.Tensor, lora=None) -> torch.Tensor:
        gate_up = _project(self.gate_up_proj, x, lora, self.layer_index, "gate_up_proj")
        if lora is None:
            down = apply_silu_mul_linear(self.down_proj, gate_up)
        else:  # the down adapters read the activation
            down = _project(
                self.down_proj, kernels.silu_and_mul(gate_up), lora, self.layer_index, "down_proj"
            )
        return self.tp.all_reduce(down)


class DecoderLayer(nn.Module):
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
        is_sparse = config.moe is not None and config.moe.is_sparse(layer_index)
        self.mlp = (SparseMoeBlock if is_sparse else MLP)(config, layer_index, tp, fp8_group_size)

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
        normed, residual = self.post_attention_layernorm(attn_out, residual)
        return self.mlp(normed, lora), residual


class CausalLM(nn.Module):
    """Parameter names follow the HF checkpoint, except the fused qkv_proj / gate_up_proj.
    fp8_group_size: None for model-dtype projections, else FP8 ones (linear.build_linear)."""

    def __init__(
        self,
        config: ModelConfig,
        tp: TensorParallel = TensorParallel(),
        fp8_group_size: int | None = None,
    ) -> None:
        super().__init__()
        self.config = config
        self.tp = tp
        # Rows of the vocabulary this rank holds (all of it at size 1), zero-padded to an equal share.
        self.vocab_start = vocab_range(config.vocab_size, tp.rank, tp.size)[0]
        vocab_rows = -(-config.vocab_size // tp.size)
        self.embed_tokens = nn.Embedding(vocab_rows, config.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(config, index, tp, fp8_group_size) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.rotary = RotaryEmbedding(config)
        if config.tie_word_embeddings:
            self.lm_head = None
        else:
            self.lm_head = nn.Linear(config.hidden_size, vocab_rows, bias=False)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]; writes the KV of all T tokens.
        lora: the step's LoRABatch, or None when no token uses an adapter."""
        if self.tp.is_parallel:
            hidden = vocab_parallel_embedding(
                input_ids, self.embed_tokens.weight, self.vocab_start, self.tp
            )
        else:
            hidden = self.embed_tokens(input_ids)
        residual = None
        cos_sin = self.rotary.cos_sin
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(
                hidden, residual, positions, cos_sin, meta, kv_cache[:, index], lora
            )
        return self.norm(hidden, residual)[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if not self.tp.is_parallel:
            return kernels.linear(hidden, weight).float()
        # Each rank's rows of the padded vocabulary, side by side; the padding columns cut off.
        return self.tp.gather_last_dim(kernels.linear(hidden, weight))[
            :, : self.config.vocab_size
        ].float()
