"""Which weight format a checkpoint is in, and its FP8 tensors in the engine's layout.

Read from config.json (and ModelOpt's hf_quant_config.json) before any tensor is read, so an
unsupported quantization is refused in one line. Accepted, as published:

- transformers' fine-grained FP8 (`quant_method: fp8`, DeepSeek-V3 / Qwen3-FP8): `*.weight`
  float8_e4m3fn, `*.weight_scale_inv` float32 per `weight_block_size` block (128x128);
- compressed-tensors `float-quantized` (8-bit float weights, strategy tensor, channel or block):
  `*.weight_scale` (and `*.input_scale` for static activations);
- ModelOpt FP8: per-tensor `*.weight_scale` and `*.input_scale`;
- a bf16/fp16/fp32 checkpoint, served as is, or with `--quantization fp8` quantized at load
  (one scale per output channel).

Every FP8 projection becomes weight [N, K] float8_e4m3fn + weight_scale [N, G] float32
(kernels/fp8.py). Static input scales are read and dropped: activations are always quantized
per token when the GEMM runs (at least as accurate as a calibrated per-tensor scale). KV cache
scales (`self_attn.k_scale` / `v_scale`, or under `k_proj` / `v_proj`) are returned per layer.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

import torch

from tandem.kernels.fp8 import FP8, quantize_rows

QUANTIZATION_CHOICES = ("auto", "fp8")
_SUPPORTED = (
    "tandem serves FP8 checkpoints (quant_method fp8 as transformers writes it, compressed-tensors "
    "float-quantized FP8, modelopt FP8) and bf16/fp16/fp32 ones (--quantization fp8 quantizes "
    "those at load)"
)
# The decoder projections that FP8 covers: the embedding, the norms and lm_head never are.
_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.(qkv|[qkvo])_proj|mlp\.(gate_up|gate|up|down)_proj)\.weight$"
)
_KV_SCALE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:[kv]_proj\.|attn\.)?([kv])_scale$")


@dataclass(frozen=True)
class WeightFormat:
    """method: "none" (model-dtype weights), "fp8-at-load", "fp8" (fine-grained),
    "compressed-tensors" or "modelopt". block: a block-scaled checkpoint's (rows, columns) per
    scale; None for per-tensor or per-channel scales."""

    method: str = "none"
    block: tuple[int, int] | None = None

    @property
    def is_fp8(self) -> bool:
        return self.method != "none"

    @property
    def fp8_group_size(self) -> int | None:
        """The model's FP8 scale group width (linear.build_linear): None, 0 per row, or columns."""
        if not self.is_fp8:
            return None
        return self.block[1] if self.block else 0


def _refuse(model_dir: Path, what: str) -> ValueError:
    return ValueError(
        f"checkpoint {model_dir} is quantized with {what}: not supported; {_SUPPORTED}"
    )


def _block(value, model_dir: Path, field: str) -> tuple[int, int] | None:
    if value is None:
        return None
    if not (isinstance(value, list) and len(value) == 2 and all(isinstance(v, int) for v in value)):
        raise ValueError(f"checkpoint {model_dir}: {field} must be [rows, columns], got {value!r}")
    if min(value) <= 0:
        raise ValueError(f"checkpoint {model_dir}: {field} must be positive, got {value!r}")
    return tuple(value)


def _compressed_tensors(config: dict, model_dir: Path) -> WeightFormat:
    fmt = config.get("format")
    if fmt != "float-quantized":
        raise _refuse(model_dir, f"quant_method 'compressed-tensors' format {fmt!r}")
    blocks = set()
    for name, group in (config.get("config_groups") or {}).items():
        weights = group.get("weights") or {}
        if weights.get("type") != "float" or weights.get("num_bits") != 8:
            raise _refuse(
                model_dir,
                f"compressed-tensors group {name!r} weights {weights.get('type')!r} "
                f"{weights.get('num_bits')}-bit",
            )
        strategy = weights.get("strategy")
        if strategy not in ("tensor", "channel", "block"):
            raise _refuse(model_dir, f"compressed-tensors weight strategy {strategy!r}")
        block = _block(weights.get("block_structure"), model_dir, "block_structure")
        blocks.add(block if strategy == "block" else None)
    if not blocks:
        raise ValueError(f"checkpoint {model_dir}: compressed-tensors config has no config_groups")
    if len(blocks) > 1:
        raise _refuse(model_dir, "compressed-tensors groups of different scale strategies")
    return WeightFormat("compressed-tensors", blocks.pop())


def _modelopt(quant_algo, model_dir: Path) -> WeightFormat:
    if quant_algo != "FP8":
        raise _refuse(model_dir, f"quant_method 'modelopt' quant_algo {quant_algo!r}")
    return WeightFormat("modelopt")


def weight_format(model_dir: str | Path, quantization: str = "auto") -> WeightFormat:
    """The checkpoint's weight format, from its config files only (no tensor is read).
    quantization "fp8" quantizes a model-dtype checkpoint at load; an FP8 one stays as it is."""
    if quantization not in QUANTIZATION_CHOICES:
        raise ValueError(
            f"quantization must be one of {QUANTIZATION_CHOICES}, got {quantization!r}"
        )
    model_dir = Path(model_dir)
    raw = json.loads((model_dir / "config.json").read_text())
    config = raw.get("quantization_config") or raw.get("compression_config")
    modelopt_file = model_dir / "hf_quant_config.json"
    if config is None and modelopt_file.is_file():
        quant = json.loads(modelopt_file.read_text()).get("quantization") or {}
        return _modelopt(quant.get("quant_algo"), model_dir)
    if config is None:
        return WeightFormat("fp8-at-load" if quantization == "fp8" else "none")
    if not isinstance(config, dict):
        raise ValueError(f"checkpoint {model_dir}: quantization_config must be an object")
    method = config.get("quant_method")
    if method is None and (config.get("load_in_4bit") or config.get("load_in_8bit")):
        method = "bitsandbytes"  # transformers' older BitsAndBytesConfig omits the method
    if method == "fp8":
        block = _block(config.get("weight_block_size"), model_dir, "weight_block_size")
        return WeightFormat("fp8", block)
    if method == "compressed-tensors":
        return _compressed_tensors(config, model_dir)
    if method == "modelopt":
        return _modelopt(config.get("quant_algo"), model_dir)
    raise _refuse(model_dir, f"quant_method {method!r}")


def _row_scales(
    name: str, weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] | None
) -> torch.Tensor:
    """A checkpoint's scale of weight [N, K] as the engine's [N, G]: a per-tensor scale repeated
    per row, per-channel kept, block scales [ceil(N / rows), K / columns] repeated per row."""
    rows, cols = weight.shape
    scale = scale.float()
    if block is None or scale.numel() == 1:
        if scale.numel() == 1:
            return scale.reshape(1, 1).expand(rows, 1).contiguous()
        if scale.numel() == rows:
            return scale.reshape(rows, 1)
        raise ValueError(
            f"{name}: scale of shape {tuple(scale.shape)} fits neither a tensor nor {rows} rows"
        )
    block_rows, block_cols = block
    expected = (-(-rows // block_rows), -(-cols // block_cols))
    if tuple(scale.shape) != expected:
        raise ValueError(
            f"{name}: scale of shape {tuple(scale.shape)}; {block_rows}x{block_cols} blocks of a "
            f"{rows}x{cols} weight need {expected}"
        )
    if cols % block_cols and expected[1] > 1:
        raise ValueError(
            f"{name}: {cols} columns are not a whole number of {block_cols}-column blocks"
        )
    return scale.repeat_interleave(block_rows, dim=0)[:rows].contiguous()


def _scale_name(weight_name: str, method: str) -> str:
    base = weight_name.removesuffix(".weight")
    return base + (".weight_scale_inv" if method == "fp8" else ".weight_scale")


def to_engine_tensors(
    tensors: dict[str, torch.Tensor], fmt: WeightFormat
) -> tuple[dict[str, torch.Tensor], dict[int, tuple[float, float]]]:
    """The checkpoint's tensors with every projection as `.weight` (FP8) + `.weight_scale`
    [N, G] when fmt is FP8, its activation scales dropped; and the KV scales per layer."""
    kv_scales: dict[int, dict[str, float]] = {}
    for name in [n for n in tensors if _KV_SCALE.match(n)]:
        layer, which = _KV_SCALE.match(name).groups()
        scale = tensors.pop(name)
        if scale.numel() != 1:
            raise ValueError(
                f"{name} has {scale.numel()} values: tandem's FP8 KV cache takes one k and one v "
                "scale per layer (per-head KV scales are not supported)"
            )
        kv_scales.setdefault(int(layer), {})[which] = float(scale.float().reshape(-1)[0])
    for name in [n for n in tensors if n.endswith((".input_scale", ".activation_scale"))]:
        tensors.pop(name)
    projections = [n for n in tensors if _PROJECTION.match(n)]
    if not fmt.is_fp8:
        stored_fp8 = [n for n in projections if tensors[n].dtype == FP8]
        if stored_fp8:
            raise ValueError(
                f"{stored_fp8[0]} is float8_e4m3fn but config.json has no quantization_config "
                f"naming its scales; {_SUPPORTED}"
            )
        return tensors, _complete(kv_scales)
    unscaled = [n for n, t in tensors.items() if t.dtype == FP8 and not _PROJECTION.match(n)]
    if unscaled:
        raise ValueError(
            f"{unscaled[0]} is float8_e4m3fn: the embedding, norms and lm_head are served in the "
            f"model dtype only (FP8 covers the decoder's projections)"
        )
    group = fmt.fp8_group_size
    for name in projections:
        weight = tensors[name]
        scale_name = _scale_name(name, fmt.method)
        if weight.dtype == FP8:
            if scale_name not in tensors:
                raise ValueError(f"{name} is float8_e4m3fn and {scale_name} is missing")
            scale = _row_scales(scale_name, weight, tensors.pop(scale_name), fmt.block)
        else:  # --quantization fp8, or a projection the checkpoint left unquantized
            num_groups = weight.shape[1] // group if group else 1
            weight, scale = quantize_rows(weight, num_groups)
        tensors[name] = weight
        tensors[name.removesuffix(".weight") + ".weight_scale"] = scale
    return tensors, _complete(kv_scales)


def _complete(kv_scales: dict[int, dict[str, float]]) -> dict[int, tuple[float, float]]:
    return {layer: (s.get("k", 1.0), s.get("v", 1.0)) for layer, s in kv_scales.items()}
