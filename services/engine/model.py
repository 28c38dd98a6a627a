"""The decoder over the paged KV cache: Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2, Gemma 3 (text),
Phi-3, OLMo 2, Granite; Mixtral, Qwen2-MoE, Qwen3-MoE (moe.py's sparse MoE block in place of the
MLP). One graph; ModelConfig says where a family departs from Llama, and family_layers.py holds
the residual arrangements other than Llama's (Gemma's, OLMo 2's).

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

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.linear import (
    Fp8Linear,
    apply_linear,
    apply_silu_mul_linear,
    build_linear,
    fp8_input,
)
from tandem.engine.model_config import ModelConfig
from tandem.engine.moe import SparseMoeBlock
from tandem.engine.parallel import TensorParallel, vocab_parallel_embedding, vocab_range
from tandem.engine.rope import rope_cos_sin_table
from tandem.kernels import dispatch as kernels
from tandem.kernels.attention_metadata import AttentionMetadata


class RMSNorm(nn.Module):
    """offset 1.0: Gemma's norm, which multiplies by (1 + weight) (the checkpoint stores weight)
    in float32 before the cast back, unlike Llama's (cast, then weight): torch ops, not the fused
    kernel, so a bf16 Gemma rounds where transformers' does."""

    def __init__(self, dim: int, eps: float, offset: float = 0.0) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.offset = offset

    def forward(
        self,
        x: torch.Tensor,
        residual: torch.Tensor | None = None,
        fp8_for: Fp8Linear | None = None,
    ):
        """rms_norm(x); with a residual, the add is folded in and (rms_norm(residual + x), residual + x) returned.
        fp8_for: the Fp8Linear that reads the normed rows next (linear.fp8_input): with a residual,
        they may come back quantized for it (QuantizedRows) where its own quantizer would run."""
        if self.offset:
            total = x if residual is None else residual + x
            normed = total.float()
            normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + self.eps)
            normed = (normed * (self.offset + self.weight.float())).to(total.dtype)
            return normed if residual is None else (normed, total)
        if residual is None:
            return kernels.rms_norm(x, self.weight, self.eps)
        if fp8_for is not None:
            fused = kernels.add_rms_norm_fp8(
                x, residual, self.weight, self.eps, fp8_for.weight_scale
            )
            if fused is not None:
                return fused
        return kernels.add_rms_norm(x, residual, self.weight, self.eps)


class RotaryEmbedding(nn.Module):
    """cos/sin of every position up to the context length, looked up per token by the KV-store
    kernel: `cos_sin` for the global layers, `local_cos_sin` for Gemma 3's sliding ones (the
    same tensor where the model has one rope)."""

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        # Computed where the model runs: cos/sin there round as transformers' per-step ones do.
        dtype = dtype or config.torch_dtype
        num_positions = max(config.max_context_len, config.max_position_embeddings)

        def table(theta, scaling):
            return rope_cos_sin_table(
                theta,
                scaling,
                config.head_dim,
                config.max_position_embeddings,
                num_positions,
                dtype,
                device,
            )

        self.register_buffer(
            "cos_sin", table(config.rope_theta, config.rope_scaling), persistent=False
        )
        local = table(*config.local_rope) if config.local_rope is not None else self.cos_sin
        self.register_buffer("local_cos_sin", local, persistent=False)


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
        meta: AttentionMetadata,
        kv_layer: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        """cos_sin: the (global, local) rotary tables (RotaryEmbedding)."""
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
        # Fresh prompts attend to their own keys: read from the step, not gathered by page.
        fresh = kernels.fresh_prefill(meta, q, kv_layer, self.window, self.softcap)
        rotated_k = torch.empty(k.shape, dtype=k.dtype, device=k.device) if fresh else None
        q = kernels.rope_store_kv(
            q, k, v, positions, table, kv_layer, meta.slot_mapping, kv_scales, rotated_k
        )
        if fresh:
            out = kernels.fresh_prefill_attention(q, rotated_k, v, meta, self.scale)
        else:
            out = kernels.paged_attention(
                q, kv_layer, meta, self.scale, kv_scales, self.window, self.softcap
            )
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
        # Mixtral, Qwen2-MoE, Qwen3-MoE: moe.py's sparse block in place of the MLP.
        is_sparse = config.moe is not None and config.moe.is_sparse(layer_index)
        self.mlp = (SparseMoeBlock if is_sparse else MLP)(config, layer_index, tp, fp8_group_size)
        self.residual_multiplier = config.residual_multiplier

    def forward(
        self, hidden, residual, positions, cos_sin, meta, kv_layer, lora=None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns the MLP's output and the residual stream before it; the next layer's norm adds them
        (the residual adds ride in the norm kernels)."""
        if residual is None:
            normed, residual = self.input_layernorm(hidden), hidden
        else:
            normed, residual = self.input_layernorm(
                hidden, residual, fp8_input(self.self_attn.qkv_proj, lora)
            )
        attn_out = self.self_attn(normed, positions, cos_sin, meta, kv_layer, lora)
        if self.residual_multiplier != 1.0:
            attn_out = attn_out * self.residual_multiplier
        gate_up = self.mlp.gate_up_proj if isinstance(self.mlp, MLP) else None
        normed, residual = self.post_attention_layernorm(
            attn_out, residual, fp8_input(gate_up, lora)
        )
        out = self.mlp(normed, lora)
        if self.residual_multiplier != 1.0:
            out = out * self.residual_multiplier
        return out, residual


def _decoder_layer_class(norm_style: str) -> type[nn.Module]:
    if norm_style == "pre":
        return DecoderLayer
    # Imported here: family_layers builds on this module's Attention, MLP and RMSNorm.
    from tandem.engine.family_layers import FAMILY_DECODER_LAYERS

    return FAMILY_DECODER_LAYERS[norm_style]


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
        layer_class = _decoder_layer_class(config.norm_style)
        self.layers = nn.ModuleList(
            layer_class(config, index, tp, fp8_group_size) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
        self.rotary = RotaryEmbedding(config)
        # EAGLE-3 (engine/eagle3.py): the layers whose input (the residual stream, i.e. the output
        # of the layer before; len(layers): after the last) each forward keeps, concatenated in
        # aux_hidden_states [T, len(ids) * hidden_size]. Empty: nothing kept, nothing costs.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden_states: torch.Tensor | None = None
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
        if self.config.embedding_multiplier != 1.0:
            multiplier = self.config.embedding_multiplier
            if self.config.embedding_multiplier_in_dtype:  # as Gemma: sqrt(hidden) in the dtype
                multiplier = torch.tensor(multiplier, dtype=hidden.dtype)
            hidden = hidden * multiplier
        residual = None
        cos_sin = (self.rotary.cos_sin, self.rotary.local_cos_sin)
        aux_ids = self.aux_layer_ids
        aux = []
        for index, layer in enumerate(self.layers):
            if index in aux_ids:
                aux.append(hidden if residual is None else hidden + residual)
            hidden, residual = layer(
                hidden, residual, positions, cos_sin, meta, kv_cache[:, index], lora
            )
        normed, stream = self.norm(hidden, residual)
        if aux_ids:
            aux += [stream] * aux_ids.count(len(self.layers))
            self.aux_hidden_states = torch.cat(aux, dim=-1)
        return normed

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.embed_tokens.weight if self.lm_head is None else self.lm_head.weight
        if not self.tp.is_parallel:
            logits = kernels.linear(hidden, weight)
        else:
            # Each rank's rows of the padded vocabulary, side by side; the padding columns cut off.
            logits = self.tp.gather_last_dim(kernels.linear(hidden, weight))[
                :, : self.config.vocab_size
            ]
        if self.config.logits_scaling != 1.0:  # Granite
            logits = logits / self.config.logits_scaling
        if self.config.final_softcap:  # Gemma 2
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()
