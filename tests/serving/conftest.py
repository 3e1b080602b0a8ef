from pathlib import Path

import pytest


@pytest.fixture
def engine(tokenizer):
    from tests.serving.fake_engine import FakeEngine
    from tests.serving.helpers import PARIS

    return FakeEngine(tokenizer, [PARIS])


@pytest.fixture
def client(engine):
    from fastapi.testclient import TestClient

    from hybridserve.serving.app import build_app

    with TestClient(build_app(engine, None)) as client:
        yield client


@pytest.fixture(autouse=True)
def own_data_dir(data_dir: Path) -> Path:
    """Every test here runs with tests/conftest.py's data_dir."""
    return data_dir
