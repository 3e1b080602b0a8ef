"""A client that goes away aborts its engine requests (and they count as "abort", never reach a client)."""

import asyncio
import json

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, QUESTION, call_until_disconnect


def run_disconnecting(engine, path, body):
    async def main():
        app = build_app(engine, None)
        return await call_until_disconnect(app, path, body, engine.paused), app

    return asyncio.run(main())


def outcome(app, name):
    return app.state.metrics.registry.get_sample_value(
        "hybridserve:request_outcome_total", {"model_name": "smollm2", "outcome": name}
    )


@pytest.mark.parametrize("stream", [False, True])
def test_chat_disconnect_aborts(tokenizer, stream):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 3
    sent, app = run_disconnecting(engine, "/v1/chat/completions", {"messages": QUESTION, "stream": stream, "n": 2})
    request_ids = [rid for _, _, rid in engine.calls]  # one engine request per choice
    assert len(request_ids) == 2 and engine.aborted == request_ids
    assert engine.completed == [] and engine.running == 0
    assert outcome(app, "abort") == 2 and outcome(app, "stop") == 0
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    if stream:
        assert sent[0]["status"] == 200
        assert b'finish_reason":"stop' not in body and b"[DONE]" not in body
        chunks = [json.loads(e[6:]) for e in body.decode().split("\n\n") if e]
        assert len(chunks) == 2 + 2 * 3  # role chunks, then 3 steps of 2 choices
    else:
        assert sent[0]["status"] == 499 and body == b""


@pytest.mark.parametrize("stream", [False, True])
def test_batch_completion_disconnect_aborts_every_prompt(tokenizer, stream):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 1
    run_disconnecting(engine, "/v1/completions", {"prompt": ["a", "b", "c"], "stream": stream})
    assert sorted(engine.aborted) == sorted(rid for _, _, rid in engine.calls) and len(engine.aborted) == 3
    assert engine.running == 0


def test_test_client_closing_a_stream_aborts(tokenizer):
    """A cancelled app task (how TestClient and servers shutting down stop an app) also aborts."""
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    with TestClient(build_app(engine, None)) as client:
        with client.stream("POST", "/v1/chat/completions", json={"messages": QUESTION, "stream": True}) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
        for _ in range(500):  # the abort lands within a few event-loop turns; allow up to 5 s on a busy machine
            if engine.aborted:
                break
            client.portal.call(asyncio.sleep, 0.01)
        assert engine.aborted == [engine.calls[0][2]] and engine.running == 0


def test_finished_requests_are_not_aborted(client, engine):
    client.post("/v1/chat/completions", json={"messages": QUESTION, "stream": True})
    client.post("/v1/chat/completions", json={"messages": QUESTION})
    assert engine.aborted == [] and len(engine.completed) == 2
