"""Shared fixtures: tiny checkpoints, the transformers oracle, local clusters."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

# Model files for every test session live in one throwaway TANDEM_HOME; child
# processes inherit it, so each model is written (or converted) once per session.
_HOME = Path(
    os.environ.setdefault(
        "TANDEM_HOME", str(Path(__file__).resolve().parent.parent / ".tandem" / "test-home")
    )
)


@pytest.fixture(scope="session")
def model_dirs() -> dict[str, Path]:
    from tandem.engine.checkpoints import tiny_model_dir, write_tiny_checkpoint

    dirs = {"llama": tiny_model_dir()}
    for model_type in ("qwen2", "qwen3"):
        target = _HOME / "models" / f"tiny-{model_type}-test-v2"
        if not (target / "config.json").is_file():
            write_tiny_checkpoint(target, model_type, seed=1)
        dirs[model_type] = target
    return dirs


class Oracle:
    """transformers' implementation of a checkpoint: the reference for greedy tokens."""

    def __init__(self, model_dir: Path):
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.torch = torch
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.tokenizer = AutoTokenizer.from_pretrained(model_dir)
        self.eos = self.model.generation_config.eos_token_id

    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
        """Greedy continuation, cut after the first EOS (which it includes), like tandem's output."""
        with self.torch.no_grad():
            out = self.model.generate(
                self.torch.tensor([prompt_ids]),
                attention_mask=self.torch.ones(1, len(prompt_ids), dtype=self.torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                pad_token_id=self.eos,
            )
        new = out[0, len(prompt_ids) :].tolist()
        eos = {self.eos} if isinstance(self.eos, int) else set(self.eos)
        for i, t in enumerate(new):
            if t in eos:
                return new[: i + 1]
        return new


_ORACLES: dict[Path, Oracle] = {}


@pytest.fixture(scope="session")
def oracle():
    def get(model_dir: Path) -> Oracle:
        if model_dir not in _ORACLES:
            _ORACLES[model_dir] = Oracle(model_dir)
        return _ORACLES[model_dir]

    return get


def run_to_completion(engine, prompts: dict[str, list[int]], options) -> dict[str, list[int]]:
    """Adds every prompt (options: one SamplingOptions or one per request id), steps the engine
    until all finish, and returns each request's generated tokens."""
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, options[rid] if isinstance(options, dict) else options)
    outputs = {rid: [] for rid in prompts}
    for _ in range(100_000):
        if not engine.num_unfinished:
            break
        for out in engine.step():
            outputs[out.request_id].extend(out.new_token_ids)
    assert engine.num_unfinished == 0
    return outputs


async def abort_while_streaming(owner, aborts) -> tuple:
    """Streams a long request through `owner` (an AsyncLLM) and, once it has produced a few
    tokens, awaits each of `aborts` (callables of the request id: other clients' abort calls) in
    order: (the last output, their answers)."""
    from tandem.client import SamplingParams

    result = owner.generate_async(
        [1, 5, 9], SamplingParams(max_tokens=1500, ignore_eos=True), streaming=True
    )
    verdicts = []
    async for out in result:
        if not verdicts and len(out.outputs[0].token_ids) >= 4:
            for abort in aborts:
                verdicts.append(await abort(result.request_id))
    return out, verdicts


def wait_all_blocks_free(llm, timeout: float = 10.0) -> dict:
    """Polls every worker until its free blocks equal its total; returns the last capacity per worker."""
    deadline = time.monotonic() + timeout
    info = llm._server_info()
    while True:
        caps = {w.worker_id: llm.get_kv_cache_capacity(w.worker_id) for w in info.workers}
        if (
            all(c["numFreeBlocks"] == c["maxNumBlocks"] for c in caps.values())
            or time.monotonic() > deadline
        ):
            return caps
        time.sleep(0.05)


def assert_all_blocks_free(llm) -> None:
    caps = wait_all_blocks_free(llm)
    leaked = {w: c for w, c in caps.items() if c["numFreeBlocks"] != c["maxNumBlocks"]}
    assert not leaked, f"KV blocks not returned: {leaked}"


@pytest.fixture
def no_leaked_worker_blocks(cluster):
    """After the test: every worker of the module's `cluster` (a LocalCluster) holds no KV block,
    asked on the worker itself (a router's view of a worker may lag)."""
    yield
    from tandem.client import LLM

    for worker in cluster.workers:
        with LLM(worker.address, **cluster.worker_client_kwargs()) as llm:
            assert_all_blocks_free(llm)


class ImmediateEngineThread:
    """Stands in for EngineCore's queue in engine-level tests: applies a lease keeper's FreeBlocks
    at once, on the calling thread."""

    def __init__(self, engine):
        self.engine = engine
        self.facts = engine.facts()

    def send(self, command) -> None:
        self.engine.free_blocks(command.block_ids)


def tiny_split_cluster(model_dirs, num_blocks: int = 64):
    """Router + prefill + decode + an aggregated worker (workers[2]) serving the tiny Llama."""
    from tandem.testing.cluster import LocalCluster

    return LocalCluster(
        roles=["prefill", "decode", "both"],
        engine_args=[
            "--model",
            str(model_dirs["llama"]),
            "--num-blocks",
            str(num_blocks),
            "--block-size",
            "8",
        ],
    )


def split_or_aggregated_client(cluster, which: str):
    """A client of the router (which="split": it splits every request) or of the aggregated worker."""
    from tandem.client import LLM
    from tandem.testing.cluster import client_kwargs_for

    address = cluster.address if which == "split" else cluster.workers[2].address
    return LLM(address, **client_kwargs_for(address))


@pytest.fixture(scope="module")
def tiny_cluster(model_dirs):
    """tiny_split_cluster, one per test module."""
    with tiny_split_cluster(model_dirs) as cluster:
        yield cluster


@pytest.fixture(scope="module", params=["split", "aggregated"])
def tiny_llm(tiny_cluster, request):
    """Each test of the module runs through the router's split and on the aggregated worker."""
    with split_or_aggregated_client(tiny_cluster, request.param) as client:
        yield client
