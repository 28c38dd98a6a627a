"""transformers' own decoder over tandem's paged KV cache, for the architectures model.py does
not have (vLLM's "Transformers backend"): `--model-impl transformers`, or `auto` for a model_type
outside SUPPORTED_ARCHITECTURES.

The model is transformers' AutoModelForCausalLM, loaded with attn_implementation="tandem": every
attention layer, after its own projections, norms and rotary embedding, calls `paged_attention`
below, which stores the step's keys and values in the layer's slice of tandem's KV pool and
attends with tandem's kernels. So the KV lives where the native path keeps it, in its layout:
prefix caching, chunked prefill, preemption, the host tier and KV handoffs work unchanged.

A step is tandem's flat batch: transformers sees one sequence of T tokens (batch 1) whose
position_ids are the step's positions, and builds no mask (the "tandem" implementation has no
mask function); the AttentionMetadata, passed down as a forward kwarg, says where each sequence's
rows start and where its KV blocks are.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.engine.config import EngineConfig
from tandem.engine.model_config import ModelConfig
from tandem.engine.transformers_config import causal_lm_class, import_transformers
from tandem.kernels import dispatch as kernels
from tandem.kernels.attention_metadata import AttentionMetadata

ATTENTION_NAME = "tandem"


@dataclass(frozen=True)
class PagedStep:
    """What the attention layers of one forward need beyond their q/k/v: the forward kwarg
    `tandem_step` that transformers hands down to each attention call."""

    meta: AttentionMetadata
    kv_cache: torch.Tensor  # the whole pool [num_blocks, num_layers, 2, block_size, Hkv, D]


def paged_attention(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    tandem_step: PagedStep | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [1, Hq, T, D], key/value [1, Hkv, T, D]
    (rotated already) -> ([1, T, Hq, D], no weights). attention_mask is None (no mask function
    is registered for "tandem"): AttentionMetadata gives each sequence's causal span."""
    if tandem_step is None:
        raise RuntimeError(
            f"{type(module).__name__} called tandem's attention without a tandem_step: its forward "
            f"does not pass its kwargs down to the attention layers"
        )
    # What this function would ignore, refused rather than computed wrongly.
    for name in ("sliding_window", "softcap", "s_aux"):
        if kwargs.get(name) is not None:
            raise ValueError(
                f"{type(module).__name__} asks for {name}={kwargs[name]!r}: the transformers path "
                f"runs plain causal attention only"
            )
    if not getattr(module, "is_causal", True):
        raise ValueError(f"{type(module).__name__} is not causal attention")
    layer = getattr(module, "layer_idx", None)
    if layer is None:
        raise ValueError(
            f"{type(module).__name__} has no layer_idx: its KV has no place in the pool"
        )
    kv_layer = tandem_step.kv_cache[:, layer]
    if (
        query.shape[0] != 1
        or key.shape[1] != kv_layer.shape[3]
        or key.shape[3] != kv_layer.shape[4]
        or value.shape[3] != kv_layer.shape[4]
    ):
        raise ValueError(
            f"layer {layer}: keys {tuple(key.shape)} and values {tuple(value.shape)} do not fit "
            f"the KV pool's [heads {kv_layer.shape[3]}, head_dim {kv_layer.shape[4]}] "
            f"(config.json's sizes)"
        )
    q = query[0].transpose(0, 1).to(kv_layer.dtype).contiguous()  # [T, Hq, D]
    k = key[0].transpose(0, 1).contiguous()
    v = value[0].transpose(0, 1).contiguous()
    meta = tandem_step.meta
    kernels.store_kv(k, v, kv_layer, meta.slot_mapping)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = kernels.paged_attention(q, kv_layer, meta, scale)
    return out.to(query.dtype).unsqueeze(0), None


def _register_attention() -> None:
    transformers = import_transformers()
    transformers.AttentionInterface.register(ATTENTION_NAME, paged_attention)


class TransformersCausalLM(nn.Module):
    """CausalLM's interface to the runner (forward over a flat batch, compute_logits) around a
    transformers causal LM whose attention is `paged_attention`."""

    def __init__(self, hf_model: nn.Module, config: ModelConfig) -> None:
        super().__init__()
        self.hf_model = hf_model  # the one child: state_dict names each weight once
        self.config = config

    @property
    def decoder(self) -> nn.Module:
        """The body: embeddings, layers, final norm."""
        return self.hf_model.base_model

    @property
    def lm_head(self) -> nn.Module:
        return self.hf_model.get_output_embeddings()

    @property
    def embed_tokens(self) -> nn.Module:
        return self.hf_model.get_input_embeddings()

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        kv_cache: torch.Tensor,
        lora=None,
    ) -> torch.Tensor:
        """input_ids, positions [T] -> final hidden states [T, hidden_size]; writes the KV of all
        T tokens. lora must be None (the runner builds no adapter pool on this path)."""
        if lora is not None:
            raise ValueError("LoRA adapters are not supported on the transformers model path")
        out = self.decoder(
            input_ids=input_ids.unsqueeze(0),
            position_ids=positions.long().unsqueeze(0),
            use_cache=False,
            tandem_step=PagedStep(meta, kv_cache),
        )
        return out.last_hidden_state[0]

    @torch.inference_mode()
    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """lm_head, then what transformers' heads do after it (transformers_config.py reads them)."""
        logits = self.lm_head(hidden)
        if self.config.logits_scaling != 1.0:
            logits = logits / self.config.logits_scaling
        if self.config.final_softcap:
            cap = self.config.final_softcap
            logits = torch.tanh(logits / cap) * cap
        return logits.float()


def load_transformers_model(
    model_dir: str | Path,
    config: ModelConfig,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
) -> TransformersCausalLM:
    """transformers' model of the checkpoint (local files only), in dtype (None: the
    checkpoint's), on device, its attention through tandem's paged KV cache."""
    _register_attention()
    model_class = causal_lm_class(
        import_transformers().AutoConfig.from_pretrained(model_dir, local_files_only=True)
    )
    hf_model = model_class.from_pretrained(
        model_dir,
        dtype=dtype or config.torch_dtype,
        attn_implementation=ATTENTION_NAME,
        local_files_only=True,
    )
    # A module that says it attends both ways (BERT's LM head without is_decoder) would get
    # causal attention here: refused, as transformers marks it.
    bidirectional = [
        name
        for name, module in hf_model.named_modules()
        if getattr(module, "is_causal", True) is False
    ]
    if bidirectional:
        raise ValueError(
            f"{config.model_type}: {bidirectional[0]} is not causal attention (is_causal False); "
            f"the transformers path runs decoder-only causal LMs"
        )
    model = TransformersCausalLM(hf_model.to(device).eval(), config)
    check_logits(model)
    return model


@torch.inference_mode()
def check_logits(model: TransformersCausalLM, num_tokens: int = 4) -> None:
    """Runs a few tokens through transformers' whole causal-LM forward and through tandem's split
    of it (the body, then compute_logits), both over a scratch KV pool: a model whose forward
    does not hand its kwargs down to attention, or whose head does something to the logits that
    compute_logits does not, is refused at load, not served wrong."""
    config = model.config
    device = model.lm_head.weight.device
    ids = torch.arange(num_tokens, device=device) % config.vocab_size
    positions = torch.arange(num_tokens, device=device)
    meta = AttentionMetadata.build([num_tokens], [num_tokens], [[0]], num_tokens, device)
    pool_shape = (1, config.num_layers, 2, num_tokens, config.num_kv_heads, config.head_dim)
    pool = torch.zeros(pool_shape, dtype=model.lm_head.weight.dtype, device=device)
    ours = model.compute_logits(model(ids, positions, meta, pool))
    theirs = (
        model.hf_model(
            input_ids=ids.unsqueeze(0),
            position_ids=positions.unsqueeze(0),
            use_cache=False,
            tandem_step=PagedStep(meta, pool),
        )
        .logits[0]
        .float()
    )
    tolerance = 1e-2 * float(theirs.abs().max()) + 1e-5
    if not torch.allclose(ours, theirs, rtol=0.0, atol=tolerance):
        raise ValueError(
            f"{config.model_type}: transformers' {type(model.hf_model).__name__} changes its "
            f"logits after lm_head in a way the transformers path does not reproduce (largest "
            f"difference {float((ours - theirs).abs().max()):.3g}): not served"
        )


def check_engine_config(config: EngineConfig) -> None:
    """Refuses at start what the transformers path cannot run, naming the flag to change."""
    refused = []
    if config.tensor_parallel_size > 1:
        refused.append(
            "--tensor-parallel-size > 1 (transformers' modules are not sharded across ranks)"
        )
    if config.quantization != "auto":
        refused.append(f"--quantization {config.quantization} (tandem's FP8 projections)")
    raw_config = json.loads((Path(config.model_dir) / "config.json").read_text())
    if raw_config.get("quantization_config"):
        refused.append("a quantized checkpoint (config.json has a quantization_config)")
    if config.kv_cache_dtype != "auto":
        refused.append(f"--kv-cache-dtype {config.kv_cache_dtype} (FP8 KV scales per layer)")
    if config.deterministic:
        refused.append("--deterministic (transformers' GEMMs are not batch-invariant)")
    spec = config.speculative
    if spec is not None and spec.method == "draft_model":
        refused.append("speculative decoding with a draft model")
    if refused:
        raise ValueError(
            f"{config.model_dir} runs on the transformers model path, which does not support: "
            + "; ".join(refused)
        )
