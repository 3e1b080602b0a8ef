"""The Messages API on a kimi_k3 server (scripted engine, K3 test tokenizer): `thinking` reaches the prompt through
the extension exactly as Chat's reasoning fields do, and the K3 parser's channels become thinking and text blocks."""

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from scripts.make_tiny_checkpoints import k3_tokenizer
from tests.serving.anthropic.helpers import events
from tests.serving.extensions.test_kimi_k3_server import HI, k3_engine, script

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture
def engine(k3_tok):
    return k3_engine(k3_tok)


@pytest.fixture(scope="module")
def k3_tok():
    return k3_tokenizer()


@pytest.fixture
def client(engine):
    with TestClient(build_app(engine, None)) as client:
        yield client


@pytest.mark.parametrize(
    ("thinking", "chat_fields"),
    [
        ({"type": "disabled"}, {"thinking": {"type": "disabled"}}),
        ({"type": "adaptive"}, {"thinking": {"type": "enabled"}}),
        ({"type": "enabled", "budget_tokens": 32000}, {"reasoning_effort": "high"}),
        ({"type": "enabled", "budget_tokens": 1024}, {"reasoning_effort": "low"}),
    ],
)
def test_thinking_renders_as_chats_reasoning_fields(client, engine, thinking, chat_fields):
    r = client.post(
        "/v1/messages", json={"model": "smollm2", "max_tokens": 50, "messages": HELLO, "thinking": thinking}
    )
    assert r.status_code == 200, r.text
    r = client.post("/v1/chat/completions", json={"messages": HELLO, "max_tokens": 50, **chat_fields})
    assert r.status_code == 200, r.text
    assert engine.calls[0][0] == engine.calls[1][0]


def test_channels_become_blocks(client, engine, k3_tok):
    request = {"model": "smollm2", "max_tokens": 50, "messages": HELLO}
    message = client.post("/v1/messages", json=request).json()
    assert [(b["type"], b.get("thinking", b.get("text"))) for b in message["content"]] == [
        ("thinking", "hm"),
        ("text", "Hi"),
    ]
    evs = events(client.post("/v1/messages", json={**request, "stream": True}).text)
    assert [e["content_block"]["type"] for e in evs if e["type"] == "content_block_start"] == ["thinking", "text"]
    engine.scripts = [script(k3_tok, HI)]
    message = client.post("/v1/messages", json={**request, "thinking": {"type": "disabled"}}).json()
    assert message["content"] == [{"type": "text", "text": "Hi"}]
