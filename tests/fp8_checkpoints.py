"""FP8 checkpoints written as they are published, from a model-dtype checkpoint: the tests'
inputs for tandem's FP8 loader. The quantizers here are the tests' own (not tandem's), written
to the formats' conventions:

- transformers' fine-grained FP8 (integrations/finegrained_fp8.py, Fp8Quantize): per block
  `weight_scale_inv = amax / 448`, `weight = clamp(w / weight_scale_inv)` in float8_e4m3fn;
- compressed-tensors float-quantized (what llm-compressor's FP8_DYNAMIC writes): `weight_scale`
  [N, 1] (channel) or [1] (tensor), dynamic per-token activations;
- ModelOpt FP8: scalar `weight_scale` and `input_scale`, `k_proj.k_scale` / `v_proj.v_scale`,
  hf_quant_config.json beside config.json.

Only the decoder's projections are quantized; the embedding, norms and lm_head stay as they are.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0
_PROJECTION = re.compile(
    r"^model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)\.weight$"
)


def _copy_checkpoint(src: Path, out: Path) -> tuple[dict, dict[str, torch.Tensor]]:
    shutil.copytree(src, out)
    (out / "model.safetensors").unlink()
    return json.loads((src / "config.json").read_text()), load_file(src / "model.safetensors")


def _save(out: Path, config: dict, tensors: dict[str, torch.Tensor]) -> Path:
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / "model.safetensors"))
    return out


def _to_fp8(x: torch.Tensor) -> torch.Tensor:
    return x.clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_block(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    rows, cols = weight.shape
    bm, bn = block
    tiles = weight.float().reshape(rows // bm, bm, cols // bn, bn)
    amax = tiles.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    quantized = _to_fp8(tiles / scale_inv[:, None, :, None]).reshape(rows, cols)
    return quantized, scale_inv.float()


def dequantize_block(weight: torch.Tensor, scale_inv: torch.Tensor) -> torch.Tensor:
    rows, cols = weight.shape
    sr, sc = scale_inv.shape
    tiles = weight.float().reshape(sr, rows // sr, sc, cols // sc)
    return (tiles * scale_inv[:, None, :, None]).reshape(rows, cols)


def write_fine_grained(src: Path, out: Path, block: tuple[int, int]) -> Path:
    config, tensors = _copy_checkpoint(src, out)
    config["quantization_config"] = {
        "quant_method": "fp8",
        "activation_scheme": "dynamic",
        "weight_block_size": list(block),
    }
    for name in [n for n in tensors if _PROJECTION.match(n)]:
        tensors[name], tensors[name + "_scale_inv"] = quantize_block(tensors[name], block)
    return _save(out, config, tensors)


def write_compressed_tensors(src: Path, out: Path, strategy: str) -> Path:
    """strategy: "channel" or "tensor"."""
    config, tensors = _copy_checkpoint(src, out)
    config["quantization_config"] = {
        "quant_method": "compressed-tensors",
        "format": "float-quantized",
        "quantization_status": "compressed",
        "config_groups": {
            "group_0": {
                "targets": ["Linear"],
                "weights": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": strategy,
                    "symmetric": True,
                    "dynamic": False,
                    "group_size": None,
                    "block_structure": None,
                    "observer": "minmax",
                },
                "input_activations": {
                    "num_bits": 8,
                    "type": "float",
                    "strategy": "token",
                    "symmetric": True,
                    "dynamic": True,
                    "observer": None,
                },
                "output_activations": None,
            }
        },
        "ignore": ["lm_head"],
        "kv_cache_scheme": None,
    }
    for name in [n for n in tensors if _PROJECTION.match(n)]:
        weight = tensors[name].float()
        if strategy == "channel":
            scale = weight.abs().amax(dim=1, keepdim=True) / FP8_MAX
        else:
            scale = weight.abs().amax().reshape(1) / FP8_MAX
        tensors[name] = _to_fp8(weight / scale)
        tensors[name.removesuffix("weight") + "weight_scale"] = scale
    return _save(out, config, tensors)


def write_modelopt(src: Path, out: Path, kv_scales: tuple[float, float] | None = None) -> Path:
    """Per-tensor FP8 with calibrated-looking input scales; kv_scales: every layer's (k, v) scales."""
    config, tensors = _copy_checkpoint(src, out)
    quant = {
        "quant_algo": "FP8",
        "kv_cache_quant_algo": "FP8" if kv_scales else None,
        "exclude_modules": ["lm_head"],
    }
    config["quantization_config"] = {"quant_method": "modelopt", **quant}
    (out / "hf_quant_config.json").write_text(
        json.dumps({"producer": {"name": "modelopt", "version": "0.19.0"}, "quantization": quant})
    )
    for name in [n for n in tensors if _PROJECTION.match(n)]:
        weight = tensors[name].float()
        scale = weight.abs().amax() / FP8_MAX
        base = name.removesuffix("weight")
        tensors[name] = _to_fp8(weight / scale)
        tensors[base + "weight_scale"] = scale.reshape(())
        tensors[base + "input_scale"] = torch.tensor(4.0 / FP8_MAX)
        if kv_scales and base.endswith("k_proj."):
            tensors[base + "k_scale"] = torch.tensor(kv_scales[0])
        if kv_scales and base.endswith("v_proj."):
            tensors[base + "v_scale"] = torch.tensor(kv_scales[1])
    return _save(out, config, tensors)


def write_dequantized(fp8_dir: Path, out: Path) -> Path:
    """The FP8 checkpoint's weights dequantized to float32, as a plain checkpoint: the oracle
    where transformers cannot load the FP8 format itself."""
    config, tensors = _copy_checkpoint(fp8_dir, out)
    config.pop("quantization_config")
    (out / "hf_quant_config.json").unlink(missing_ok=True)
    plain = {}
    for name, tensor in tensors.items():
        if name.endswith(("_scale", "_scale_inv")):
            continue
        if tensor.dtype != FP8:
            plain[name] = tensor
            continue
        base = name.removesuffix("weight")
        if base + "weight_scale_inv" in tensors:
            plain[name] = dequantize_block(tensor, tensors[base + "weight_scale_inv"])
        else:
            scale = tensors[base + "weight_scale"].float().reshape(-1, 1)
            plain[name] = tensor.float() * scale
    return _save(out, config, plain)
