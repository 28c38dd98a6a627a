"""The device side: model weights, the KV pool, and turning a scheduled batch into sampled tokens.

A step's inputs go through persistent buffers (step_inputs.py); decode steps replay a
CUDA graph of their padded batch size (cuda_graphs.py), prefill and mixed steps run
eagerly; the sampler draws on the device and only token ids and log-probabilities
come back to the host. LoRA adapters live in a pool of fixed device tensors
(lora_pool.py) and a step's per-token adapter indices in the persistent buffers, so
decode steps with adapters replay graphs too: a second set, captured with the LoRA
kernels on the first such step (a step without adapters keeps the plain graphs and
pays nothing for LoRA).
"""

from __future__ import annotations

import collections
import functools
import itertools
import logging
import time
from dataclasses import dataclass

import torch

from tandem.common.exceptions import PreconditionError
from tandem.engine import moe
from tandem.engine.checkpoints import checkpoint_fingerprint
from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graphs import DecodeGraphs
from tandem.engine.guided import allowed_bitmask, new_matcher
from tandem.engine.kv_layout import kv_layout
from tandem.engine.kv_share import allocate_shared
from tandem.engine.kv_tier import TierCopies, runs
from tandem.engine.loader import allocate_kv_cache, kv_cache_shape, load_model
from tandem.engine.logits_masks import banned_ids
from tandem.engine.lora_adapter import lora_modules
from tandem.engine.lora_pool import LoRABatch, LoRAPool
from tandem.engine.model_config import ModelConfig
from tandem.engine.parallel import TensorParallel, check_divisible
from tandem.engine.quant_formats import weight_format
from tandem.engine.sampler import PositionLogprobs, SampledBatch, Sampler, top_logprobs
from tandem.engine.scheduler import ScheduledBatch
from tandem.engine.sequence import Sequence
from tandem.engine.step_inputs import InputBuffers, PackedStep
from tandem.engine.tp_ranks import FollowerRanks
from tandem.kernels.batch_invariant import batch_invariant, schedule_id
from tandem.kernels.dispatch import GreedyDraws, backend_for, check_settings
from tandem.kernels.fp8 import FP8

# weights_source of weights written by IPC handles (update_weights(dict)).
IPC_SOURCE = "ipc"
# A drafted step replays a decode graph, each of a sequence's k + 1 rows a decode query that
# reads all its keys, while their KV bytes read again stay under this (~1.3 ms of HBM on an
# H100, against the several ms an eager step's launches cost a small model); past it the eager
# step's multi-query kernel reads each sequence's keys once.
GRAPH_VERIFY_MAX_EXTRA_KV_BYTES = 4 << 30

log = logging.getLogger("tandem.model_runner")


@dataclass
class PromptRows:
    """What a step computed of a sequence's prompt positions for its prompt outputs."""

    num_positions: int
    logprobs: list[PositionLogprobs]  # top prompt_logprobs per position ([] when not asked)
    logits: torch.Tensor | None  # [positions, vocab] float32 on the host (return_context_logits)


# The history and the banned ids of a row whose options need neither (most rows): shared, never
# mutated, so a step builds nothing for them.
_NO_IDS: list[int] = []
_NONE_BANNED: frozenset[int] = frozenset()

# What must agree for new weights to replace the served ones.
_SHAPE_FIELDS = (
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_layers",
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "tie_word_embeddings",
    "attention_bias",
    "qk_norm",
    "moe",
)
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class _NoDrafts:
    """Stands for a step's per-row drafts when no row has any: an empty list at every index."""

    def __iter__(self):
        return itertools.repeat(())


_NO_DRAFTS = _NoDrafts()


def _with(ids: list[int], drafts) -> list[int]:
    """ids followed by the drafts a row assumes accepted."""
    return ids + drafts if drafts else ids


def _repeat_offsets(seqs: list[Sequence]) -> list[int]:
    """For each row, how many rows of the same sequence come before it (its drafted position)."""
    offsets, previous, count = [], None, 0
    for seq in seqs:
        count = count + 1 if seq is previous else 0
        previous = seq
        offsets.append(count)
    return offsets


def _resolve_device(name: str) -> torch.device:
    device = torch.device(name)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return device


def _serving_dtype(config: EngineConfig, device: torch.device) -> torch.dtype | None:
    """--dtype, or with auto the checkpoint's own (None), except float16 on the CPU, which has
    no fast float16 GEMM: float32 there (a converted quantized GGUF file is float16)."""
    if config.dtype != "auto":
        return _DTYPES[config.dtype]
    model_config = ModelConfig.from_pretrained(config.model_dir, config.model_impl)
    if device.type == "cpu" and model_config.dtype == "float16":
        return torch.float32
    return None


def _check_context_length(model_config: ModelConfig, max_model_len: int) -> None:
    """Positions past the model's have no rotary table: a longer context would start, then fail a
    long prompt mid-step (an IndexError, INTERNAL to its client)."""
    limit = max(model_config.max_context_len, model_config.max_position_embeddings)
    if max_model_len > limit:
        raise ValueError(
            f"max_model_len {max_model_len} is more than this model's context "
            f"({limit}, max_position_embeddings and its rope scaling): give --max-model-len "
            f"{limit} or less (0: the model's own)"
        )


class ModelRunner:
    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallel | None = None,
        kv_share_path: str | None = None,
    ):
        """tp: this process's rank when it is a follower (tp_follower.py); rank 0 passes None and
        starts the followers itself when config.tensor_parallel_size > 1. kv_share_path: a CPU
        follower's KV pool file, which rank 0 maps (kv_share.py)."""
        self.config = config
        self.kv_share_path = kv_share_path
        self.followers: FollowerRanks | None = None
        # Rank 0's views of the followers' KV pools: its one NIXL agent registers them with its own.
        self.follower_pools: list[torch.Tensor] = []
        if (
            tp is None
        ):  # what the model cannot do is refused here, before weights load or any rank starts
            model_config = ModelConfig.from_pretrained(config.model_dir, config.model_impl)
            _check_context_length(model_config, config.max_model_len)
            if model_config.impl == "transformers":
                from tandem.engine.hf_model import check_engine_config

                check_engine_config(config)
            if config.tensor_parallel_size > 1:
                check_divisible(model_config, config.tensor_parallel_size)
                self.followers = FollowerRanks(config)
                tp = self.followers.tp
        self.tp = tp or TensorParallel()
        try:
            self._build(config)
        except BaseException:
            self.close()
            raise
        if self.followers is not None:
            self.followers.wait_loaded()
            self.follower_pools = self.followers.map_pools(
                tuple(self.kv_cache.shape), self.kv_dtype, self.device
            )

    def _build(self, config: EngineConfig) -> None:
        self.device = _resolve_device(config.device)
        check_settings(self.device)
        self.bind_device()
        dtype = _serving_dtype(config, self.device)
        self.model, self.model_config = load_model(
            config.model_dir,
            dtype=dtype,
            device=self.device,
            tp=self.tp,
            quantization=config.quantization,
            model_impl=config.model_impl,
        )
        # The activations' dtype (the embedding's; FP8 projections hold their own).
        self.dtype = self.model.embed_tokens.weight.dtype
        self.kv_dtype = FP8 if config.kv_cache_dtype == "fp8" else self.dtype
        # Where the current weights came from; Resume(["model"]) reloads from here.
        self.weights_source = config.model_dir
        # What the files there were when they were loaded (a checkpoint rewritten in place differs).
        self.source_fingerprint = checkpoint_fingerprint(config.model_dir)
        self.weights_version = 0
        # Updates by IPC handles finalized since the weights last came from a checkpoint, and
        # whether one has written some of its buckets and is not finalized yet.
        self.num_ipc_updates = 0
        self.ipc_update_open = False
        self.block_size = config.block_size
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        self.num_blocks = config.num_blocks or self._num_blocks_for_memory(
            config.kv_cache_memory_gb
        )
        self.kv_cache = self._allocate_kv_cache()
        # The host KV tier's blocks (engine/kv_tier.py), pinned on CUDA; None without a tier.
        self.host_kv = None
        # Its copy stream (CUDA) and the batches of copies still running on it.
        self._tier_stream = None
        self._tier_pending: collections.deque = collections.deque()
        if config.host_kv_cache_gb:
            num_host = int(config.host_kv_cache_gb * (1 << 30)) // self.block_nbytes
            if num_host < 1:
                raise ValueError(
                    f"host_kv_cache_gb={config.host_kv_cache_gb} holds no KV block of "
                    f"{self.block_nbytes} bytes"
                )
            self.host_kv = torch.zeros(
                (num_host, *self.kv_cache.shape[1:]),
                dtype=self.kv_cache.dtype,
                pin_memory=self.device.type == "cuda",
            )
        max_num_seqs = config.max_num_seqs
        self.lora_pool = None
        # The transformers path has no LoRA kernels in its projections: no pool, lora_request refused.
        if config.max_loras and self.model_config.impl == "tandem":
            self.lora_pool = LoRAPool(
                lora_modules(self.model_config),
                self.model_config.num_layers,
                config.max_loras,
                config.max_lora_rank,
                self.dtype,
                self.device,
            )
        # A decode graph's rows: one per sequence, and with speculative decoding a drafted
        # sequence's k + 1 rows each (as many as a step samples at most).
        graph_rows = max(max_num_seqs, config.max_num_samples)
        self.inputs = InputBuffers(
            max(config.max_num_batched_tokens, graph_rows),
            graph_rows,
            -(-self.max_model_len // self.block_size) + 1,
            self.block_size,
            self.device,
            config.max_loras,
            config.max_num_samples,
        )
        # Followers upload what rank 0 packs into tables of their own: every entry, every step.
        self.inputs.incremental_tables = not self.tp.is_parallel
        self.sampler = Sampler(
            self.model_config.vocab_size, config.max_num_samples, self.device, config.seed
        )
        self.graphs: DecodeGraphs | None = None
        self.lora_graphs: DecodeGraphs | None = None
        # EAGLE-3 (engine/eagle3.py): the target layers whose states each forward keeps, who
        # takes them (batch, states) after the forward, and the rows a decode graph writes them
        # to (one buffer for every size, as the graphs' logits); () and None when off.
        self.aux_layer_ids: tuple[int, ...] = ()
        self.aux_hidden_states_hook = None
        self.graph_aux_states: torch.Tensor | None = None
        self.graph_rows = graph_rows
        # The last step's draws on the device and each drawing sequence's row in them: the next
        # step reads a token still in flight from there, not from the host.
        self._last_draws: tuple[dict[Sequence, int], torch.Tensor] | None = None
        # A follower rank's copy of those draws (rank 0 broadcasts them).
        self._follower_tokens: torch.Tensor | None = None
        if (
            config.deterministic
            and self.device.type == "cuda"
            and backend_for(self.device) != "triton"
        ):
            raise ValueError(
                "--deterministic on a GPU needs the Triton kernels (the torch ones change their "
                "schedule with the batch there): install triton and leave TANDEM_ATTENTION_BACKEND "
                "unset"
            )
        if config.enforce_eager or (
            config.deterministic and (backend_for(self.device) != "triton" or self.model_config.moe)
        ):
            # The torch batch-invariant attention walks host-side chunk lists, and the MoE's
            # batch-invariant expert loop reads its expert counts on the host: eager only.
            pass
        elif self.model_config.impl == "transformers":
            # transformers' modules were never checked for capture (host syncs, shape-dependent
            # branches): its steps run eagerly.
            if self.device.type == "cuda":
                log.info("the transformers model path runs decode steps eagerly (no CUDA graphs)")
        elif self.device.type == "cuda" and backend_for(self.device) != "triton":
            log.warning(
                "decode CUDA graphs need the Triton kernels (the torch reference syncs); running eagerly"
            )
        else:
            self.graphs = DecodeGraphs(
                self._decode_logits,
                self.inputs.fill_dummy,
                graph_rows,
                self.device,
                dense_until=max_num_seqs,
            )
            if self.lora_pool is not None:
                self.lora_graphs = DecodeGraphs(
                    lambda size: self._decode_logits(size, with_lora=True),
                    self.inputs.fill_dummy,
                    graph_rows,
                    self.device,
                    dense_until=max_num_seqs,
                )

    def enable_aux_hidden_states(self, layer_ids: tuple[int, ...], hook) -> None:
        """Every forward keeps the states entering layer_ids and hands them to hook(batch, states)
        (EAGLE-3's drafter); the decode graphs are captured again with them."""
        self.aux_layer_ids, self.aux_hidden_states_hook = tuple(layer_ids), hook
        self.model.aux_layer_ids = self.aux_layer_ids
        self._drop_graphs()
        if self.graphs is not None:
            width = len(self.aux_layer_ids) * self.model_config.hidden_size
            self.graph_aux_states = torch.empty(
                (self.graph_rows, width), dtype=self.dtype, device=self.device
            )

    def precompile_kernels(self) -> float:
        """Compiles the attention variants eager steps can launch (paged_attention_triton) and the
        MoE kernel's (moe_triton), so no compile stalls serving; returns the seconds it took (0
        where Triton does not run)."""
        if self.device.type != "cuda" or backend_for(self.device) != "triton":
            return 0.0
        from tandem.kernels.paged_attention_triton import precompile_eager_variants

        started = time.perf_counter()
        precompile_eager_variants(
            self.kv_cache[:, 0],
            self.model_config.num_heads // self.tp.size,
            self.dtype,
            self.model_config.attention_scorings,
        )
        moe.precompile(self.model)  # the MoE kernel's row tiles (nothing for a dense model)
        torch.cuda.synchronize(self.device)
        return time.perf_counter() - started

    def _allocate_kv_cache(self):
        if self.kv_share_path is not None:
            shape = kv_cache_shape(
                self.model_config, self.num_blocks, self.block_size, self.tp.size
            )
            return allocate_shared(shape, self.kv_dtype, self.kv_share_path)
        return allocate_kv_cache(
            self.model_config,
            self.num_blocks,
            self.block_size,
            self.kv_dtype,
            self.device,
            self.tp.size,
        )

    @property
    def kv_pools(self) -> list[torch.Tensor]:
        """Every rank's KV pool, rank 0's first (just the one at tensor_parallel_size 1)."""
        return [self.kv_cache] + self.follower_pools

    @property
    def num_local_kv_heads(self) -> int:
        """The KV heads this rank holds (all of them at tensor_parallel_size 1)."""
        return self.model_config.num_kv_heads // self.tp.size

    def require_single_rank(self, what: str) -> None:
        """Refuses what the follower ranks cannot follow yet (new weights, released memory)."""
        if self.tp.is_parallel:
            raise PreconditionError(
                f"{what} is not supported with tensor_parallel_size={self.tp.size} "
                f"(the follower ranks would keep the old weights and memory)"
            )

    def close(self) -> None:
        """Stops the follower ranks (rank 0 of a tensor-parallel engine); nothing to do otherwise."""
        if self.followers is not None:
            self.followers.close()

    def bind_device(self) -> None:
        """Makes the engine's GPU the calling thread's current device. Triton launches on the
        current device, which CUDA keeps per thread: the engine is built on one thread and steps
        on another, and a worker given cuda:1 must not launch on cuda:0 whatever else the process
        touched."""
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def synchronize(self) -> None:
        """Waits for every kernel queued so far (before blocks go to a writer that is not on our
        stream: a NIXL READ)."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    # -- memory management (release / resume / update_weights) --
    @property
    def weight_bytes(self) -> int:
        if self.model is None:
            return 0
        tensors = {
            t.data_ptr(): t for t in list(self.model.parameters()) + list(self.model.buffers())
        }
        return sum(t.numel() * t.element_size() for t in tensors.values())

    @property
    def kv_cache_bytes(self) -> int:
        return 0 if self.kv_cache is None else self.kv_cache.numel() * self.kv_cache.element_size()

    def release_weights(self) -> None:
        self.model = None
        if self.lora_pool is not None:
            self.lora_pool.free_tensors()
        self._drop_graphs()
        self._empty_device_cache()

    def restore_weights(self) -> None:
        if self.model is None:
            self.source_fingerprint = checkpoint_fingerprint(self.weights_source)
            self.model, _ = load_model(
                self.weights_source,
                dtype=self.dtype,
                device=self.device,
                quantization=self.config.quantization,
                model_impl=self.config.model_impl,
            )
            self.model.aux_layer_ids = self.aux_layer_ids

    def release_kv_cache(self) -> None:
        self.synchronize()  # the host tier's copy stream may still read the pool
        self.kv_cache = None
        self._drop_graphs()
        self._empty_device_cache()

    def restore_kv_cache(self) -> None:
        if self.kv_cache is None:
            self.kv_cache = self._allocate_kv_cache()

    def load_weights(self, checkpoint_dir: str):
        """Loads a checkpoint of this model's architecture (off the engine thread); swap_weights() installs it."""
        self.require_single_rank("update_weights")
        model, config = load_model(
            checkpoint_dir,
            dtype=self.dtype,
            device=self.device,
            quantization=self.config.quantization,
            model_impl=self.config.model_impl,
        )
        mismatch = [
            f"{name}: serving {getattr(self.model_config, name)!r}, checkpoint {getattr(config, name)!r}"
            for name in _SHAPE_FIELDS
            if getattr(config, name) != getattr(self.model_config, name)
        ]
        if mismatch:
            raise ValueError(
                f"checkpoint {checkpoint_dir} does not fit the served model: " + "; ".join(mismatch)
            )
        return model

    def swap_weights(self, model, source: str, fingerprint: str) -> None:
        """fingerprint: checkpoint_fingerprint(source) taken before the load."""
        self.model = model
        self.model.aux_layer_ids = self.aux_layer_ids
        self._drop_graphs()
        self.weights_source = source
        self.source_fingerprint = fingerprint
        self.weights_version += 1
        self.num_ipc_updates, self.ipc_update_open = 0, False

    @torch.inference_mode()
    def copy_weights(self, updates: list, finalize: bool) -> None:
        """Writes (parameter, first row, end row, tensor) updates into the served weights (their
        addresses stay: captured graphs stay valid). The update stays open until finalize; a
        finalize with none open changes nothing (one sent again after a partial failure)."""
        params = dict(self.model.named_parameters())
        for name, start, end, tensor in updates:
            params[name][start:end].copy_(tensor)
        if self.device.type == "cuda":  # the trainer's memory may change once this returns
            torch.cuda.synchronize(self.device)
        self.weights_version += 1
        if not finalize:
            self.ipc_update_open = True
        elif self.ipc_update_open:
            self.ipc_update_open = False
            self.weights_source = IPC_SOURCE
            self.num_ipc_updates += 1

    @property
    def weights_id(self) -> str:
        """Which weights this runner serves (KvHandoff.weights_id): the checkpoint directory and
        what its files were when loaded, or how many updates by IPC handles were finalized since
        the last one, and whether one is open. Workers given the same updates agree; a worker that
        missed one (a checkpoint rewritten in place included) does not."""
        base = (
            f"{IPC_SOURCE}@{self.num_ipc_updates}"
            if self.weights_source == IPC_SOURCE
            else f"{self.weights_source}@{self.source_fingerprint}"
        )
        return base + ("+open" if self.ipc_update_open else "")

    def check_weights_restorable(self) -> None:
        """Refuses to release weights that exist only in this process (written by IPC handles)."""
        if self.weights_source == IPC_SOURCE or self.ipc_update_open:
            raise PreconditionError(
                "the served weights came by IPC handles and exist only in this process: releasing "
                "them would lose them (resume could not reload them); update_weights from a "
                "checkpoint directory first, or keep them"
            )

    def _drop_graphs(self) -> None:
        """Graphs hold the addresses of the weights, the KV pool and the LoRA pool they were captured with."""
        for graphs in (self.graphs, self.lora_graphs):
            if graphs is not None:
                graphs.clear()

    def _empty_device_cache(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    @property
    def kv_layout(self) -> dict:
        return kv_layout(
            self.config.model_dir,
            self.model_config,
            str(self.kv_dtype).removeprefix("torch."),
            self.block_size,
            self.weights_method,
            self.config.deterministic,
            schedule_id(self.device, backend_for(self.device)),
        )

    @functools.cached_property
    def weights_method(self) -> str:
        """The weights' format as loaded (quant_formats.WeightFormat.method), part of the KV
        layout: an FP8 checkpoint served with --quantization auto or fp8 computes the same KV."""
        return weight_format(self.config.model_dir, self.config.quantization).method

    @property
    def block_nbytes(self) -> int:
        return self.kv_cache[0].numel() * self.kv_cache.element_size()

    def _num_blocks_for_memory(self, gigabytes: float) -> int:
        mc = self.model_config
        per_block = (
            mc.num_layers
            * 2
            * self.block_size
            * self.num_local_kv_heads
            * mc.head_dim
            * self.kv_dtype.itemsize
        )
        num_blocks = int(gigabytes * (1 << 30)) // per_block
        if num_blocks < 1:
            raise ValueError(
                f"kv_cache_memory_gb={gigabytes} holds no KV block of {per_block} bytes"
            )
        return num_blocks

    def copy_kv_tier(self, copies: TierCopies) -> bool:
        """The host tier's copies owed since the last flush (kv_tier.TierCopies): down first, then
        up. On CUDA they run on a copy stream of their own, in order, after the KV queued so far
        on the device's stream: a block written through goes down while the steps go on. The
        device's stream waits for the copy stream when the next step reads a block copied up or
        writes one whose copy down may not have landed yet (the copy stream runs in order, so
        that wait also covers copies down queued before). Returns whether it waits: then a NIXL
        READ or write outside the stream order must synchronize the device first."""
        if self.kv_cache is None or self.host_kv is None:
            return False
        # FP8 blocks move as bytes.
        pool, host = (
            (self.kv_cache.view(torch.uint8), self.host_kv.view(torch.uint8))
            if self.kv_dtype == FP8
            else (self.kv_cache, self.host_kv)
        )
        if self.device.type != "cuda":
            for block, slot, n in runs(copies.down):
                host[slot : slot + n].copy_(pool[block : block + n])
            for slot, block, n in runs(copies.up):
                pool[block : block + n].copy_(host[slot : slot + n])
            return False
        stream = self._tier_stream
        if stream is None:
            stream = self._tier_stream = torch.cuda.Stream(self.device)
        # Batches of copies still running: (their end, the device blocks they read or write).
        pending = self._tier_pending
        while pending and pending[0][0].query():
            pending.popleft()
        if copies.down or copies.up:
            stream.wait_stream(torch.cuda.current_stream(self.device))
            # One copy a run of blocks consecutive on both sides, into and out of pinned memory (a
            # 2 MiB block a copy ran at half the link's rate on an H100).
            with torch.cuda.stream(stream):
                for block, slot, n in runs(copies.down):
                    host[slot : slot + n].copy_(pool[block : block + n], non_blocking=True)
                for slot, block, n in runs(copies.up):
                    pool[block : block + n].copy_(host[slot : slot + n], non_blocking=True)
                done = torch.cuda.Event()
                done.record(stream)
            # The device blocks this batch reads (down) or writes (up): one reused before the
            # batch has run must wait for it.
            pending.append(
                (done, {block for block, _ in copies.down} | {block for _, block in copies.up})
            )
        # The device's stream waits for the copy stream (up to its last batch) when the next step
        # reads a block copied up or writes one whose copy down may not have landed yet.
        if copies.up or any(b in blocks for _, blocks in pending for b in copies.reused):
            torch.cuda.current_stream(self.device).wait_stream(stream)
            return True
        return False

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """KV block copies [(source, destination)] (beam forks), queued before any later step; waited
        for on CUDA, so a block freed next cannot be read by a NIXL pull before its copy is done."""
        if not pairs or self.kv_cache is None:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.device)
        dst = torch.tensor([d for _, d in pairs], device=self.device)
        # Through bytes: index_copy_ has no float8 kernel on the CPU.
        pool = self.kv_cache.view(torch.uint8) if self.kv_dtype == FP8 else self.kv_cache
        pool.index_copy_(0, dst, pool.index_select(0, src))
        self.synchronize()

    def _graph_size(self, batch: ScheduledBatch) -> int | None:
        """The decode graph that runs this batch: one new token per sequence, each one sampling,
        or (speculative decoding) a sequence's last token and its drafts, a row each: row j
        attends to the keys up to its own position, which is a decode row (step_inputs.pack)."""
        if self.graphs is None:
            return None
        extra_keys = 0  # keys a drafted sequence's rows read again, one row past the first each
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            if (
                num_new != 1 + len(seq.draft_token_ids)
                or seq.num_computed_tokens + 1 != seq.num_tokens + seq.num_pending_tokens
            ):
                return None
            extra_keys += (num_new - 1) * seq.num_tokens
        if extra_keys and (
            extra_keys * self.block_nbytes // self.block_size > GRAPH_VERIFY_MAX_EXTRA_KV_BYTES
        ):
            return None  # long contexts: the eager step's k + 1-query kernel reads them once
        return self.graphs.size_for(sum(batch.num_new_tokens))

    def _decode_logits(self, batch_size: int, with_lora: bool = False) -> torch.Tensor:
        """The captured function: the decode forward of batch_size rows from the input buffers (and
        the adapters of their LoRA indices)."""
        splits = None
        if self.config.deterministic:
            splits = 1  # the batch-invariant schedule: one key segment (paged_attention_triton)
        elif self.device.type == "cuda":
            from tandem.kernels.paged_attention_triton import graph_num_splits

            splits = graph_num_splits(batch_size, self.num_local_kv_heads, self.device)
        views, meta = self.inputs.graph_metadata(batch_size, splits, self.max_model_len)
        lora = (
            LoRABatch(self.lora_pool, self.inputs.graph_lora_metadata(batch_size))
            if with_lora
            else None
        )
        hidden = self.model(views["input_ids"], views["positions"], meta, self.kv_cache, lora)
        if self.graph_aux_states is not None:  # EAGLE-3: the layers' states leave the graph too
            self.graph_aux_states[:batch_size].copy_(self.model.aux_hidden_states)
        return self.model.compute_logits(hidden)

    def _prompt_rows(
        self,
        batch: ScheduledBatch,
        hidden: torch.Tensor | None,
        logits: torch.Tensor | None,
        seqs: list[Sequence],
    ) -> dict[Sequence, PromptRows]:
        """The prompt positions this step computes for sequences that asked for prompt_logprobs or
        context logits: the top prompt_logprobs of each position's next-token distribution
        (TensorRT-LLM's compute_logprobs over the context logits) and the raw rows. Rare, so read
        back at once (a sync on CUDA)."""
        found: dict[Sequence, PromptRows] = {}
        first_row = 0
        for seq, num_new in zip(batch.seqs, batch.num_new_tokens):
            rows_start, first_row = first_row, first_row + num_new
            if not seq.needs_prompt_rows:
                continue
            start = seq.num_computed_tokens  # the step's first position (counted after execute)
            positions = range(
                max(start, seq.num_prompt_rows), min(start + num_new, seq.num_prompt_tokens)
            )
            if not positions:
                continue
            if hidden is None:  # a decode graph: its one row per sequence is the sampled row
                rows = logits[[seqs.index(seq)]]
            else:
                rows = self.model.compute_logits(
                    hidden[
                        rows_start + positions.start - start : rows_start + positions.stop - start
                    ]
                )
            k = seq.options.prompt_logprobs
            found[seq] = PromptRows(
                len(positions),
                top_logprobs(rows, k) if k else [],
                rows.float().cpu() if seq.options.return_context_logits else None,
            )
        return found

    @torch.inference_mode()
    def execute(
        self, batch: ScheduledBatch
    ) -> tuple[list[Sequence], SampledBatch | None, dict[Sequence, PromptRows]]:
        """Runs one step and queues the draws of the sequences whose last token it computed.
        Returns those sequences, their draws (still on the device: SampledBatch.to_host()) and the
        prompt outputs of the positions it computed for sequences that asked for them."""
        self.bind_device()
        with batch_invariant(self.config.deterministic):
            return self._execute(batch)

    def _execute(
        self, batch: ScheduledBatch
    ) -> tuple[list[Sequence], SampledBatch | None, dict[Sequence, PromptRows]]:
        graph_size = self._graph_size(batch)
        graphs = (
            self.lora_graphs
            if any(seq.lora_slot is not None for seq in batch.seqs)
            else self.graphs
        )
        last_rows, last_tokens = self._last_draws or ({}, None)
        step = self.inputs.pack(batch, graph_size, last_rows)
        if self.followers is not None:
            self.followers.send_step(step)
        hidden, logits, greedy = self._forward(step, graphs, last_tokens)
        if self.aux_hidden_states_hook is not None:
            aux = self.model.aux_hidden_states if hidden is not None else self.graph_aux_states
            self.aux_hidden_states_hook(batch, aux)
        seqs = [batch.seqs[i] for i in step.sample_indices]
        prompt_logprobs = self._prompt_rows(batch, hidden, logits, seqs)
        if not seqs:
            self._last_draws = None
            return [], None, prompt_logprobs
        # Counts include tokens still in flight: they are this row's draw index and min_tokens progress.
        # (Penalties need the ids themselves: the engine reads them back before such a step.)
        drawn = [s.num_output_tokens + s.num_pending_tokens for s in seqs]
        # A sequence with drafts samples a row per drafted position: row j draws the token after
        # its drafts[:j], as if they were accepted (only then is the row used).
        drafted = _NO_DRAFTS
        if any(s.draft_token_ids for s in seqs):
            drafted = [s.draft_token_ids[:j] for s, j in zip(seqs, _repeat_offsets(seqs))]
            drawn = [n + len(d) for n, d in zip(drawn, drafted)]
        bitmask = None
        if any(s.options.guide is not None for s in seqs):
            for s in seqs:
                if s.options.guide is not None and s.guide_matcher is None:
                    s.guide_matcher = new_matcher(s.options.guide, s.output_token_ids)
            bitmask = allowed_bitmask([s.guide_matcher for s in seqs], self.model_config.vocab_size)
        options = [s.options for s in seqs]
        draws = self.sampler.sample(
            logits,
            options,
            drawn,
            [
                _with(s.all_token_ids, d) if o.repetition_penalty != 1.0 else _NO_IDS
                for s, o, d in zip(seqs, options, drafted)
            ],
            [_with(s.output_token_ids, d) for s, d in zip(seqs, drafted)],
            [
                banned_ids(o, _with(s.all_token_ids, d) if o.needs_token_ids else _NO_IDS, n)
                if o.may_ban_tokens
                else _NONE_BANNED
                for s, o, n, d in zip(seqs, options, drawn, drafted)
            ],
            bitmask,
            greedy,
        )
        self.tp.broadcast(draws.token_ids)
        self._last_draws = ({seq: row for row, seq in enumerate(seqs)}, draws.token_ids)
        return seqs, draws, prompt_logprobs

    @torch.inference_mode()
    def follow(self, step: PackedStep) -> None:
        """A follower rank runs rank 0's step: the same forward, then the ids rank 0 drew."""
        self.bind_device()
        with batch_invariant(self.config.deterministic):
            _, logits, _ = self._forward(step, self.graphs, self._follower_tokens)
        if logits is None:
            self._follower_tokens = None
            return
        tokens = torch.empty(len(step.sample_indices), dtype=torch.int64, device=self.device)
        self._follower_tokens = self.tp.broadcast(tokens)

    def _forward(
        self, step: PackedStep, graphs: DecodeGraphs | None, last_tokens: torch.Tensor | None
    ) -> tuple[torch.Tensor | None, torch.Tensor | None, GreedyDraws | None]:
        """The step's hidden states (None from a decode graph), the logits of its sampled rows (None
        when no row samples: a prefill chunk) and, from a decode graph, their greedy draws."""
        if step.graph_size is not None:
            graphs.capture()  # first decode step (with adapters) after start or after new weights / a new pool
        inputs = self.inputs.upload(step)
        if inputs.pending_rows.numel():
            tokens = last_tokens.index_select(0, inputs.pending_sources).to(torch.int32)
            inputs.input_ids.index_copy_(0, inputs.pending_rows.long(), tokens)
        if step.graph_size is not None:
            rows = len(step.sample_indices)
            logits, greedy = graphs.run(step.graph_size)
            if rows < step.graph_size:  # padding rows past the batch
                logits, greedy = logits[:rows], tuple(t[:rows] for t in greedy)
            return None, logits, greedy
        lora = LoRABatch(self.lora_pool, inputs.lora_meta) if inputs.lora_meta is not None else None
        hidden = self.model(inputs.input_ids, inputs.positions, inputs.meta, self.kv_cache, lora)
        if not step.sample_indices:
            return hidden, None, None
        return hidden, self.model.compute_logits(hidden[inputs.sample_rows]), None
