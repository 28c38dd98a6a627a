"""Speculative decoding's draft_model method: a smaller model with the target's vocabulary
proposes the drafts, greedily, k tokens a step for every drafting sequence at once.

The draft runs in an engine of its own (engine/llm_engine.py: its own paged KV pool, the same
block size, prefix caching on, no speculation) on the target's device and engine thread. Each
step a drafting sequence's tokens so far go to the draft engine as a request for k greedy tokens:
its prefix cache holds every full block the sequence had at its last step, so only the tokens
since the last full block and the k draft positions are computed; a rejected draft's KV is left
behind in a block that no later prompt hashes to, and ages out of the cache as any other block.
The drafts' correctness does not rest on the draft model: the target verifies them (its own draw
at each drafted position is kept, engine/speculative.py), so greedy and seeded outputs are those
of plain decoding whatever the draft proposes; a better draft model only gets more accepted.

A generation_only request (a handoff from a prefill worker) brings the target's KV, not the
draft's: the draft computes the prompt itself at the sequence's first step (its prefix cache
then serves the later ones). A tensor-parallel target drafts on its first rank's device, the
draft model unsharded.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path

from tandem.engine.model_config import ModelConfig
from tandem.engine.sampling_options import SamplingOptions


def check_draft_model(model: str) -> None:
    """Refuses, at start, a draft `model` that is not a checkpoint directory."""
    if not isinstance(model, str) or not model:
        raise ValueError(
            "--speculative-config: method 'draft_model' needs \"model\": the draft checkpoint's "
            "directory (a smaller model with the target's tokenizer)"
        )
    if not (Path(model) / "config.json").is_file():
        raise ValueError(
            f"--speculative-config: draft model {model!r} has no config.json: give a Hugging Face "
            "checkpoint directory"
        )


class DraftModelProposer:
    """Drafts from a draft model (see the module's docstring). engine_factory builds an engine from
    an EngineConfig (LLMEngine; passed in, since that module imports this one)."""

    def __init__(
        self,
        spec,
        target_config,
        target_model: ModelConfig,
        num_blocks: int,
        engine_factory: Callable,
    ):
        """num_blocks: the draft's KV pool, in blocks of the target's size (the target's count:
        the draft holds as many tokens as the target)."""
        self.config = spec
        draft_config = dataclasses.replace(
            target_config,
            model_dir=spec.model,
            speculative_config="",
            num_blocks=num_blocks,
            host_kv_cache_gb=0.0,
            max_loras=0,
            tensor_parallel_size=1,
            overlap_scheduling=False,
            enable_prefix_caching=True,
            quantization="auto",
            kv_cache_dtype="auto",
        )
        self.engine = engine_factory(draft_config)
        draft_vocab = self.engine.model_config.vocab_size
        if draft_vocab != target_model.vocab_size:
            self.engine.close()
            raise ValueError(
                f"--speculative-config: the draft model {spec.model!r} has a vocabulary of "
                f"{draft_vocab} tokens, the target {target_model.vocab_size}: a draft model "
                "must share the target's tokenizer"
            )
        self.max_model_len = self.engine.max_model_len

    def propose_once(self, wants: list[tuple]) -> dict:
        """Drafts for sequences that draft once (handed-off context phases): as propose_all."""
        return self.propose_all(wants)

    def propose_all(self, wants: list[tuple]) -> dict:
        """wants: (sequence, k) pairs. Returns each sequence's drafts (at most k tokens; none for a
        sequence longer than the draft model's context)."""
        engine = self.engine
        asked = {}
        for seq, k in wants:
            num = seq.num_tokens
            if num + k >= self.max_model_len:
                continue
            draft_id = f"draft:{seq.request_id}"
            engine.add_request(
                draft_id,
                seq.token_slice(0, num),
                SamplingOptions(max_tokens=k, ignore_eos=True),
                cache_salt=seq.cache_salt,
            )
            asked[draft_id] = seq
        drafts = {seq: [] for seq in asked.values()}
        try:
            while engine.num_unfinished:
                for out in engine.step():
                    drafts[asked[out.request_id]] += out.new_token_ids
        except BaseException:
            for draft_id in asked:
                engine.abort_request(draft_id)
            raise
        finally:
            engine.block_manager.drain_events()  # nobody subscribes to the draft's cache
        return drafts

    def finished(self, seq) -> None:
        """Nothing to keep: the draft engine's prefix cache holds what later requests can reuse."""

    def reset(self) -> None:
        """Forgets earlier requests' KV (the worker's warm-up is none of its clients')."""
        self.engine.block_manager.reset_prefix_cache()

    def release_memory(self, tags: list[str]) -> None:
        self.engine.release_memory(tags)

    def resume_memory(self, tags: list[str]) -> None:
        self.engine.resume_memory(tags)

    def close(self) -> None:
        self.engine.close()
