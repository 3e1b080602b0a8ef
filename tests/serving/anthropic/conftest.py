import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.anthropic.signature import ThinkingSigner
from hybridserve.serving.app import build_app
from hybridserve.serving.parsers import Parsers
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS


@pytest.fixture
def engine(tokenizer):
    return FakeEngine(tokenizer, [PARIS], max_model_len=1024)


@pytest.fixture
def app(engine):
    """The app with the parsers that read `<think>` reasoning and Hermes `<tool_call>` blocks."""
    return build_app(engine, None, parsers=Parsers("think", "hermes"))


@pytest.fixture
def client(app):
    with TestClient(app) as client:
        yield client


@pytest.fixture
def signer(app) -> ThinkingSigner:
    """The server's signer (its secret), which signs the thinking blocks it sends."""
    return app.state.messages.signer
