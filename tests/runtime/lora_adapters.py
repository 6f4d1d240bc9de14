"""LoRA adapters for the default model made with PEFT itself, and PEFT's greedy output as the oracle.

Three adapters of different ranks and target modules, with random (non-zero) B matrices
(`init_lora_weights=False`), saved the way users save them (`save_pretrained`: adapter_config.json +
adapter_model.safetensors). One covers rsLoRA and an alpha_pattern, one every projection.
"""

from __future__ import annotations

import contextlib
import copy
from pathlib import Path

import torch

# name -> LoraConfig arguments
ADAPTERS: dict[str, dict] = {
    "qv8": {"r": 8, "lora_alpha": 16, "target_modules": ["q_proj", "v_proj"]},
    "mlp4": {
        "r": 4,
        "lora_alpha": 8,
        "use_rslora": True,
        "target_modules": ["o_proj", "gate_proj", "down_proj"],
    },
    "all16": {
        "r": 16,
        "lora_alpha": 32,
        "alpha_pattern": {"down_proj": 8},
        "target_modules": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    },
}


def make_adapters(hf_model, out: Path, seed: int = 0):
    """Save ADAPTERS under out/<name>/; returns the PEFT model holding all of them (a copy of hf_model)."""
    from peft import LoraConfig, get_peft_model

    torch.manual_seed(seed)
    base = copy.deepcopy(hf_model)
    peft_model = None
    for name, kwargs in ADAPTERS.items():
        config = LoraConfig(init_lora_weights=False, lora_dropout=0.0, **kwargs)
        if peft_model is None:
            peft_model = get_peft_model(base, config, adapter_name=name)
        else:
            peft_model.add_adapter(name, config)
    assert peft_model is not None
    for name in ADAPTERS:
        peft_model.save_pretrained(str(out), selected_adapters=[name])
    return peft_model.eval()


def adapter_dir(out: Path, name: str) -> Path:
    """Where save_pretrained put adapter `name` (PEFT writes non-default adapters into a subfolder)."""
    found = [p.parent for p in out.rglob("adapter_config.json") if name in p.parent.parts]
    assert len(found) == 1, f"adapter {name} saved at {found}"
    return found[0]


def peft_greedy(peft_model, adapter: str | None, ids: list[int], max_new: int) -> list[int]:
    """Greedy tokens from HF + PEFT under `adapter` (None: adapters disabled), never stopping at EOS."""
    out: list[int] = []
    past = None
    step = torch.tensor([ids])
    with torch.no_grad():
        if adapter is None:
            ctx = peft_model.disable_adapter()
        else:
            peft_model.set_adapter(adapter)
            ctx = contextlib.nullcontext()
        with ctx:
            for _ in range(max_new):
                res = peft_model(input_ids=step, past_key_values=past, use_cache=True)
                past = res.past_key_values
                token = int(res.logits[0, -1].argmax())
                out.append(token)
                step = torch.tensor([[token]])
    return out
