"""The renderer a model's prompts go through, chosen by its checkpoint's `model_type`."""

from __future__ import annotations

from collections.abc import Callable

from transformers import PreTrainedTokenizerBase

from hybridserve.rendering.base import Renderer
from hybridserve.rendering.chat_template import ChatTemplateRenderer
from hybridserve.rendering.kimi_k3 import KimiK3Renderer

# model_type → its renderer, for formats that are not the checkpoint's Hugging Face chat template
RENDERERS: dict[str, Callable[[PreTrainedTokenizerBase], Renderer]] = {"kimi_k3": lambda tokenizer: KimiK3Renderer()}


def renderer_for(model_type: str | None, tokenizer: PreTrainedTokenizerBase) -> Renderer:
    """The model's own renderer, or its chat template's."""
    return RENDERERS.get(model_type or "", ChatTemplateRenderer)(tokenizer)
