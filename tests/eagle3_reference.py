"""EAGLE-3 heads for the tests: writing one in its published format, and an independent plain-torch
forward of the published modeling code (whole sequences, no KV cache), which the tests compare
tandem's head with and train a tiny head through."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

HEAD_DIM, NUM_HEADS, NUM_KV_HEADS, INTERMEDIATE = 16, 4, 2, 128
AUX_IDS = (0, 1, 2)  # the tiny target has 2 layers: embeddings, after layer 0, after layer 1


def head_config(target: dict, draft_vocab: int | None = None, **extra) -> dict:
    config = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": target["hidden_size"],
        "num_hidden_layers": 1,
        "num_attention_heads": NUM_HEADS,
        "num_key_value_heads": NUM_KV_HEADS,
        "head_dim": HEAD_DIM,
        "intermediate_size": INTERMEDIATE,
        "vocab_size": target["vocab_size"],
        "draft_vocab_size": draft_vocab or target["vocab_size"],
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        "max_position_embeddings": 2048,
        "hidden_act": "silu",
        "torch_dtype": "float32",
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(AUX_IDS)},
    }
    config.update(extra)
    return config


def random_weights(config: dict, seed: int, target_hidden: int) -> dict[str, torch.Tensor]:
    """Published names and shapes; d2t maps a draft vocabulary onto a random subset of ids."""
    gen = torch.Generator().manual_seed(seed)
    hidden, vocab = config["hidden_size"], config["vocab_size"]
    draft_vocab = config["draft_vocab_size"]
    q, kv = NUM_HEADS * HEAD_DIM, NUM_KV_HEADS * HEAD_DIM

    def randn(*shape, std=0.2):
        return torch.randn(*shape, generator=gen) * std

    weights = {
        "fc.weight": randn(hidden, 3 * target_hidden),
        "midlayer.hidden_norm.weight": 1 + randn(hidden, std=0.1),
        "midlayer.input_layernorm.weight": 1 + randn(hidden, std=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + randn(hidden, std=0.1),
        "midlayer.self_attn.q_proj.weight": randn(q, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": randn(kv, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": randn(kv, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": randn(hidden, q),
        "midlayer.mlp.gate_proj.weight": randn(INTERMEDIATE, hidden),
        "midlayer.mlp.up_proj.weight": randn(INTERMEDIATE, hidden),
        "midlayer.mlp.down_proj.weight": randn(hidden, INTERMEDIATE),
        "norm.weight": 1 + randn(hidden, std=0.1),
        "lm_head.weight": randn(draft_vocab, hidden, std=1.0),
    }
    targets = torch.randperm(vocab, generator=gen)[:draft_vocab].sort().values
    weights["d2t"] = targets - torch.arange(draft_vocab)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[targets] = True
    weights["t2d"] = t2d
    return weights


def save_head(out: Path, config: dict, weights: dict, fmt: str = "safetensors") -> Path:
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    (out / "config.json").write_text(json.dumps(config))
    weights = {name: t.detach().contiguous() for name, t in weights.items()}
    if fmt == "safetensors":
        save_file(weights, str(out / "model.safetensors"))
    else:
        torch.save(weights, out / "pytorch_model.bin")
    return out


def _rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x, positions, theta=10000.0):
    """x [B, heads, T, D] rotated by positions [T] (rotate_half)."""
    d = x.shape[-1]
    inv_freq = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float32) / d))
    angles = positions.float()[:, None] * inv_freq[None, :]
    emb = torch.cat([angles, angles], dim=-1)
    x1, x2 = x[..., : d // 2], x[..., d // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


def head_forward(w: dict, hidden, embeds, positions):
    """The published head over whole rows [B, T, H] (hidden already through fc), causal over T:
    returns (logits over the draft vocabulary, normed, the stream before the final norm)."""
    b, t, h = hidden.shape
    residual = hidden
    x = torch.cat(
        [
            _rms(embeds, w["midlayer.input_layernorm.weight"]),
            _rms(hidden, w["midlayer.hidden_norm.weight"]),
        ],
        dim=-1,
    )
    q = (x @ w["midlayer.self_attn.q_proj.weight"].T).view(b, t, NUM_HEADS, HEAD_DIM)
    k = (x @ w["midlayer.self_attn.k_proj.weight"].T).view(b, t, NUM_KV_HEADS, HEAD_DIM)
    v = (x @ w["midlayer.self_attn.v_proj.weight"].T).view(b, t, NUM_KV_HEADS, HEAD_DIM)
    q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
    q, k = _rope(q, positions), _rope(k, positions)
    k = k.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    v = v.repeat_interleave(NUM_HEADS // NUM_KV_HEADS, dim=1)
    scores = (q @ k.transpose(-1, -2)) / HEAD_DIM**0.5
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    scores = scores.masked_fill(~causal, float("-inf"))
    attn = (scores.softmax(-1) @ v).transpose(1, 2).reshape(b, t, NUM_HEADS * HEAD_DIM)
    stream = attn @ w["midlayer.self_attn.o_proj.weight"].T + residual
    m = _rms(stream, w["midlayer.post_attention_layernorm.weight"])
    gate = m @ w["midlayer.mlp.gate_proj.weight"].T
    up = m @ w["midlayer.mlp.up_proj.weight"].T
    stream = stream + (F.silu(gate) * up) @ w["midlayer.mlp.down_proj.weight"].T
    normed = _rms(stream, w["norm.weight"])
    return normed @ w["lm_head.weight"].T, normed, stream


def target_aux_states(hf_model, ids: torch.Tensor) -> torch.Tensor:
    """transformers' tiny Llama over ids [B, T]: the residual stream entering layers 0 and 1 and
    leaving layer 1 (before the final norm), side by side [B, T, 3H]."""
    kept = {}

    def keep(module, args, output):
        kept["last"] = output[0] if isinstance(output, tuple) else output

    handle = hf_model.model.layers[-1].register_forward_hook(keep)
    try:
        with torch.no_grad():
            out = hf_model(ids, output_hidden_states=True)
    finally:
        handle.remove()
    return torch.cat([out.hidden_states[0], out.hidden_states[1], kept["last"]], dim=-1)


def reference_drafts(w: dict, embed, aux, tokens: list[int], k: int):
    """The published head drafting k tokens after tokens (the target's aux states [n - 1, 3H] of
    all but the last), recomputing the whole sequence each step: (draft target ids, the first
    step's normed and stream rows)."""
    d2t = w.get("d2t")
    n = len(tokens)
    hidden = aux @ w["fc.weight"].T  # [n - 1, H]
    ids = list(tokens[1:])
    drafts, first = [], None
    for step in range(k):
        positions = torch.arange(hidden.shape[0])
        logits, normed, stream = head_forward(
            w, hidden[None], embed[torch.tensor(ids)][None], positions
        )
        best = int(logits[0, -1].argmax())
        drafts.append(best + (int(d2t[best]) if d2t is not None else 0))
        if first is None:
            first = (normed[0, -1], stream[0, -1])
        hidden = torch.cat([hidden, stream[0, -1:]])
        ids.append(drafts[-1])
    assert hidden.shape[0] == n - 1 + k
    return drafts, first
