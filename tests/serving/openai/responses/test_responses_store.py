"""What a stored response reads at every point of its life: from its first event, after a crash, after its
client left, once it ended (a terminal state is never overwritten), and when the disk is full."""

import json
import shutil
import sqlite3
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.openai.responses.store import TERMINAL, ResponseStore
from hybridserve.serving.storage import DATABASE_FILE
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, error_body, serve_in_thread
from tests.serving.openai.responses.test_responses import ASK, TEXT, events
from tests.serving.openai.responses.test_responses_background import wait_for
from tests.serving.openapi_schema import check

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
        client.get(f"/v1/responses/{rid}", params={"stream": "true"})  # answers once the run has ended
        assert engine.completed == [rid]
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


def small_pages(data_dir: Path) -> Path:
    """`data_dir` with its database created with 512-byte pages, so every response row spills into pages of its
    own and `full()` makes each response write fail."""
    data_dir.mkdir()
    db = sqlite3.connect(data_dir / DATABASE_FILE)
    db.execute("PRAGMA page_size = 512")
    db.execute("PRAGMA journal_mode = WAL")
    db.close()
    return data_dir


def full(app) -> str:
    """No page can be added to the app's database any more: SQLite answers a write that needs one with
    SQLITE_FULL, "database or disk is full", as on a full disk. The error a client is told."""
    db = app.state.response_store.db
    db.execute("PRAGMA max_page_count = 1")  # never below the current size: the database is full as it is
    return f"The response could not be stored in {db.path}: database or disk is full."


def paused_post(client, engine, app, body: dict) -> tuple[httpx.Response, str]:
    """POSTs `body`; the disk fills while the engine is paused mid-generation. The answer and the error."""
    with ThreadPoolExecutor(1) as pool:
        answer = pool.submit(client.post, "/v1/responses", json=body)
        wait(engine.paused.is_set, "the engine to pause")
        message = full(app)
        client.portal.call(engine.resume.set)
        return answer.result(timeout=10), message


def test_a_full_disk_fails_a_stored_response_before_it_generates(tokenizer, tmp_path):
    engine = FakeEngine(tokenizer, [PARIS])
    app = build_app(engine, None, small_pages(tmp_path / "data"))
    with TestClient(app) as client:
        message = full(app)
        for body in ({"input": ASK}, {"input": ASK, "stream": True}, {"input": ASK, "background": True}):
            r = client.post("/v1/responses", json=body)
            assert (r.status_code, r.json()) == (507, error_body(message, type="server_error")), body
        assert engine.calls == []  # nothing generated in vain
        assert client.post("/v1/responses", json={"input": ASK, "store": False}).json()["status"] == "completed"


@pytest.mark.parametrize("stream", [False, True])
def test_a_disk_that_fills_during_generation_still_answers_the_output(tokenizer, tmp_path, stream):
    """The output is returned, as `failed` with the storage error, which is what GET reports, and a restart
    finds the response failed too: never completed, never in progress."""
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    app = build_app(engine, None, small_pages(tmp_path / "data"))
    with TestClient(app) as client:
        r, message = paused_post(client, engine, app, {"input": ASK, "stream": stream})
        assert r.status_code == 200
        if stream:
            evs = events(r.text)
            assert [e["type"] for e in evs[-3:]] == ["response.output_item.done", "error", "response.failed"]
            assert evs[-2] == {
                "type": "error",
                "code": "server_error",
                "message": message,
                "param": None,
                "sequence_number": len(evs) - 2,
            }
            answered = evs[-1]["response"]
        else:
            answered = r.json()
        assert (answered["status"], answered["error"]) == ("failed", {"code": "server_error", "message": message})
        assert answered["output"][0]["content"][0]["text"] == TEXT and answered["usage"]["output_tokens"] == 8
        check(answered, "Response")
        assert client.get(f"/v1/responses/{answered['id']}").json() == answered
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path / "data")) as restarted:
        recovered = restarted.get(f"/v1/responses/{answered['id']}").json()
    assert (recovered["status"], recovered["error"]) == ("failed", UNFINISHED)


def test_a_background_response_on_a_full_disk_reads_failed_not_queued(tokenizer, tmp_path):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    app = build_app(engine, None, small_pages(tmp_path / "data"))
    with TestClient(app) as client:
        rid = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
        wait(engine.paused.is_set, "the engine to pause")
        message = full(app)
        client.portal.call(engine.resume.set)
        failed = wait_for(client, rid, "failed")
        assert failed["error"] == {"code": "server_error", "message": message}
        assert failed["output"][0]["content"][0]["text"] == TEXT
        assert client.get(f"/v1/responses/{rid}", params={"stream": "true"}).text == ""  # its events were not kept
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path / "data")) as restarted:
        recovered = restarted.get(f"/v1/responses/{rid}").json()
    assert (recovered["status"], recovered["error"]) == ("failed", UNFINISHED)


def test_a_background_response_whose_start_cannot_be_stored_fails_without_running(tokenizer, monkeypatch):
    start = ResponseStore.start

    def read_only_start(store, response_id):
        store.db.execute("PRAGMA query_only = ON")  # every write fails from here: SQLITE_READONLY
        start(store, response_id)

    monkeypatch.setattr(ResponseStore, "start", read_only_start)
    engine = FakeEngine(tokenizer, [PARIS])
    app = build_app(engine, None)
    with TestClient(app) as client:
        rid = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
        failed = wait_for(client, rid, "failed")
        app.state.response_store.db.execute("PRAGMA query_only = OFF")
    assert failed["error"] == {
        "code": "server_error",
        "message": "The response could not be stored in :memory:: attempt to write a readonly database.",
    }
    assert engine.calls == []
