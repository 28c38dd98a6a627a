"""The L2 weight-prefetch plan (weight_prefetch.py): parsed with clear errors, active only while a
small decode graph is being captured on CUDA, and outputs unchanged by it. The prefetch kernel
issues PTX the interpreter cannot run; test_gpu_engine.py checks graphs with it on a GPU and
bench/l2_prefetch.py times it."""
from __future__ import annotations

import pytest
import torch

from tandem.engine.weight_prefetch import DEFAULT_MAX_ROWS, PrefetchPlan, WeightPrefetcher


def test_plans_parse_names_fractions_and_mode():
    plan = PrefetchPlan.parse("o_proj=1, gate_up_proj=0.25,down_proj=0,mode=bulk", max_rows=4)
    assert plan.fractions == {"o_proj": 1.0, "gate_up_proj": 0.25}  # a zero fraction is no prefetch
    assert (plan.mode, plan.max_rows) == ("bulk", 4)
    for off in ("", "off", "none", "0"):
        assert PrefetchPlan.parse(off).fractions == {}
    assert PrefetchPlan.parse("qkv_proj=0.5").mode == "line"


@pytest.mark.parametrize("text, message", [
    ("o_proj", "is not name=value"),
    ("lm_head=1", "expected one of"),
    ("o_proj=half", "is not a number"),
    ("o_proj=1.5", "must be in [0, 1]"),
    ("o_proj=-0.1", "must be in [0, 1]"),
    ("mode=fast", "expected line or bulk"),
])
def test_bad_plans_say_what_to_fix(text, message):
    with pytest.raises(ValueError, match=message.replace("[", r"\[").replace("]", r"\]")):
        PrefetchPlan.parse(text)


def test_plan_from_env(monkeypatch):
    monkeypatch.setenv("TANDEM_L2_PREFETCH", "down_proj=0.5")
    monkeypatch.setenv("TANDEM_L2_PREFETCH_ROWS", "2")
    plan = PrefetchPlan.from_env()
    assert plan.fractions == {"down_proj": 0.5} and plan.max_rows == 2
    monkeypatch.setenv("TANDEM_L2_PREFETCH_ROWS", "many")
    with pytest.raises(ValueError, match="TANDEM_L2_PREFETCH_ROWS='many' is not an integer"):
        PrefetchPlan.from_env()
    monkeypatch.delenv("TANDEM_L2_PREFETCH_ROWS")
    assert PrefetchPlan.from_env().max_rows == DEFAULT_MAX_ROWS


def test_a_bad_plan_stops_the_model_at_construction(monkeypatch, model_dirs):
    from tandem.engine.config import EngineConfig
    from tandem.engine.llm_engine import LLMEngine
    monkeypatch.setenv("TANDEM_L2_PREFETCH", "o_proj=2")
    with pytest.raises(ValueError, match="TANDEM_L2_PREFETCH o_proj=2.0 must be in"):
        LLMEngine(EngineConfig(str(model_dirs["llama"]), block_size=16, num_blocks=64))


def test_the_prefetcher_stays_off_outside_a_cuda_capture():
    prefetcher = WeightPrefetcher(PrefetchPlan.parse("o_proj=1,qkv_proj=1"))
    prefetcher.begin(1, torch.device("cpu"))
    prefetcher.fetch("o_proj", torch.zeros(8, 8))  # would raise in the CUDA launcher if it ran
    prefetcher.end()
    assert not prefetcher._active and not prefetcher._forked


def test_the_launcher_rejects_what_it_cannot_prefetch():
    prefetch_triton = pytest.importorskip("tandem.kernels.prefetch_triton")
    with pytest.raises(ValueError, match="needs a 2-D CUDA tensor"):
        prefetch_triton.prefetch_l2(torch.zeros(4, 4))
