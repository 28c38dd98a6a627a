"""The decoder-only model over the paged KV cache: Llama 2/3, Mistral, Qwen2, Qwen3, Gemma 2,
Gemma 3 (text), Phi-3, OLMo 2, Granite. One graph; ModelConfig says where a family departs from
Llama and layers.py holds the blocks.

Under tensor parallelism (parallel.py) each rank builds the layers of its share: its heads, its
slice of the intermediate size and of the vocabulary; o_proj, down_proj and the embedding end in
an all-reduce, the logits in an all-gather.
With fp8_group_size set, the q/k/v, o, gate/up and down projections hold FP8 weights (linear.py);
the embedding, the norms and the LM head stay in the model dtype.
"""

from __future__ import annotations

import torch
from torch import nn

from tandem.engine.layers import DECODER_LAYERS, RMSNorm
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import TensorParallel, vocab_parallel_embedding, vocab_range
from tandem.engine.rope import rope_cos_sin_table
from tandem.kernels import dispatch as kernels
from tandem.kernels.attention_metadata import AttentionMetadata


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
        layer_class = DECODER_LAYERS[config.norm_style]
        self.layers = nn.ModuleList(
            layer_class(config, index, tp, fp8_group_size) for index in range(config.num_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, config.norm_offset)
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
        if self.config.embedding_multiplier != 1.0:
            multiplier = self.config.embedding_multiplier
            if self.config.embedding_multiplier_in_dtype:  # as Gemma: sqrt(hidden) in the dtype
                multiplier = torch.tensor(multiplier, dtype=hidden.dtype)
            hidden = hidden * multiplier
        residual = None
        cos_sin = (self.rotary.cos_sin, self.rotary.local_cos_sin)
        for index, layer in enumerate(self.layers):
            hidden, residual = layer(
                hidden, residual, positions, cos_sin, meta, kv_cache[:, index], lora
            )
        return self.norm(hidden, residual)[0]

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
