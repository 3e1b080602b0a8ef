"""Shared fixtures: the embedded default model, converted once per session."""

from __future__ import annotations

import os

# The engines the tests start take their KV cache's pages as used: written whole at start-up (the serving
# default), each would cost seconds and its whole cache in memory. Set before hybridserve.config is imported,
# for the engines in this process and in the servers it starts.
os.environ.setdefault("HYBRIDSERVE_KV_CACHE_PREFAULT", "0")

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


@pytest.fixture(scope="session")
def tiny_checkpoints(tmp_path_factory) -> Path:
    """kimi-linear-tiny and kimi-k3-tiny, made by scripts/make_tiny_checkpoints.py into a session tmp dir."""
    from scripts.make_tiny_checkpoints import make

    root = tmp_path_factory.mktemp("tiny-checkpoints")
    for name in ("kimi-linear-tiny", "kimi-k3-tiny"):
        make(root, name)
    return root


@pytest.fixture(scope="session")
def kimi_linear_dir(tiny_checkpoints: Path) -> Path:
    return tiny_checkpoints / "kimi-linear-tiny"


@pytest.fixture(scope="session")
def kimi_k3_dir(tiny_checkpoints: Path) -> Path:
    return tiny_checkpoints / "kimi-k3-tiny"
