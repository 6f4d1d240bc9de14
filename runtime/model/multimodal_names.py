"""Weight names of a multimodal checkpoint's language model (Gemma 3's Gemma3ForConditionalGeneration),
served text only: each tensor's name as the text model's, or None for the parts a text server never runs.

Hub checkpoints (and transformers' save_pretrained) say `language_model.model.` / `vision_tower.`;
transformers >= 5 names the same modules `model.language_model.` / `model.vision_tower.` in memory.
"""

from __future__ import annotations

_TEXT_PREFIXES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
)
_SKIPPED_PREFIXES = (
    "vision_tower.",
    "model.vision_tower.",
    "multi_modal_projector.",
    "model.multi_modal_projector.",
)


def text_weight_name(name: str) -> str | None:
    if name.startswith(_SKIPPED_PREFIXES):
        return None
    for old, new in _TEXT_PREFIXES:
        if name.startswith(old):
            return new + name[len(old) :]
    return name
