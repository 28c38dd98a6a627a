"""BERT encoder (HF `BertModel`): config, model and safetensors loading. Pure torch, CPU or CUDA.

Parameter names are the HF checkpoint's own, so loading is a name-for-name copy and
a mismatch is reported in the checkpoint's vocabulary.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from tandem.engine.loader import _checkpoint_files, _read_tensors

# Architectures whose checkpoint is the bare encoder stack that this module implements.
ENCODER_ARCHITECTURES = ("BertModel",)
_ACTIVATIONS = {
    "gelu": lambda x: F.gelu(x),
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "relu": F.relu,
}
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# In the checkpoint but not used by encode: BertModel's tanh pooler feeds the NSP head,
# while sentence embeddings come from the pooling config (pooling.py). Old checkpoints
# also store the position-id buffer, which is recomputed here.
_UNUSED_TENSORS = ("pooler.dense.weight", "pooler.dense.bias", "embeddings.position_ids")


def is_encoder_only(model_dir: str | Path) -> bool:
    """Whether config.json describes an encoder-only model that the encode path serves."""
    path = Path(model_dir) / "config.json"
    raw = json.loads(path.read_text()) if path.is_file() else {}
    return any(arch in ENCODER_ARCHITECTURES for arch in raw.get("architectures") or [])


@dataclass(frozen=True)
class BertConfig:
    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    intermediate_size: int
    hidden_act: str
    max_position_embeddings: int
    type_vocab_size: int
    layer_norm_eps: float
    pad_token_id: int
    dtype: str

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(
                f"hidden_size ({self.hidden_size}) must be a multiple of num_attention_heads ({self.num_heads})"
            )
        if self.hidden_act not in _ACTIVATIONS:
            raise ValueError(
                f"unsupported hidden_act {self.hidden_act!r}; supported: {sorted(_ACTIVATIONS)}"
            )
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; supported: {sorted(_DTYPES)}")

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads

    @property
    def torch_dtype(self) -> torch.dtype:
        return _DTYPES[self.dtype]

    @classmethod
    def from_dict(cls, raw: dict) -> BertConfig:
        architectures = raw.get("architectures") or []
        if raw.get("model_type") != "bert" or not any(
            a in ENCODER_ARCHITECTURES for a in architectures
        ):
            raise ValueError(
                f"not a BERT encoder: model_type {raw.get('model_type')!r}, architectures {architectures}; "
                f"supported: model_type 'bert' with {ENCODER_ARCHITECTURES}"
            )
        if raw.get("position_embedding_type", "absolute") != "absolute":
            raise ValueError(
                f"unsupported position_embedding_type {raw['position_embedding_type']!r}; only 'absolute'"
            )
        try:
            return cls(
                vocab_size=int(raw["vocab_size"]),
                hidden_size=int(raw["hidden_size"]),
                num_layers=int(raw["num_hidden_layers"]),
                num_heads=int(raw["num_attention_heads"]),
                intermediate_size=int(raw["intermediate_size"]),
                hidden_act=raw.get("hidden_act", "gelu"),
                max_position_embeddings=int(raw["max_position_embeddings"]),
                type_vocab_size=int(raw.get("type_vocab_size", 2)),
                layer_norm_eps=float(raw.get("layer_norm_eps", 1e-12)),
                pad_token_id=int(raw.get("pad_token_id") or 0),
                dtype=str(raw.get("dtype") or raw.get("torch_dtype") or "float32").removeprefix(
                    "torch."
                ),
            )
        except KeyError as exc:
            raise ValueError(f"config.json is missing required field {exc.args[0]!r}") from None

    @classmethod
    def from_pretrained(cls, model_dir: str | Path) -> BertConfig:
        path = Path(model_dir) / "config.json"
        if not path.is_file():
            raise ValueError(f"no config.json in {model_dir}")
        return cls.from_dict(json.loads(path.read_text()))


class _DenseNorm(nn.Module):
    """dense -> dropout (none at inference) -> LayerNorm(x + residual): BERT's post-LN sublayer output."""

    def __init__(self, in_features: int, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(in_features, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class _SelfAttention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.num_heads, self.head_dim = config.num_heads, config.head_dim
        self.query = nn.Linear(config.hidden_size, config.hidden_size)
        self.key = nn.Linear(config.hidden_size, config.hidden_size)
        self.value = nn.Linear(config.hidden_size, config.hidden_size)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        batch, seq_len, hidden = x.shape

        def heads(t: torch.Tensor) -> torch.Tensor:
            return t.view(batch, seq_len, self.num_heads, self.head_dim).transpose(1, 2)

        # attend: [batch, 1, 1, seq_len] bool, True where the key is a real token. Every row
        # has at least one real token, so no softmax row is all -inf.
        out = F.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            attn_mask=attend,
            scale=1.0 / math.sqrt(self.head_dim),
        )
        return out.transpose(1, 2).reshape(batch, seq_len, hidden)


class _Attention(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.self = _SelfAttention(config)
        self.output = _DenseNorm(config.hidden_size, config)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        return self.output(self.self(x, attend), x)


class _Intermediate(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.dense = nn.Linear(config.hidden_size, config.intermediate_size)
        self.act = _ACTIVATIONS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class _Layer(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.attention = _Attention(config)
        self.intermediate = _Intermediate(config)
        self.output = _DenseNorm(config.intermediate_size, config)

    def forward(self, x: torch.Tensor, attend: torch.Tensor) -> torch.Tensor:
        x = self.attention(x, attend)
        return self.output(self.intermediate(x), x)


class _Encoder(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.layer = nn.ModuleList(_Layer(config) for _ in range(config.num_layers))


class _Embeddings(nn.Module):
    def __init__(self, config: BertConfig):
        super().__init__()
        self.word_embeddings = nn.Embedding(config.vocab_size, config.hidden_size)
        self.position_embeddings = nn.Embedding(config.max_position_embeddings, config.hidden_size)
        self.token_type_embeddings = nn.Embedding(config.type_vocab_size, config.hidden_size)
        self.LayerNorm = nn.LayerNorm(config.hidden_size, eps=config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, token_type_ids: torch.Tensor) -> torch.Tensor:
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = (
            self.word_embeddings(input_ids)
            + self.token_type_embeddings(token_type_ids)
            + self.position_embeddings(positions)
        )
        return self.LayerNorm(x)


class BertEncoder(nn.Module):
    """input ids [batch, seq_len] (right-padded) -> last hidden states [batch, seq_len, hidden]."""

    def __init__(self, config: BertConfig):
        super().__init__()
        self.config = config
        self.embeddings = _Embeddings(config)
        self.encoder = _Encoder(config)

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if token_type_ids is None:
            token_type_ids = torch.zeros_like(input_ids)
        x = self.embeddings(input_ids, token_type_ids)
        attend = attention_mask.bool()[:, None, None, :]
        for layer in self.encoder.layer:
            x = layer(x, attend)
        return x


def load_bert(
    model_dir: str | Path, dtype: torch.dtype | None = None, device: str | torch.device = "cpu"
) -> tuple[BertEncoder, BertConfig]:
    """Builds the encoder from config.json and *.safetensors; ValueError names missing / unexpected tensors."""
    model_dir = Path(model_dir)
    config = BertConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        model = BertEncoder(config)
    shapes = {name: p.shape for name, p in model.named_parameters()}
    tensors = _read_tensors(_checkpoint_files(model_dir))
    # Some exports (e.g. from BertForMaskedLM's base model) prefix every name with "bert.".
    if shapes.keys().isdisjoint(tensors) and all(k.startswith("bert.") for k in tensors):
        tensors = {k.removeprefix("bert."): v for k, v in tensors.items()}
    missing = sorted(shapes.keys() - tensors.keys())
    unexpected = sorted(tensors.keys() - shapes.keys() - set(_UNUSED_TENSORS))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint {model_dir} does not match BertModel: "
            f"missing tensors {missing}, unexpected tensors {unexpected}"
        )
    dtype = dtype or config.torch_dtype
    state = {}
    for name, shape in shapes.items():
        tensor = tensors[name]
        if tensor.shape != shape:
            raise ValueError(
                f"tensor {name} has shape {tuple(tensor.shape)} in {model_dir}, "
                f"config.json implies {tuple(shape)}"
            )
        state[name] = tensor.to(device=device, dtype=dtype)
    model.load_state_dict(state, strict=True, assign=True)
    return model.eval(), config
