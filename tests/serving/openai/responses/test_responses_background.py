"""background: true — queued at once, runs without its client, replayable events, cancel, restarts."""

import asyncio
import json
import time

from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.openai.responses.store import ResponseStore
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, call_until_disconnect, error_body
from tests.serving.openai.responses.test_responses import ASK, TEXT, events
from tests.serving.openapi_schema import check

PIECES = ["The", " capital", " of", " France", " is", " Paris", "."]


def wait_for(client, rid: str, status: str) -> dict:
    deadline = time.monotonic() + 10
    while (body := client.get(f"/v1/responses/{rid}").json())["status"] != status:
        assert time.monotonic() < deadline, body
        time.sleep(0.01)
    return body


def test_background_runs_to_completion_and_replays(client):
    queued = client.post("/v1/responses", json={"input": ASK, "background": True}).json()
    assert (queued["status"], queued["background"], queued["output"]) == ("queued", True, [])
    check(queued, "Response")
    final = wait_for(client, queued["id"], "completed")
    assert final["output"][0]["content"][0]["text"] == TEXT and final["background"] is True
    check(final, "Response")
    evs = events(client.get(f"/v1/responses/{queued['id']}", params={"stream": "true"}).text)
    assert [e["type"] for e in evs[:5]] == [
        "response.created",
        "response.queued",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert evs[0]["response"]["status"] == "queued" and evs[2]["response"]["status"] == "in_progress"
    assert [e["delta"] for e in evs if e["type"] == "response.output_text.delta"] == PIECES
    assert evs[-1] == {"type": "response.completed", "response": final, "sequence_number": len(evs) - 1}
    later = events_after(client, queued["id"], 8)
    assert [e["sequence_number"] for e in later] == list(range(9, len(evs)))


def events_after(client, rid: str, n: int) -> list[dict]:
    text = client.get(f"/v1/responses/{rid}", params={"stream": "true", "starting_after": n}).text
    frames = [f for f in text.split("\n\n") if f]
    return [json.loads(f.split("\n")[1].removeprefix("data: ")) for f in frames]


def test_cancel_stops_the_engine_work(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 3
    with TestClient(build_app(engine, None)) as client:
        rid = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
        deadline = time.monotonic() + 10
        while not engine.paused.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        cancelled = client.post(f"/v1/responses/{rid}/cancel").json()
        assert cancelled["status"] == "cancelled"
        assert cancelled["output"][0]["status"] == "incomplete"
        assert cancelled["output"][0]["content"][0]["text"] == "The capital of"
        assert cancelled["usage"]["output_tokens"] == 3
        check(cancelled, "Response")
        assert engine.aborted == [rid] and engine.running == 0
        assert client.get(f"/v1/responses/{rid}").json() == cancelled
        assert client.post(f"/v1/responses/{rid}/cancel").json() == cancelled  # idempotent
        replay = events_after(client, rid, -1)
        assert replay[-1]["type"] == "response.output_text.delta"  # no terminal event exists for a cancel


def test_cancel_errors(client):
    done = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
    wait_for(client, done, "completed")
    r = client.post(f"/v1/responses/{done}/cancel")
    assert (r.status_code, r.json()) == (
        400,
        error_body("Cannot cancel a response with status 'completed'.", param="response_id"),
    )
    plain = client.post("/v1/responses", json={"input": ASK}).json()["id"]
    r = client.post(f"/v1/responses/{plain}/cancel")
    assert (r.status_code, r.json()) == (
        400,
        error_body("Only responses created with background=true can be cancelled.", param="response_id"),
    )
    r = client.get(f"/v1/responses/{plain}", params={"stream": "true"})
    assert (r.status_code, r.json()) == (
        400,
        error_body("Only responses created with background=true can be streamed again.", param="stream"),
    )
    r = client.post("/v1/responses/resp_nope/cancel")
    assert r.status_code == 404
    r = client.post("/v1/responses", json={"input": ASK, "background": True, "store": False})
    assert (r.status_code, r.json()) == (
        400,
        error_body("Background mode requires 'store' to be true.", param="background"),
    )


def test_streamed_background_survives_its_client(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 3

    async def main():
        app = build_app(engine, None)
        body = {"input": ASK, "background": True, "stream": True}
        sent = await call_until_disconnect(app, "/v1/responses", body, engine.paused)
        engine.resume.set()
        responses = app.state.response_store
        deadline = time.monotonic() + 10
        while engine.completed == []:
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        await asyncio.sleep(0.05)
        return sent, responses

    sent, store = asyncio.run(main())
    body = b"".join(m.get("body", b"") for m in sent)
    assert b"response.queued" in body and b"response.completed" not in body
    [rid] = engine.completed
    stored = store.get(rid)
    assert stored["status"] == "completed" and stored["output"][0]["content"][0]["text"] == TEXT


def test_shutdown_cancels_and_restart_keeps_it(tokenizer, tmp_path):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    with TestClient(build_app(engine, None, tmp_path)) as client:
        rid = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
        deadline = time.monotonic() + 10
        while not engine.paused.is_set():
            assert time.monotonic() < deadline
            time.sleep(0.01)
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path)) as client:
        body = client.get(f"/v1/responses/{rid}").json()
        assert (body["status"], body["output"][0]["content"][0]["text"]) == ("cancelled", "The capital")


def test_restart_fails_what_was_left_unfinished(tokenizer, tmp_path):
    store = ResponseStore(tmp_path / "hybridserve.sqlite3")
    store.put({"id": "resp_x", "created_at": 1, "status": "in_progress", "output": []}, [], [])
    store.close()
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path)) as client:
        body = client.get("/v1/responses/resp_x").json()
    assert (body["status"], body["error"]) == (
        "failed",
        {"code": "server_error", "message": "The server stopped before this response finished."},
    )


def test_a_bug_mid_run_stores_failed_not_queued(client, monkeypatch):
    def broken(self, out):
        raise RuntimeError("formatter bug")

    monkeypatch.setattr("hybridserve.serving.openai.responses.events.ResponseFormatter.feed", broken)
    rid = client.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
    body = wait_for(client, rid, "failed")
    assert body["error"] == {"code": "server_error", "message": "The response failed: formatter bug"}
    check(body, "Response")
