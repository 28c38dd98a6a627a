"""The trainer's side of update_weights over NIXL, for a trainer on another host than the
workers (no disk, no shared memory): its tensors are registered with a NIXL agent of its own,
and every worker READs them (one-sided: the trainer's process does nothing during the sync).

    source = NixlWeightSource(model.named_parameters())   # once: registers the tensors
    await llm.pause_generation()
    await llm.update_weights(source.weights)               # each step, the same message ...
    await llm.update_weights(None)
    await llm.resume_generation()
    source.close()                                         # after the last sync

An optimizer that updates the parameters in place keeps their addresses, so one registration
serves every step (one whose storage moved, e.g. by share_memory_(), is refused here). Keep the
tensors alive and unchanged while update_weights runs. Needs torch
and NIXL (the UCX backend); CPU tensors go as DRAM, CUDA ones as VRAM (one kind per source).
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Iterable

from tandem.v1 import llm_pb2

_source_ids = itertools.count()


class NixlWeightSource:
    def __init__(self, named_tensors: Iterable, agent_name: str | None = None):
        """named_tensors: (HF name, tensor) pairs, each contiguous, of one kind of memory."""
        from nixl._api import nixl_agent, nixl_agent_config

        from tandem.kvtransfer.ucx_env import apply_defaults as apply_ucx_defaults

        named = [(name, tensor.detach()) for name, tensor in named_tensors]
        if not named:
            raise ValueError("NixlWeightSource needs at least one (name, tensor)")
        kinds = {t.device.type for _, t in named}
        if not kinds <= {"cpu", "cuda"} or len(kinds) > 1:
            raise ValueError(f"tensors must all be on the CPU or all on GPUs, got {sorted(kinds)}")
        not_contiguous = [name for name, t in named if not t.is_contiguous()]
        if not_contiguous:
            raise ValueError(f"tensors must be contiguous: {not_contiguous[:4]}")
        self._tensors = [t for _, t in named]  # keeps the registered memory alive
        name = agent_name or f"trainer-{socket.gethostname()}-{os.getpid()}-{next(_source_ids)}"
        apply_ucx_defaults("VRAM" if "cuda" in kinds else "DRAM")
        self._agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
        self._registration = self._agent.register_memory(self._tensors)
        self._weights = llm_pb2.NixlWeights(
            agent_name=name,
            agent_metadata=self._agent.get_agent_metadata(),  # after registering: carries keys
            memory_type="VRAM" if "cuda" in kinds else "DRAM",
            tensors=[
                llm_pb2.NixlTensor(
                    name=n,
                    address=t.data_ptr(),
                    num_bytes=t.numel() * t.element_size(),
                    device_id=(t.device.index or 0) if t.is_cuda else 0,
                    dtype=str(t.dtype).removeprefix("torch."),
                    shape=list(t.shape),
                )
                for n, t in named
            ],
        )

    @property
    def weights(self) -> llm_pb2.NixlWeights:
        """What update_weights takes; refused once a tensor's memory moved since registering."""
        if self._registration is None:
            raise ValueError("this NixlWeightSource is closed")
        moved = [
            t.name
            for t, tensor in zip(self._weights.tensors, self._tensors)
            if tensor.data_ptr() != t.address
        ]
        if moved:
            raise ValueError(
                f"{len(moved)} tensors moved since they were registered (their storage was "
                f"replaced: share_memory_(), IPC handles of them, .to(), a new parameter): "
                f"{moved[:4]}; register them again (a new NixlWeightSource)"
            )
        return self._weights

    def close(self) -> None:
        if self._registration is not None:
            self._agent.deregister_memory(self._registration)
            self._registration = None

    def __enter__(self) -> NixlWeightSource:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()
