"""Builds a CausalLM from an HF checkpoint directory (*.safetensors) and sizes its KV cache.

FP8 checkpoints (quant_formats.py) load as FP8 projections: a projection's `.weight` and its
`.weight_scale` [rows, groups] are parameters side by side, fused and cut for tensor
parallelism by the same rows."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import torch

from tandem.common.exceptions import PreconditionError
from tandem.engine.checkpoint_reader import CheckpointFiles, read_rank_share
from tandem.engine.model import CausalLM
from tandem.engine.model_config import ModelConfig
from tandem.engine.moe import hf_tensor_names as moe_hf_tensor_names
from tandem.engine.parallel import TensorParallel, check_divisible, shard_parameter
from tandem.engine.quant_formats import to_engine_tensors, weight_format
from tandem.kernels.fp8 import FP8

# Fused engine parameter <- the HF tensors concatenated along dim 0, in this order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
}
# Families whose checkpoints store qkv_proj and gate_up_proj fused already, as the engine does.
_FUSED_IN_CHECKPOINT = ("phi3",)
# Present in some older checkpoints, recomputed here from the config.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    files = sorted(model_dir.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {model_dir}")
    return files


def _hf_name(engine_name: str) -> str:
    return engine_name if engine_name.startswith("lm_head.") else "model." + engine_name


def _expected_hf_names(model: CausalLM) -> dict[str, tuple[str, ...]]:
    """engine parameter name -> the HF tensor names it is made of."""
    expected: dict[str, tuple[str, ...]] = {}
    fused_in_checkpoint = model.config.model_type in _FUSED_IN_CHECKPOINT
    for name, _ in model.named_parameters():
        module, leaf = name.rsplit(".", 1)
        parts = moe_hf_tensor_names(name, model.config)
        for fused, sources in () if fused_in_checkpoint else _FUSED.items():
            if module.endswith(fused):
                prefix = module[: -len(fused)]
                parts = tuple(_hf_name(f"{prefix}{src}.{leaf}") for src in sources)
        expected[name] = parts or (_hf_name(name),)
    return expected


def _part_rows(config: ModelConfig, source: str) -> int:
    """Rows (dim 0) of one HF part of a fused parameter, on a single rank."""
    if source == "self_attn.q_proj":
        return config.num_heads * config.head_dim
    if source in ("self_attn.k_proj", "self_attn.v_proj"):
        return config.num_kv_heads * config.head_dim
    return config.intermediate_size  # mlp.gate_proj, mlp.up_proj


def hf_parameter_slices(model: CausalLM) -> dict[str, tuple[str, int, int]]:
    """HF tensor name -> (engine parameter, first row, end row): where each tensor of an HF
    checkpoint lands in a single-rank model's parameters (a fused parameter holds its parts one
    after the other along dim 0). What an in-place weight update writes through."""
    if model.config.impl == "transformers":
        raise PreconditionError(
            "update_weights by IPC handles is not supported on the transformers model path: "
            "update from a checkpoint directory"
        )
    shapes = {name: param.shape for name, param in model.named_parameters()}
    slices: dict[str, tuple[str, int, int]] = {}
    for name, parts in _expected_hf_names(model).items():
        if len(parts) == 1:
            slices[parts[0]] = (name, 0, shapes[name][0])
            continue
        module = name.rsplit(".", 1)[0]
        fused = next((f for f in _FUSED if module.endswith(f)), None)
        # A fused parameter of a MoE block (moe.py) is made of equal parts: experts, gate|up.
        sources = _FUSED[fused] if fused else [None] * len(parts)
        start = 0
        for hf, source in zip(parts, sources):
            rows = shapes[name][0] // len(parts)
            end = start + (_part_rows(model.config, source) if source else rows)
            slices[hf] = (name, start, end)
            start = end
        if start != shapes[name][0]:
            raise ValueError(
                f"{name}: its parts have {start} rows, the parameter {shapes[name][0]}"
            )
    return slices


def is_ignored_tensor(hf_name: str) -> bool:
    """A tensor some checkpoints carry that the engine recomputes (rotary inverse frequencies)."""
    return hf_name.endswith(_IGNORED_SUFFIXES)


def _read_tensors(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every tensor of the files, whole (the encoder's loader; progress logged as it reads)."""
    with contextlib.ExitStack() as stack:
        checkpoint = CheckpointFiles(files, stack)
        return {name: checkpoint.whole(name) for name in sorted(checkpoint.names())}


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp: TensorParallel = TensorParallel(),
    quantization: str = "auto",
    model_impl: str = "auto",
) -> tuple[CausalLM, ModelConfig]:
    """tp: the rank whose share of the weights to keep (parallel.py): a rank reads only its share
    of each tensor (checkpoint_reader.py), except from an FP8 checkpoint, whose block scales are
    cut with their weights after a whole read. quantization "fp8": FP8 projections even from a
    model-dtype checkpoint (an FP8 checkpoint loads as FP8 either way). The model's
    `checkpoint_bytes_read` says how many bytes of tensors this rank read. model_impl
    (model_config.MODEL_IMPLS): a model on the transformers path loads through hf_model.py (one
    rank, the checkpoint's own weight format)."""
    model_dir = Path(model_dir)
    config = ModelConfig.from_pretrained(model_dir, model_impl)
    if config.impl == "transformers":
        # Imported here: it imports transformers, which the native path does without.
        from tandem.engine.hf_model import load_transformers_model

        return load_transformers_model(model_dir, config, dtype, device), config
    check_divisible(config, tp.size)
    fmt = weight_format(model_dir, quantization)  # an unsupported one is refused before any read
    dtype = dtype or config.torch_dtype
    with torch.device("meta"):
        model = CausalLM(config, tp, fmt.fp8_group_size)
    expected = _expected_hf_names(model)
    wanted = {hf for parts in expected.values() for hf in parts}
    optional = {"lm_head.weight"} if config.tie_word_embeddings else set()
    reads_slices = tp.is_parallel and not fmt.is_fp8
    with contextlib.ExitStack() as stack:
        files = CheckpointFiles(_checkpoint_files(model_dir), stack)
        if reads_slices:
            stored_fp8 = sorted(n for n in wanted & files.names() if files.is_fp8(n))
            if stored_fp8:
                raise ValueError(
                    f"{stored_fp8[0]} is float8_e4m3fn but config.json has no quantization_config "
                    "naming its scales"
                )
            # What is not a parameter (KV and activation scales, strays) is small: read whole.
            others = [
                k for k in files.names() - wanted - optional if not k.endswith(_IGNORED_SUFFIXES)
            ]
            files.plan(len(others) + len(wanted & files.names()), files.file_bytes // tp.size)
            tensors = {k: files.whole(k) for k in others}
            tensors, kv_scales = to_engine_tensors(tensors, fmt)
            present = files.names()
        else:
            names = [n for n in files.names() if n not in optional or n in wanted]
            files.plan(len(names), files.file_bytes)
            tensors, kv_scales = to_engine_tensors({k: files.whole(k) for k in names}, fmt)
            present = tensors.keys()
        missing = sorted(wanted - present)
        unexpected = sorted(
            k
            for k in (tensors.keys() if reads_slices else present) - wanted - optional
            if not k.endswith(_IGNORED_SUFFIXES)
        )
        if missing or unexpected:
            raise ValueError(
                f"checkpoint {model_dir} does not match {config.model_type}: "
                f"missing tensors {missing}, unexpected tensors {unexpected}"
            )

        params = dict(model.named_parameters())
        shapes = {name: param.shape for name, param in params.items()}
        state = {}
        for name, parts in expected.items():
            if reads_slices:
                tensor = read_rank_share(files, name, parts, config, tp)
            else:
                tensor = shard_parameter(
                    name, torch.cat([tensors.pop(p) for p in parts]), config, tp.rank, tp.size
                )
            if tensor.shape != shapes[name]:
                raise ValueError(
                    f"tensors {list(parts)} have shape {tuple(tensor.shape)} in {model_dir}"
                    + (f" (rank {tp.rank} of {tp.size})" if tp.is_parallel else "")
                    + ", "
                    f"config.json implies {tuple(shapes[name])}"
                )
            # FP8 weights and their float32 scales keep their dtypes; the rest is the model dtype.
            is_fp8_part = params[name].dtype == FP8 or name.endswith(".weight_scale")
            state[name] = tensor.to(
                device=device, dtype=params[name].dtype if is_fp8_part else dtype
            )
        num_bytes_read = files.num_bytes_read
    model.load_state_dict(state, strict=True, assign=True)
    for index, (k_scale, v_scale) in kv_scales.items():
        if not 0 <= index < config.num_layers or not (k_scale > 0 and v_scale > 0):
            raise ValueError(
                f"checkpoint {model_dir}: KV scales of layer {index} ({k_scale}, {v_scale}) "
                f"must be positive, for one of {config.num_layers} layers"
            )
        attention = model.layers[index].self_attn
        attention.k_scale, attention.v_scale = k_scale, v_scale
    # Non-persistent buffers are still on the meta device; rebuild them for real.
    model.rotary = type(model.rotary)(config, dtype, device)
    model.checkpoint_bytes_read = num_bytes_read
    return model.eval(), config


def allocate_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype | None = None,
    device: str | torch.device = "cpu",
    tp_size: int = 1,
) -> torch.Tensor:
    """[num_blocks, num_layers, 2, block_size, num_kv_heads / tp_size, head_dim], zeroed: a rank
    holds the KV of its own heads.

    Zeroed rather than empty: padded block-table entries point at block 0 and are
    masked, and masked garbage that happens to be NaN would still poison the sum.
    """
    shape = kv_cache_shape(config, num_blocks, block_size, tp_size)
    return torch.zeros(shape, dtype=dtype or config.torch_dtype, device=device)


def kv_cache_shape(
    config: ModelConfig, num_blocks: int, block_size: int, tp_size: int = 1
) -> tuple[int, ...]:
    return (
        num_blocks,
        config.num_layers,
        2,
        block_size,
        config.num_kv_heads // tp_size,
        config.head_dim,
    )
