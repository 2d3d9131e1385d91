"""PEFT LoRA adapters for the tests: written by PEFT itself for a model folder, and PEFT's forward as
the reference."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

# Every projection a Llama-family LoRA can target.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_lora_adapter(
    model_dir: Path,
    out: Path,
    *,
    seed: int,
    r: int = 8,
    lora_alpha: float = 16,
    target_modules: tuple[str, ...] | list[str] = LORA_TARGETS,
    std: float = 0.1,
    **config: Any,
) -> Path:
    """A PEFT LoRA adapter for the model in ``model_dir``, saved by PEFT itself, with random A and B
    (PEFT starts B at zero, which would make the adapter a no-op)."""
    import peft
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    lcfg = peft.LoraConfig(r=r, lora_alpha=lora_alpha, target_modules=list(target_modules), lora_dropout=0.0, **config)
    model = peft.get_peft_model(base, lcfg)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=gen))
    model.save_pretrained(str(out))
    return out


def peft_model(model_dir: Path, adapter_dir: Path | None) -> Any:
    """Transformers' model in float32 with the adapter applied by PEFT (unmerged): the reference."""
    import transformers

    base = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    if adapter_dir is None:
        return base
    import peft

    return peft.PeftModel.from_pretrained(base, str(adapter_dir)).eval()
