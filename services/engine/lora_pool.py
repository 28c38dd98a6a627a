"""The adapters on the device: fixed pool tensors with one slot per adapter, and what a step's
model needs to apply them (LoRABatch).

Per projection kind (qkv_proj, o_proj, gate_up_proj, down_proj) the pool holds
A [layers, slots, slices * R, in] and B [layers, slots, out, R], allocated once, on the
first adapter (a worker that never sees one spends nothing). An adapter is copied into a
slot when a sequence that uses it is admitted and no slot holds it; it stays there after
its sequences end, and the least recently used slot that no running sequence pins is the
one a new adapter takes. The tensors never move, so a decode CUDA graph captured over them
serves every adapter that ever lands in them.

The bookkeeping (which adapter is in which slot, pins, recency) is the engine thread's,
like the block manager's; the copies run on the engine's stream, after any step already
queued there, so a step in flight reads a slot's old adapter to the end.
"""

from __future__ import annotations

import logging
from collections import OrderedDict

import torch

from tandem.engine.lora_adapter import LoRAAdapter, LoRAModule
from tandem.kernels import dispatch as kernels
from tandem.kernels.lora import LoRAMetadata

log = logging.getLogger("tandem.lora")


class LoRAPool:
    def __init__(
        self,
        modules: dict[str, LoRAModule],
        num_layers: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device,
    ):
        if num_slots < 1 or max_rank < 1:
            raise ValueError(
                f"a LoRA pool needs slots and a rank >= 1, got {num_slots} and {max_rank}"
            )
        self.modules = modules
        self.num_layers = num_layers
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.dtype = dtype
        self.device = device
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self._adapters: list[LoRAAdapter | None] = [None] * num_slots
        self._slot_of: dict[tuple[int, str], int] = {}  # LoRAAdapter.key -> slot
        self._pins = [0] * num_slots
        self._idle: OrderedDict[int, None] = (
            OrderedDict()
        )  # resident, unpinned slots, least recently used first
        self.num_loads = 0
        self.num_evictions = 0

    @property
    def is_allocated(self) -> bool:
        return bool(self.a)

    @property
    def nbytes(self) -> int:
        return sum(
            t.numel() * t.element_size() for t in list(self.a.values()) + list(self.b.values())
        )

    @property
    def resident(self) -> list[LoRAAdapter]:
        """The adapters in the pool now, by slot."""
        return [a for a in self._adapters if a is not None]

    def num_pins(self, slot: int) -> int:
        return self._pins[slot]

    def acquire(self, adapter: LoRAAdapter) -> int | None:
        """Pins the adapter's slot, loading it first if it is not resident (evicting the least
        recently used unpinned adapter when no slot is empty). None when every slot is pinned."""
        slot = self._slot_of.get(adapter.key)
        if slot is None:
            slot = self._take_slot()
            if slot is None:
                return None
            self._install(adapter, slot)
        self._pins[slot] += 1
        self._idle.pop(slot, None)
        return slot

    def release(self, slot: int) -> None:
        if self._pins[slot] <= 0:
            raise RuntimeError(f"LoRA slot {slot} released more often than acquired")
        self._pins[slot] -= 1
        if self._pins[slot] == 0:
            self._idle[slot] = None  # most recently used

    def _take_slot(self) -> int | None:
        for slot, adapter in enumerate(self._adapters):
            if adapter is None:
                return slot
        if not self._idle:
            return None
        slot, _ = self._idle.popitem(last=False)
        evicted = self._adapters[slot]
        del self._slot_of[evicted.key]
        self._adapters[slot] = None
        self.num_evictions += 1
        log.info("evicted %s from LoRA slot %d", evicted.describe(), slot)
        return slot

    def _allocate(self) -> None:
        for kind, m in self.modules.items():
            self.a[kind] = torch.zeros(
                self.num_layers,
                self.num_slots,
                m.num_slices * self.max_rank,
                m.in_features,
                dtype=self.dtype,
                device=self.device,
            )
            self.b[kind] = torch.zeros(
                self.num_layers,
                self.num_slots,
                m.slice_bounds[-1],
                self.max_rank,
                dtype=self.dtype,
                device=self.device,
            )
        log.info(
            "allocated the LoRA pool: %d slots of rank %d, %.1f MB",
            self.num_slots,
            self.max_rank,
            self.nbytes / 1e6,
        )

    def _install(self, adapter: LoRAAdapter, slot: int) -> None:
        if not self.is_allocated:
            self._allocate()
        for kind in self.modules:
            if kind in adapter.weights:
                a, b = adapter.weights[kind]
                self.a[kind][:, slot].copy_(a)
                self.b[kind][:, slot].copy_(b)
            else:  # a projection this adapter leaves alone: a zero A adds nothing
                self.a[kind][:, slot].zero_()
                self.b[kind][:, slot].zero_()
        self._adapters[slot] = adapter
        self._slot_of[adapter.key] = slot
        self.num_loads += 1

    def free_tensors(self) -> None:
        """Drops the device tensors and every resident adapter (release of the model's memory);
        the next adapter allocates them again."""
        if any(self._pins):
            raise RuntimeError("LoRA slots are pinned by running sequences")
        self.a.clear()
        self.b.clear()
        self._adapters = [None] * self.num_slots
        self._slot_of.clear()
        self._idle.clear()


class LoRABatch:
    """A step's adapters as the model applies them: y += LoRA(x) of each token's slot."""

    def __init__(self, pool: LoRAPool, meta: LoRAMetadata):
        self.pool = pool
        self.meta = meta

    def apply(self, layer: int, kind: str, x: torch.Tensor, y: torch.Tensor) -> None:
        """y [T, out] (the base projection of x [T, in]) += the LoRA of each token's adapter, in place.
        A kind the pool does not hold (the MLPs of a MoE model: lora_adapter.lora_modules) adds nothing."""
        if kind not in self.pool.modules:
            return
        buf = kernels.lora_shrink(x, self.pool.a[kind][layer], self.meta)
        kernels.lora_expand(
            buf, self.pool.b[kind][layer], self.meta, y, self.pool.modules[kind].slice_bounds
        )
