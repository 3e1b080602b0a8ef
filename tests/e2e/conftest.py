"""The end-to-end tests: real servers driven by real clients. The session's `tokenizer` is tests/conftest.py's,
shared with tests/serving."""

from pathlib import Path

import pytest


@pytest.fixture(autouse=True)
def own_data_dir(data_dir: Path) -> Path:
    """Every test here runs with tests/conftest.py's data_dir: the servers it starts keep their data there."""
    return data_dir
