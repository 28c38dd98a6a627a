"""The device side: model weights, the KV pool, and turning a scheduled batch into logits."""
from __future__ import annotations

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.kv_layout import kv_layout
from tandem.engine.loader import allocate_kv_cache, load_model
from tandem.engine.scheduler import ScheduledBatch
from tandem.kernels.attention_metadata import AttentionMetadata

# What must agree for new weights to replace the served ones.
_SHAPE_FIELDS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                 "num_kv_heads", "head_dim", "tie_word_embeddings", "attention_bias", "qk_norm")
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class ModelRunner:
    def __init__(self, config: EngineConfig):
        self.config = config
        self.device = torch.device(config.device)
        dtype = None if config.dtype == "auto" else _DTYPES[config.dtype]
        self.model, self.model_config = load_model(config.model_dir, dtype=dtype, device=self.device)
        self.dtype = next(self.model.parameters()).dtype
        # Where the current weights came from; Resume(["model"]) reloads from here.
        self.weights_source = config.model_dir
        self.weights_version = 0
        self.block_size = config.block_size
        self.num_blocks = config.num_blocks or self._num_blocks_for_memory(config.kv_cache_memory_gb)
        self.kv_cache = allocate_kv_cache(self.model_config, self.num_blocks, self.block_size, self.dtype, self.device)

    # -- memory management (release / resume / update_weights) --
    @property
    def weight_bytes(self) -> int:
        if self.model is None:
            return 0
        tensors = {t.data_ptr(): t for t in list(self.model.parameters()) + list(self.model.buffers())}
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    def release_weights(self) -> None:
        self.model = None
        self._empty_device_cache()

    def restore_weights(self) -> None:
        if self.model is None:
            self.model, _ = load_model(self.weights_source, dtype=self.dtype, device=self.device)

    def release_kv_cache(self) -> None:
        self.kv_cache = None
        self._empty_device_cache()

    def restore_kv_cache(self) -> None:
        if self.kv_cache is None:
            self.kv_cache = allocate_kv_cache(self.model_config, self.num_blocks, self.block_size, self.dtype, self.device)

    def load_weights(self, checkpoint_dir: str):
        """Loads a checkpoint of this model's architecture (off the engine thread); swap_weights() installs it."""
        model, config = load_model(checkpoint_dir, dtype=self.dtype, device=self.device)
        mismatch = [f"{name}: serving {getattr(self.model_config, name)!r}, checkpoint {getattr(config, name)!r}"
                    for name in _SHAPE_FIELDS if getattr(config, name) != getattr(self.model_config, name)]
        if mismatch:
            raise ValueError(f"checkpoint {checkpoint_dir} does not fit the served model: " + "; ".join(mismatch))
        return model

    def swap_weights(self, model, source: str) -> None:
        self.model = model
        self.weights_source = source
        self.weights_version += 1

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_layout(self) -> dict:
        return kv_layout(self.config.model_dir, self.model_config, str(self.dtype).removeprefix("torch."), self.block_size)

    @property
    def block_nbytes(self) -> int:
        return self.kv_cache[0].numel() * self.kv_cache.element_size()

    def _num_blocks_for_memory(self, gigabytes: float) -> int:
        mc = self.model_config
        per_block = mc.num_layers * 2 * self.block_size * mc.num_kv_heads * mc.head_dim * self.dtype.itemsize
        num_blocks = int(gigabytes * (1 << 30)) // per_block
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory_gb={gigabytes} holds no KV block of {per_block} bytes")
        return num_blocks

    @torch.inference_mode()
    def execute(self, batch: ScheduledBatch) -> tuple[torch.Tensor, list[int]]:
        """Runs one step. Returns logits of the sequences that computed their last
        token this step (they sample) and those sequences' indices in the batch."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens: list[int] = []
        seq_lens: list[int] = []
        sample_rows: list[int] = []
        sample_indices: list[int] = []
        for i, (seq, num_new) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start = seq.num_computed_tokens
            end = start + num_new
            input_ids.extend(seq.token_slice(start, end))
            positions.extend(range(start, end))
            query_lens.append(num_new)
            seq_lens.append(end)
            if end == seq.num_tokens:
                sample_rows.append(len(input_ids) - 1)
                sample_indices.append(i)
        meta = AttentionMetadata.build(query_lens=query_lens, seq_lens=seq_lens,
                                       block_tables=[seq.block_table for seq in batch.seqs],
                                       block_size=self.block_size, device=self.device)
        ids = torch.tensor(input_ids, dtype=torch.long, device=self.device)
        pos = torch.tensor(positions, dtype=torch.long, device=self.device)
        hidden = self.model(ids, pos, meta, self.kv_cache)
        logits = self.model.compute_logits(hidden[torch.tensor(sample_rows, dtype=torch.long, device=self.device)])
        return logits.float().cpu(), sample_indices
