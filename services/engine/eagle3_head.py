"""An EAGLE-3 draft head as published (yuhuili/EAGLE3-LLaMA3.1-Instruct-8B, SpecForge's heads;
vLLM's and SGLang's `LlamaForCausalLMEagle3`): its config, its weights and its forward.

The checkpoint is a directory with config.json (architectures LlamaForCausalLMEagle3, a Llama
config with num_hidden_layers 1, draft_vocab_size, optionally target_hidden_size and
eagle_aux_hidden_state_layer_ids at the top level or under eagle_config) and its weights in
*.safetensors or pytorch_model.bin:

    fc.weight                  [H, 3 * H_target]  the three target layers' states -> H
    midlayer.hidden_norm.weight, midlayer.input_layernorm.weight,
    midlayer.post_attention_layernorm.weight
    midlayer.self_attn.{q,k,v}_proj.weight  [*, 2H]  (embeds and hidden side by side)
    midlayer.self_attn.o_proj.weight, midlayer.mlp.{gate,up,down}_proj.weight
    norm.weight, lm_head.weight [draft_vocab, H]
    d2t [draft_vocab]  a draft id's target id is id + d2t[id] (absent: the same vocabulary)
    t2d [vocab]        which target ids the draft vocabulary holds (not needed to draft)
    embed_tokens.weight        optional: the target's embeddings otherwise

(`model.` prefixes and `layers.0.` for `midlayer.` are read too.) The forward, for rows at
positions p with the token that followed p and a hidden state for p: the token's embedding
normed by input_layernorm, the hidden state normed by hidden_norm, side by side (2H) into
q/k/v; the residual is the hidden state itself (before its norm; norm_before_residual: after);
attention, the add, post_attention_layernorm, the MLP, the add, the final norm, lm_head. The
stream before the final norm is the hidden state of the next draft position.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.model_config import _parse_rope
from tandem.engine.rope import rope_cos_sin_table

ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
_WEIGHT_FILES = ("*.safetensors", "pytorch_model*.bin")


def _refuse(message: str):
    raise ValueError(f"--speculative-config: {message}")


# The largest hidden / intermediate size (and head count) a head's config may give (Llama-3.1-405B's
# intermediate size is 53,248): a bigger one is a broken config, refused before any allocation.
MAX_HEAD_DIM_SIZE = 1 << 17


def read_head_config(model: str) -> dict:
    """The head's config.json, checked for what this loader reads (errors say what is wrong)."""
    if not isinstance(model, str) or not model:
        _refuse(
            "method 'eagle3' needs \"model\": the EAGLE-3 head's directory (config.json and its "
            "weights, as yuhuili/EAGLE3-LLaMA3.1-Instruct-8B publishes them)"
        )
    path = Path(model) / "config.json"
    if not path.is_file():
        _refuse(f"EAGLE-3 head {model!r} has no config.json: give the head's checkpoint directory")
    raw = json.loads(path.read_text())
    architectures = raw.get("architectures") or []
    if not any(name in ARCHITECTURES for name in architectures):
        _refuse(
            f"{model!r} is not an EAGLE-3 head: its architectures are {architectures}, an "
            f"EAGLE-3 head's are one of {list(ARCHITECTURES)}"
        )
    if raw.get("num_hidden_layers", 1) != 1:
        _refuse(f"EAGLE-3 head {model!r} has {raw['num_hidden_layers']} layers; it must have 1")
    for key in ("hidden_size", "num_attention_heads", "intermediate_size", "vocab_size"):
        if not isinstance(raw.get(key), int):
            _refuse(f"EAGLE-3 head {model!r}: config.json lacks {key}")
    # Sizes are checked before any tensor is made from them: a head is one decoder layer.
    for key in ("hidden_size", "num_attention_heads", "intermediate_size"):
        if not 0 < raw[key] <= MAX_HEAD_DIM_SIZE:
            _refuse(f"EAGLE-3 head {model!r}: {key} {raw[key]} is not in 1..{MAX_HEAD_DIM_SIZE}")
    kv_heads = raw.get("num_key_value_heads", raw["num_attention_heads"])
    if not isinstance(kv_heads, int) or kv_heads < 1 or raw["num_attention_heads"] % kv_heads:
        _refuse(
            f"EAGLE-3 head {model!r}: num_attention_heads {raw['num_attention_heads']} is not a "
            f"multiple of num_key_value_heads {kv_heads}"
        )
    return raw


def aux_layer_ids(raw: dict, num_target_layers: int) -> tuple[int, ...]:
    """Which target layers' inputs feed fc (vLLM's indexing: i is the residual stream entering
    layer i, the output of layer i - 1; num_target_layers is the stream after the last layer).
    The head's eagle_aux_hidden_state_layer_ids, else vLLM's default (2, L // 2, L - 3)."""
    ids = raw.get("eagle_aux_hidden_state_layer_ids") or (raw.get("eagle_config") or {}).get(
        "eagle_aux_hidden_state_layer_ids"
    )
    given = ids is not None
    if not given:
        ids = (2, num_target_layers // 2, num_target_layers - 3)
    ids = tuple(sorted({int(i) for i in ids}))
    if len(ids) != 3 or not all(0 <= i <= num_target_layers for i in ids):
        source = "its eagle_aux_hidden_state_layer_ids" if given else "the default (2, L//2, L-3)"
        _refuse(
            f"the EAGLE-3 head reads the states of target layers {ids} ({source}); a target of "
            f"{num_target_layers} layers needs three distinct ids in [0, {num_target_layers}]: "
            "set eagle_aux_hidden_state_layer_ids in the head's config.json"
        )
    return ids


def _read_weights(model_dir: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    tensors: dict[str, torch.Tensor] = {}
    for pattern in _WEIGHT_FILES:
        for file in sorted(model_dir.glob(pattern)):
            if file.suffix == ".safetensors":
                tensors.update(load_file(str(file)))
            else:  # tensors only: a pickle that holds anything else is refused, not run
                tensors.update(torch.load(file, map_location="cpu", weights_only=True))
        if tensors:
            break
    if not tensors:
        _refuse(f"EAGLE-3 head {str(model_dir)!r} has no *.safetensors or pytorch_model.bin")
    renamed = {}
    for name, tensor in tensors.items():
        name = name.removeprefix("model.").replace("layers.0.", "midlayer.")
        renamed[name] = tensor
    return renamed


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Llama's RMSNorm: in float32, cast back, then the weight."""
    normed = x.float()
    normed = normed * torch.rsqrt(normed.pow(2).mean(-1, keepdim=True) + eps)
    return weight * normed.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """rotate_half rotation of x [..., heads, D] by per-row cos/sin [..., D/2]."""
    cos = torch.cat((cos, cos), dim=-1).unsqueeze(-2)
    sin = torch.cat((sin, sin), dim=-1).unsqueeze(-2)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Eagle3Head(nn.Module):
    """The head's one layer, over one sequence's rows and the K/V of its earlier positions."""

    def __init__(self, raw: dict, target_hidden_size: int, max_positions: int, dtype, device):
        super().__init__()
        self.hidden_size = hidden = raw["hidden_size"]
        self.num_heads = raw["num_attention_heads"]
        self.num_kv_heads = raw.get("num_key_value_heads") or self.num_heads
        self.head_dim = raw.get("head_dim") or hidden // self.num_heads
        self.eps = raw.get("rms_norm_eps", 1e-6)
        self.vocab_size = raw["vocab_size"]
        self.draft_vocab_size = raw.get("draft_vocab_size") or self.vocab_size
        eagle_config = raw.get("eagle_config") or {}
        self.norm_before_residual = bool(
            raw.get("norm_before_residual", eagle_config.get("norm_before_residual", False))
        )
        self.target_hidden_size = raw.get("target_hidden_size") or target_hidden_size
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        bias = bool(raw.get("attention_bias", False))
        with torch.device(device):
            self.fc = nn.Linear(3 * self.target_hidden_size, hidden, bias=False)
            self.q_proj = nn.Linear(2 * hidden, q_size, bias=bias)
            self.k_proj = nn.Linear(2 * hidden, kv_size, bias=bias)
            self.v_proj = nn.Linear(2 * hidden, kv_size, bias=bias)
            self.o_proj = nn.Linear(q_size, hidden, bias=False)
            self.gate_proj = nn.Linear(hidden, raw["intermediate_size"], bias=False)
            self.up_proj = nn.Linear(hidden, raw["intermediate_size"], bias=False)
            self.down_proj = nn.Linear(raw["intermediate_size"], hidden, bias=False)
            self.hidden_norm = nn.Parameter(torch.ones(hidden))
            self.input_layernorm = nn.Parameter(torch.ones(hidden))
            self.post_attention_layernorm = nn.Parameter(torch.ones(hidden))
            self.norm = nn.Parameter(torch.ones(hidden))
            self.lm_head = nn.Linear(hidden, self.draft_vocab_size, bias=False)
        # Draft id -> target id (None: the same vocabulary); the embeddings (None: the target's).
        self.register_buffer("draft_to_target", None)
        self.embed_tokens: torch.Tensor | None = None
        self.to(dtype)
        # The target's parser: rope_theta + rope_scaling or rope_parameters, "type" or "rope_type".
        theta, scaling = _parse_rope(raw, self.head_dim)
        cos_sin = rope_cos_sin_table(
            theta,
            scaling,
            self.head_dim,
            raw.get("max_position_embeddings", max_positions),
            max(max_positions, raw.get("max_position_embeddings", 0)),
            dtype,
            device,
        )
        self.register_buffer("cos_sin", cos_sin, persistent=False)

    def load(self, tensors: dict[str, torch.Tensor], model: str) -> None:
        """Copies the checkpoint's tensors in, refusing any whose shape differs."""
        params = {
            "fc.weight": self.fc.weight,
            "norm.weight": self.norm,
            "lm_head.weight": self.lm_head.weight,
            "midlayer.hidden_norm.weight": self.hidden_norm,
            "midlayer.input_layernorm.weight": self.input_layernorm,
            "midlayer.post_attention_layernorm.weight": self.post_attention_layernorm,
        }
        for proj in ("q_proj", "k_proj", "v_proj", "o_proj"):
            linear = getattr(self, proj)
            params[f"midlayer.self_attn.{proj}.weight"] = linear.weight
            if linear.bias is not None:
                params[f"midlayer.self_attn.{proj}.bias"] = linear.bias
        for proj in ("gate_proj", "up_proj", "down_proj"):
            params[f"midlayer.mlp.{proj}.weight"] = getattr(self, proj).weight
        missing = sorted(set(params) - set(tensors))
        if missing:
            _refuse(f"EAGLE-3 head {model!r} lacks the tensors {missing}")
        with torch.no_grad():
            for name, param in params.items():
                tensor = tensors[name]
                if tuple(tensor.shape) != tuple(param.shape):
                    what = (
                        "hidden-size mismatch: fc takes 3 x the target's hidden size"
                        if name == "fc.weight"
                        else "shape mismatch"
                    )
                    _refuse(
                        f"EAGLE-3 head {model!r}: {name} is {list(tensor.shape)}, this target "
                        f"and the head's config.json need {list(param.shape)} ({what})"
                    )
                param.copy_(tensor)
        device = self.fc.weight.device
        d2t = tensors.get("d2t")
        if d2t is not None:
            if tuple(d2t.shape) != (self.draft_vocab_size,):
                _refuse(f"EAGLE-3 head {model!r}: d2t has shape {list(d2t.shape)}")
            ids = torch.arange(self.draft_vocab_size) + d2t.long()
            if int(ids.min()) < 0 or int(ids.max()) >= self.vocab_size:
                _refuse(f"EAGLE-3 head {model!r}: d2t maps draft ids outside the vocabulary")
            self.draft_to_target = ids.to(device)
        elif self.draft_vocab_size != self.vocab_size:
            _refuse(
                f"EAGLE-3 head {model!r} has a draft vocabulary of {self.draft_vocab_size} ids and "
                "no d2t to map them to the target's"
            )
        embed = tensors.get("embed_tokens.weight")
        if embed is not None:
            if tuple(embed.shape) != (self.vocab_size, self.hidden_size):
                _refuse(f"EAGLE-3 head {model!r}: embed_tokens is {list(embed.shape)}")
            self.embed_tokens = embed.to(device=device, dtype=self.fc.weight.dtype)

    def combine(self, aux: torch.Tensor) -> torch.Tensor:
        """The target's aux states [T, 3 * H_target] -> the head's hidden states [T, H]."""
        return self.fc(aux)

    def forward(
        self,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        past_k: torch.Tensor,
        past_v: torch.Tensor,
        past_valid: torch.Tensor,
    ):
        """Rows [B, T] of B sequences (embeds, hidden [B, T, H]; positions [B, T]) after their
        past keys (past_k/past_v [B, P, kv heads, D], past_valid [B, P]: which a sequence has);
        each row sees its sequence's valid past and the rows up to itself. Returns (normed
        [B, T, H] for the logits, the stream before the final norm [B, T, H]: the next position's
        hidden state, the rows' K and V [B, T, kv heads, D])."""
        if self.norm_before_residual:
            hidden = _rms_norm(hidden, self.hidden_norm, self.eps)
            residual = hidden
        else:
            residual = hidden
            hidden = _rms_norm(hidden, self.hidden_norm, self.eps)
        x = torch.cat([_rms_norm(embeds, self.input_layernorm, self.eps), hidden], dim=-1)
        batch, num = x.shape[:2]
        q = self.q_proj(x).view(batch, num, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(batch, num, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(batch, num, self.num_kv_heads, self.head_dim)
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        keys, values = torch.cat([past_k, k], dim=1), torch.cat([past_v, v], dim=1)
        causal = torch.ones(num, num, dtype=torch.bool, device=x.device).tril()
        mask = torch.cat(
            [
                past_valid[:, None, :].expand(batch, num, past_k.shape[1]),
                causal[None].expand(batch, num, num),
            ],
            dim=-1,
        )
        group = self.num_heads // self.num_kv_heads
        out = F.scaled_dot_product_attention(
            q.transpose(1, 2),
            keys.repeat_interleave(group, dim=2).transpose(1, 2),
            values.repeat_interleave(group, dim=2).transpose(1, 2),
            attn_mask=mask[:, None],
        )
        out = self.o_proj(out.transpose(1, 2).reshape(batch, num, -1))
        stream = out + residual
        mlp_in = _rms_norm(stream, self.post_attention_layernorm, self.eps)
        stream = stream + self.down_proj(F.silu(self.gate_proj(mlp_in)) * self.up_proj(mlp_in))
        return _rms_norm(stream, self.norm, self.eps), stream, k, v

    def draft_ids(self, normed: torch.Tensor) -> torch.Tensor:
        """The greedy draft of each row, as target ids."""
        best = self.lm_head(normed).argmax(dim=-1)
        return best if self.draft_to_target is None else self.draft_to_target[best]


def load_head(model: str, raw: dict, target_hidden_size: int, max_positions: int, dtype, device):
    """The head of `model` (read_head_config's raw config) in dtype on device."""
    head = Eagle3Head(raw, target_hidden_size, max_positions, dtype, device)
    head.load(_read_weights(Path(model)), model)
    head.eval()
    return head
