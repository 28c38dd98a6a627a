"""Random-weight PEFT LoRA adapters for the tests, written by peft itself, and transformers + peft
as the oracle of a checkpoint under one adapter."""

from __future__ import annotations

from pathlib import Path

import torch

ALL_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(
    model_dir: Path,
    out_dir: Path,
    seed: int,
    rank: int = 8,
    alpha: float = 16,
    targets=ALL_MODULES,
    std: float | None = None,
    base=None,
    **lora_kwargs,
) -> Path:
    """A PEFT LoRA directory for model_dir with random A and B (init_lora_weights=False), written
    once per out_dir. std: draw both factors from N(0, std) instead (peft's default init makes
    deltas too large for a real model, too small to change a tiny one's greedy tokens). base: the
    model already loaded (it is copied, not changed)."""
    if (out_dir / "adapter_model.safetensors").is_file():
        return out_dir
    import copy

    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    base = (
        copy.deepcopy(base)
        if base is not None
        else AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    )
    model = get_peft_model(
        base,
        LoraConfig(
            r=rank,
            lora_alpha=alpha,
            target_modules=list(targets),
            init_lora_weights=False,
            **lora_kwargs,
        ),
    )
    if std is not None:
        with torch.no_grad():
            for name, param in model.named_parameters():
                if "lora_" in name:
                    param.normal_(0.0, std)
    model.save_pretrained(out_dir)
    return out_dir


class PeftOracle:
    """transformers' model of a checkpoint, greedy under one adapter at a time (or none)."""

    def __init__(self, model_dir: Path):
        from transformers import AutoModelForCausalLM

        self.base = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
        self.eos = self.base.generation_config.eos_token_id
        self._peft = None

    def greedy(
        self, prompt_ids: list[int], max_new_tokens: int, adapter: Path | None = None
    ) -> list[int]:
        """Greedy continuation under `adapter` (a PEFT directory), cut after the first EOS."""
        from peft import PeftModel

        model = self.base
        if adapter is not None:
            name = str(adapter)
            if self._peft is None:
                self._peft = PeftModel.from_pretrained(self.base, adapter, adapter_name=name)
            elif name not in self._peft.peft_config:
                self._peft.load_adapter(adapter, adapter_name=name)
            self._peft.set_adapter(name)
            model = self._peft
        with torch.no_grad():
            if adapter is None and self._peft is not None:
                with self._peft.disable_adapter():
                    out = self._generate(self._peft, prompt_ids, max_new_tokens)
            else:
                out = self._generate(model, prompt_ids, max_new_tokens)
        eos = {self.eos} if isinstance(self.eos, int) else set(self.eos or ())
        for i, t in enumerate(out):
            if t in eos:
                return out[: i + 1]
        return out

    def _generate(self, model, prompt_ids, max_new_tokens) -> list[int]:
        ids = torch.tensor([prompt_ids])
        out = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            pad_token_id=self.eos if isinstance(self.eos, int) else 0,
        )
        return out[0, len(prompt_ids) :].tolist()
