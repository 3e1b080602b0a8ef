"""What a stored response reads at every point of its life: from its first event, after a crash, after its
client left, and once it ended (a terminal state is never overwritten)."""

import json
import shutil
import time

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.openai.responses.store import TERMINAL, ResponseStore
from hybridserve.serving.storage import DATABASE_FILE

from .fake_engine import FakeEngine
from .helpers import PARIS, serve_in_thread
from .test_responses import ASK
from .test_responses_background import wait_for

UNFINISHED = {"code": "server_error", "message": "The server stopped before this response finished."}


def wait(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_a_streamed_response_is_stored_from_its_first_event(tokenizer, tmp_path):
    """The client holds the id from response.created: GET finds it in progress, a crash leaves it failed (not
    missing) and a disconnect leaves it cancelled with the output so far."""
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    crash = tmp_path / "crash"
    with serve_in_thread(build_app(engine, None, tmp_path / "data")) as url, httpx.Client(base_url=url) as http:
        with http.stream("POST", "/v1/responses", json={"input": ASK, "stream": True}, timeout=10) as stream:
            lines = stream.iter_lines()
            created = json.loads(next(line for line in lines if line.startswith("data: "))[6:])
            assert created["type"] == "response.created"
            rid = created["response"]["id"]
            wait(engine.paused.is_set, "the engine to pause")
            running = http.get(f"/v1/responses/{rid}", timeout=10).json()
            assert (running["status"], running["output"]) == ("in_progress", [])
            crash.mkdir()  # what a server killed now leaves on disk
            for name in (DATABASE_FILE, f"{DATABASE_FILE}-wal"):
                shutil.copy(tmp_path / "data" / name, crash / name)
        wait(lambda: http.get(f"/v1/responses/{rid}", timeout=10).json()["status"] != "in_progress", "the cancel")
        left = http.get(f"/v1/responses/{rid}", timeout=10).json()
    assert (left["status"], left["output"][0]["content"][0]["text"]) == ("cancelled", "The capital")
    assert engine.aborted == [rid]
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, crash)) as restarted:
        recovered = restarted.get(f"/v1/responses/{rid}").json()
    assert (recovered["status"], recovered["error"]) == ("failed", UNFINISHED)


def test_a_background_response_reads_in_progress_while_it_generates(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    with TestClient(build_app(engine, None)) as client:
        queued = client.post("/v1/responses", json={"input": ASK, "background": True}).json()
        assert queued["status"] == "queued"
        wait(engine.paused.is_set, "the engine to pause")
        assert client.get(f"/v1/responses/{queued['id']}").json()["status"] == "in_progress"
        engine.resume.set()
        wait_for(client, queued["id"], "completed")


def test_a_failed_non_streamed_response_is_stored_failed(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.error_at_step = 1
    app = build_app(engine, None)
    with TestClient(app) as client:
        assert client.post("/v1/responses", json={"input": ASK}).status_code == 500
        [(stored,)] = app.state.response_store.db.all("SELECT response FROM responses")
    assert json.loads(stored)["status"] == "failed"  # nothing is left in progress


def test_a_terminal_state_is_never_overwritten(tokenizer):
    """A running response marked failed under it (what a second server's start-up did) stays failed when the
    run ends: a client never sees a terminal state change."""
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    app = build_app(engine, None)
    with TestClient(app) as client:
        rid = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
        wait(engine.paused.is_set, "the engine to pause")
        app.state.response_store.fail_unfinished(UNFINISHED["message"])
        failed = client.get(f"/v1/responses/{rid}").json()
        engine.resume.set()
        replay = client.get(f"/v1/responses/{rid}", params={"stream": "true"}).text  # returns once the run ended
        assert "response.completed" in replay and engine.completed == [rid]
        assert client.get(f"/v1/responses/{rid}").json() == failed
    assert (failed["status"], failed["error"]) == ("failed", UNFINISHED)


@pytest.mark.parametrize("status", TERMINAL)
def test_update_leaves_a_terminal_state(status):
    store = ResponseStore(":memory:")
    item = {"id": "msg_1", "type": "message"}
    store.put({"id": "resp_1", "created_at": 1, "status": "in_progress", "output": []}, [], [])
    assert store.update({"id": "resp_1", "created_at": 1, "status": status, "output": [item]})
    for later in TERMINAL + ("in_progress", "queued"):
        assert not store.update({"id": "resp_1", "created_at": 1, "status": later, "output": []})
    assert store.get("resp_1") == {"id": "resp_1", "created_at": 1, "status": status, "output": [item]}
    assert store.item("msg_1") == item
    assert store.fail_unfinished("stopped") == []
