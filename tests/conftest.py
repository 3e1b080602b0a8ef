"""Shared fixtures: the embedded default model, converted once per session."""

from __future__ import annotations

from pathlib import Path

import pytest

from hybridserve.models.loader import resolve_model


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    return resolve_model(None).hf_dir


@pytest.fixture(scope="session")
def hf_model(smollm2_dir: Path):
    """The reference: transformers' own Llama on the same dequantized weights, fp32."""
    import torch
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(smollm2_dir, dtype=torch.float32).eval()
