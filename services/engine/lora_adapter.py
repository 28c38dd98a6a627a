"""LoRA adapters from PEFT directories (`adapter_config.json` + `adapter_model.safetensors`),
laid out for the adapter pool (lora_pool.py), and the host-side cache of loaded ones.

The engine fuses q/k/v into qkv_proj and gate/up into gate_up_proj; an adapter has one
A/B pair per HF module. Each fused projection is one LoRA of several slices (see
kernels/lora.py): A stacks the slices' A factors, R rows per slice (R: the pool's
max_lora_rank; a lower rank is zero-padded), and B stacks their B factors along the
output. PEFT's scaling (lora_alpha / r, or lora_alpha / sqrt(r) with use_rslora, per
module through rank_pattern / alpha_pattern) is folded into B here.

Loading reads files: the worker calls AdapterStore.load off its event loop; the engine
thread only copies the host tensors into a pool slot.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open

from tandem.engine.model_config import ModelConfig

log = logging.getLogger("tandem.lora")

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
MAX_CONFIG_BYTES = 1 << 20
_KEY = re.compile(
    r"^(?:base_model\.model\.)?(?P<module>(?:.*\.)?layers\.(?P<layer>\d+)\.(?:self_attn|mlp)\."
    r"(?P<name>\w+))\.lora_(?P<factor>[AB])(?:\.[\w-]+)?\.weight$"
)


class AdapterNotFoundError(ValueError):
    """The adapter's files are not on this worker (INVALID_ARGUMENT; a decode refusing a handoff
    turns it into FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class LoRAModule:
    """A projection of the engine that takes LoRA: its HF module names (one per output slice, in
    order), its input width and where each slice's output starts and ends."""

    kind: str
    peft_names: tuple[str, ...]
    in_features: int
    slice_bounds: tuple[int, ...]

    @property
    def num_slices(self) -> int:
        return len(self.peft_names)


def lora_modules(config: ModelConfig) -> dict[str, LoRAModule]:
    """The projections an adapter may target: q/k/v, o, gate/up and down of every layer."""
    hidden, inter = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    modules = (
        LoRAModule("qkv_proj", ("q_proj", "k_proj", "v_proj"), hidden, (0, q, q + kv, q + 2 * kv)),
        LoRAModule("o_proj", ("o_proj",), q, (0, hidden)),
        LoRAModule("gate_up_proj", ("gate_proj", "up_proj"), hidden, (0, inter, 2 * inter)),
        LoRAModule("down_proj", ("down_proj",), inter, (0, hidden)),
    )
    if config.moe is not None:  # a MoE layer's experts take no adapters (moe.py): attention only
        modules = modules[:2]
    return {m.kind: m for m in modules}


@dataclass(eq=False)
class LoRAAdapter:
    """An adapter in the pool's layout, on the host. weights: module kind -> (A [layers, slices * R, in],
    B [layers, out, R]) in the model's dtype, B scaled; kinds the adapter does not target are absent."""

    name: str
    int_id: int
    path: str
    rank: int
    fingerprint: (
        str  # blake2b of its two files: equal fingerprints, equal weights (the KV hash uses it)
    )
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]]

    @property
    def key(self) -> tuple[int, str]:
        """What the device pool holds an adapter by: its id (what workers report and the router
        routes by) and its weights."""
        return self.int_id, self.fingerprint

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for pair in self.weights.values() for t in pair)

    def describe(self) -> str:
        return f"LoRA adapter {self.name!r} (lora_int_id {self.int_id}, {self.path})"


def _fingerprint(config_bytes: bytes, weights_path: Path) -> str:
    digest = hashlib.blake2b(digest_size=16)
    digest.update(config_bytes)
    with weights_path.open("rb") as f:
        while chunk := f.read(1 << 22):
            digest.update(chunk)
    return digest.hexdigest()


def _pattern_value(patterns: dict, module: str, default):
    """PEFT's rank_pattern / alpha_pattern lookup: a key matches a module name that ends with it."""
    for key, value in (patterns or {}).items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_config(config: dict, where: str) -> None:
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{where}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": "DoRA",
        "modules_to_save": "modules_to_save (full module copies)",
        "fan_in_fan_out": "fan_in_fan_out (Conv1D weights)",
        "trainable_token_indices": "trainable tokens",
    }
    for key, what in refused.items():
        if config.get(key):
            raise ValueError(
                f"{where}: {what} is not supported; tandem applies plain LoRA to "
                f"q/k/v/o/gate/up/down projections"
            )
    if config.get("bias", "none") != "none":
        raise ValueError(f"{where}: bias={config['bias']!r} is not supported (only bias='none')")


def read_adapter(
    name: str,
    int_id: int,
    path: str,
    modules: dict[str, LoRAModule],
    num_layers: int,
    max_rank: int,
    dtype: torch.dtype,
) -> LoRAAdapter:
    """Reads and checks a PEFT LoRA directory against the model's projections."""
    where = f"LoRA adapter {name!r} (lora_int_id {int_id}) at {path}"
    directory = Path(path)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    if not config_path.is_file() or not weights_path.is_file():
        raise AdapterNotFoundError(
            f"{where}: no {CONFIG_FILE} and {WEIGHTS_FILE} there on this worker"
        )
    # Bounded before anything is read: fp32 factors of every projection at the largest rank the pool
    # holds, with room for safetensors' header.
    max_bytes = 4 * max_rank * num_layers * sum(
        m.in_features * m.num_slices + m.slice_bounds[-1] for m in modules.values()
    ) + (1 << 20)
    if config_path.stat().st_size > MAX_CONFIG_BYTES or weights_path.stat().st_size > max_bytes:
        raise ValueError(
            f"{where}: its files are larger than any LoRA of rank <= {max_rank} on q/k/v/o/gate/up/down "
            f"of this model ({CONFIG_FILE} <= {MAX_CONFIG_BYTES} bytes, {WEIGHTS_FILE} <= {max_bytes})"
        )
    config_bytes = config_path.read_bytes()
    try:
        config = json.loads(config_bytes)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: {CONFIG_FILE} is not JSON: {exc}") from None
    _check_config(config, where)
    slice_of = {peft: (m, i) for m in modules.values() for i, peft in enumerate(m.peft_names)}
    factors: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    with safe_open(str(weights_path), framework="pt") as f:
        for key in f.keys():
            match = _KEY.match(key)
            if match is None or match["name"] not in slice_of:
                raise ValueError(
                    f"{where}: tensor {key!r} is not a LoRA factor of q/k/v/o/gate/up/down_proj; "
                    f"those are the modules tandem applies adapters to"
                )
            layer = int(match["layer"])
            if layer >= num_layers:
                raise ValueError(
                    f"{where}: tensor {key!r} names layer {layer}; the model has {num_layers}"
                )
            entry = factors.setdefault((layer, match["name"]), {"module": match["module"]})
            entry[match["factor"]] = f.get_tensor(key)
    if not factors:
        raise ValueError(f"{where}: {WEIGHTS_FILE} holds no LoRA factors")

    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
    use_rslora = bool(config.get("use_rslora"))
    adapter_rank = 0
    for (layer, peft_name), entry in sorted(factors.items()):
        module, index = slice_of[peft_name]
        lo, hi = module.slice_bounds[index], module.slice_bounds[index + 1]
        a, b = entry.get("A"), entry.get("B")
        if a is None or b is None:
            raise ValueError(
                f"{where}: layer {layer} {peft_name} has lora_A without lora_B or the reverse"
            )
        rank = a.shape[0]
        if a.shape != (rank, module.in_features) or b.shape != (hi - lo, rank):
            raise ValueError(
                f"{where}: layer {layer} {peft_name} has lora_A {tuple(a.shape)} / lora_B "
                f"{tuple(b.shape)}; the model needs [r, {module.in_features}] / [{hi - lo}, r]"
            )
        if rank > max_rank:
            raise ValueError(
                f"{where}: rank {rank} ({peft_name}) exceeds --max-lora-rank {max_rank}"
            )
        adapter_rank = max(adapter_rank, rank)
        rank_for_scale = _pattern_value(
            config.get("rank_pattern"), entry["module"], config.get("r", rank)
        )
        if rank_for_scale != rank:
            raise ValueError(
                f"{where}: {entry['module']} has rank {rank} in its tensors, {rank_for_scale} in "
                f"{CONFIG_FILE}"
            )
        alpha = _pattern_value(
            config.get("alpha_pattern"), entry["module"], config.get("lora_alpha", 8)
        )
        scaling = alpha / (math.sqrt(rank) if use_rslora else rank)
        if module.kind not in weights:
            weights[module.kind] = (
                torch.zeros(
                    num_layers, module.num_slices * max_rank, module.in_features, dtype=dtype
                ),
                torch.zeros(num_layers, module.slice_bounds[-1], max_rank, dtype=dtype),
            )
        pool_a, pool_b = weights[module.kind]
        pool_a[layer, index * max_rank : index * max_rank + rank] = a.to(dtype)
        pool_b[layer, lo:hi, :rank] = (b.double() * scaling).to(dtype)
    return LoRAAdapter(
        name,
        int_id,
        str(directory),
        adapter_rank,
        _fingerprint(config_bytes, weights_path),
        weights,
    )


class AdapterStore:
    """Adapters loaded on the host, by lora_int_id, least recently used dropped past `capacity`
    (a request keeps its own adapter alive). Thread-safe: loads run on worker threads."""

    def __init__(self, model_config: ModelConfig, max_rank: int, dtype: torch.dtype, capacity: int):
        self.modules = lora_modules(model_config)
        self.num_layers = model_config.num_layers
        self.max_rank = max_rank
        self.dtype = dtype
        self.capacity = capacity
        self._adapters: OrderedDict[int, LoRAAdapter] = OrderedDict()
        self._lock = threading.Lock()
        self.num_reads = 0

    def fingerprint(self, int_id: int) -> str | None:
        """The fingerprint of adapter int_id if it is loaded here."""
        with self._lock:
            adapter = self._adapters.get(int_id)
        return adapter.fingerprint if adapter is not None else None

    def load(self, name: str, int_id: int, path: str) -> LoRAAdapter:
        """The adapter a request names, read from disk on first use. An id is one adapter: the same
        id with another name or path is refused."""
        if not name or not path:
            raise ValueError(
                "lora_request needs lora_name and lora_path (a PEFT directory on the workers)"
            )
        with self._lock:
            known = self._adapters.get(int_id)
            if known is not None:
                if (known.name, known.path) != (name, str(Path(path))):
                    raise ValueError(
                        f"lora_int_id {int_id} is {known.describe()} here; give each adapter its own "
                        f"lora_int_id (got {name!r} at {path})"
                    )
                self._adapters.move_to_end(int_id)
                return known
        adapter = read_adapter(
            name, int_id, path, self.modules, self.num_layers, self.max_rank, self.dtype
        )
        with self._lock:
            self.num_reads += 1
            self._adapters[int_id] = adapter
            self._adapters.move_to_end(int_id)
            while len(self._adapters) > self.capacity:
                self._adapters.popitem(last=False)
        log.info(
            "loaded %s: rank %d, %.1f MB", adapter.describe(), adapter.rank, adapter.nbytes / 1e6
        )
        return adapter
