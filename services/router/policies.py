"""How the router picks among the ready workers of one role: round robin, least load, KV-aware
(prefix overlap against load, as Dynamo's KV router), or conversation affinity. One policy per
role (--routing prefill=kv,decode=least-load); SchedulingParams.attention_dp_rank, where a
request sets it, names the worker itself."""

from __future__ import annotations

import enum
import itertools
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from tandem.common.roles import Role
from tandem.router.kv_index import KvIndex
from tandem.router.prefix_source import PrefixPullCost, choose_source
from tandem.v1 import llm_pb2, worker_pb2

if TYPE_CHECKING:
    from tandem.router.workers import WorkerHandle

# What a worker that does not hold a request's LoRA adapter costs, in requests in flight: it
# loads the adapter first (a disk read, a copy to the device, maybe an eviction), so a holder is
# preferred unless it is this much busier.
ADAPTER_MISS_COST = 4
# Conversations the affinity policy remembers (least recently routed forgotten first).
MAX_CONVERSATIONS = 1 << 16


class Policy(enum.Enum):
    ROUND_ROBIN = "round-robin"
    LEAST_LOAD = "least-load"
    KV = "kv"
    CONVERSATION = "conversation"


def parse_routing(spec: str) -> dict[Role, Policy]:
    """'prefill=kv,decode=least-load' (or one policy for every role: 'kv') -> role -> policy."""
    names = ", ".join(p.value for p in Policy)
    spec = spec.strip()
    if spec and "=" not in spec:
        try:
            return dict.fromkeys((Role.PREFILL, Role.DECODE, Role.BOTH), Policy(spec))
        except ValueError:
            raise ValueError(f"unknown routing policy {spec!r}; policies: {names}") from None
    routing = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        role_name, _, policy_name = part.partition("=")
        try:
            role = Role.parse(role_name.strip())
            policy = Policy(policy_name.strip())
        except ValueError:
            raise ValueError(
                f"routing {part!r} is not ROLE=POLICY with ROLE prefill, decode or both and POLICY "
                f"one of {names}"
            ) from None
        routing[role] = policy
    return routing


@dataclass
class Placement:
    """What the pick policies know of one request: its prompt for the KV index, its adapter, its
    conversation, its scheduling hint. Made once per request; the prompt's hashes once too."""

    token_ids: list[int] = field(default_factory=list)
    cache_salt: str | None = None
    adapter_id: int | None = None
    conversation_id: str = ""
    dp_rank: int | None = None
    dp_relax: bool = False
    _hashes: list[int] | None = None
    # address -> blocks of the prompt it holds, from the last KV-aware pick.
    overlap: dict[str, int] = field(default_factory=dict)
    # (address, the peer it may pull the prompt's prefix from) of the last pick where the cost
    # model said a pull wins (prefix_source.py); None: no pull.
    prefix_source: tuple[str, worker_pb2.PrefixSource] | None = None

    def prefix_source_for(self, address: str) -> worker_pb2.PrefixSource | None:
        source = self.prefix_source
        return source[1] if source is not None and source[0] == address else None

    @classmethod
    def of(cls, request: llm_pb2.GenerateRequest) -> Placement:
        prompt = request.prompt
        kind = prompt.WhichOneof("kind")
        ids = (
            list(prompt.token_ids.ids)
            if kind == "token_ids"
            else list(prompt.preprocessed.prompt_token_ids)
            if kind == "preprocessed"
            else []
        )
        scheduling = request.scheduling_params
        return cls(
            ids,
            request.cache_salt if request.HasField("cache_salt") else None,
            request.lora_request.lora_int_id if request.lora_request.lora_name else None,
            request.conversation_params.conversation_id,
            scheduling.attention_dp_rank if scheduling.HasField("attention_dp_rank") else None,
            scheduling.attention_dp_relax,
        )

    def hashes(self, index: KvIndex) -> list[int]:
        if self._hashes is None or not self._hashes and index.block_size:
            self._hashes = index.hashes(self.token_ids, self.cache_salt, self.adapter_id)
        return self._hashes

    def num_blocks(self, block_size: int | None) -> int:
        return -(-len(self.token_ids) // block_size) if block_size else 0

    def uncached_tokens(self, address: str, block_size: int | None) -> int:
        """The prompt tokens the worker at address computes, by the last KV-aware pick's view."""
        return max(0, len(self.token_ids) - self.overlap.get(address, 0) * (block_size or 0))


NO_PLACEMENT = Placement()


class Picker:
    """Chooses one of a role's candidates by that role's policy."""

    def __init__(
        self,
        routing: dict[Role, Policy],
        index: KvIndex,
        overlap_weight: float = 1.0,
        default: Policy = Policy.KV,
        prefix_cost: PrefixPullCost | None = None,
    ):
        """prefix_cost: the cost model of cross-worker prefix pulls (None: none suggested)."""
        self.prefix_cost = prefix_cost
        self.routing = routing
        self.default = default
        self.index = index
        self.overlap_weight = overlap_weight
        # One rotation per role: a split picks a prefill then a decode worker, and one shared
        # counter would hand each role the same parity, so the same worker, every time.
        self._rr: dict[Role | None, itertools.count] = {}
        # conversation id -> the address of the worker of each role it last ran on.
        self._conversations: OrderedDict[tuple[str, Role], str] = OrderedDict()

    def policy(self, role: Role | None) -> Policy:
        return self.routing.get(role, self.default) if role is not None else Policy.LEAST_LOAD

    def choose(
        self, role: Role | None, candidates: list[WorkerHandle], placement: Placement, now: float
    ) -> WorkerHandle:
        """The role's pick; for a worker that computes prompts, the peer its prefix may be pulled
        from too (placement.prefix_source), where prefix pulls are on and the cost model says so."""
        if (
            self.prefix_cost is None
            or role not in (Role.PREFILL, Role.BOTH)
            or not placement.token_ids  # (NO_PLACEMENT, shared, is never written)
        ):
            return self._choose(role, candidates, placement, now)
        # What each holds before the pick: a KV-aware pick predicts the prompt on its choice.
        before = self.index.overlaps(placement.hashes(self.index), [w.address for w in candidates])
        chosen = self._choose(role, candidates, placement, now)
        source = choose_source(self.prefix_cost, self.index, placement, chosen, candidates, before)
        placement.prefix_source = (chosen.address, source) if source is not None else None
        return chosen

    def _choose(
        self, role: Role | None, candidates: list[WorkerHandle], placement: Placement, now: float
    ) -> WorkerHandle:
        # Rotated so that ties go round robin and min() stays stable.
        start = next(self._rr.setdefault(role, itertools.count())) % len(candidates)
        candidates = candidates[start:] + candidates[:start]
        dp = self._by_dp_rank(candidates, placement)
        if dp is not None:
            return dp
        policy = self.policy(role)
        if policy is Policy.ROUND_ROBIN:
            return candidates[0]
        if policy is Policy.KV:
            return self._by_kv(candidates, placement, now)
        if policy is Policy.CONVERSATION and placement.conversation_id:
            return self._by_conversation(role, candidates, placement, now)
        return min(candidates, key=lambda w: self._load(w, placement, now))

    @staticmethod
    def _by_dp_rank(candidates: list[WorkerHandle], placement: Placement) -> WorkerHandle | None:
        """attention_dp_rank names the worker (tandem's data-parallel ranks are its workers), by
        rank in address order among the role's ready candidates; relaxed, it is only a preference."""
        if placement.dp_rank is None:
            return None
        ranked = sorted(candidates, key=lambda w: w.address)
        if 0 <= placement.dp_rank < len(ranked):
            return ranked[placement.dp_rank]
        if placement.dp_relax:
            return None
        raise ValueError(
            f"scheduling_params.attention_dp_rank {placement.dp_rank} is not a ready worker's rank "
            f"(0..{len(ranked) - 1}); set attention_dp_relax to let the router choose"
        )

    @staticmethod
    def _load(w: WorkerHandle, placement: Placement, now: float) -> int:
        miss = placement.adapter_id is not None and not w.holds(placement.adapter_id, now)
        return w.in_flight + (ADAPTER_MISS_COST if miss else 0)

    def _by_kv(
        self, candidates: list[WorkerHandle], placement: Placement, now: float
    ) -> WorkerHandle:
        """Dynamo's cost: overlap_weight * prefill blocks (the prompt's uncached blocks plus the
        prefill work queued there) + decode blocks (the KV of the requests decoding there; a
        prefill-only worker decodes nothing: its load is the prefill work alone)."""
        index = self.index
        block_size = index.block_size
        hashes = placement.hashes(index)
        overlap = index.overlaps(hashes, [w.address for w in candidates])
        num_blocks = placement.num_blocks(block_size)

        def cost(w: WorkerHandle) -> float:
            uncached = num_blocks - overlap[w.address]
            queued = -(-w.prefill_load // block_size) if block_size else w.prefill_load
            decode = w.active_blocks + w.in_flight if w.can_decode else 0
            if w.num_free_blocks is not None and uncached > w.num_free_blocks:
                decode += uncached  # it would preempt (or wait) to find room
            if placement.adapter_id is not None and not w.holds(placement.adapter_id, now):
                decode += ADAPTER_MISS_COST * (num_blocks + 1)
            return self.overlap_weight * (uncached + queued) + decode

        chosen = min(candidates, key=cost)
        placement.overlap = overlap
        index.predict(chosen.address, hashes)
        return chosen

    def _by_conversation(
        self, role: Role | None, candidates: list[WorkerHandle], placement: Placement, now: float
    ) -> WorkerHandle:
        """The worker the conversation last ran on (its KV is there), while it is a candidate."""
        key = (placement.conversation_id, role)
        address = self._conversations.get(key)
        chosen = next((w for w in candidates if w.address == address), None)
        if chosen is None:
            chosen = min(candidates, key=lambda w: self._load(w, placement, now))
        self._conversations[key] = chosen.address
        self._conversations.move_to_end(key)
        while len(self._conversations) > MAX_CONVERSATIONS:
            self._conversations.popitem(last=False)
        return chosen


@dataclass(frozen=True)
class ConditionalDisagg:
    """Whether a request the router could split runs split or whole on a decode worker, as
    TensorRT-LLM's disaggregated router decides: a short uncached prompt is cheaper to compute
    where it decodes than to hand off, and a saturated prefill pool would only make it wait."""

    # Split only when the uncached part of the prompt (on the best decode worker) is this long.
    min_uncached_tokens: int = 0
    # Run whole while every prefill worker has this many prompt tokens queued (0: never).
    prefill_queue_tokens: int = 0

    def decide(
        self,
        placement: Placement,
        index: KvIndex,
        prefills: list[WorkerHandle],
        decodes: list[WorkerHandle],
    ) -> tuple[bool, str]:
        """(split, reason)."""
        if self.min_uncached_tokens:
            overlap = index.overlaps(placement.hashes(index), [w.address for w in decodes])
            cached = max(overlap.values(), default=0) * (index.block_size or 0)
            if len(placement.token_ids) - cached < self.min_uncached_tokens:
                return False, "short_uncached_prompt"
        if self.prefill_queue_tokens and all(
            w.prefill_load >= self.prefill_queue_tokens for w in prefills
        ):
            return False, "prefill_saturated"
        return True, "long_uncached_prompt" if self.min_uncached_tokens else "always_split"
