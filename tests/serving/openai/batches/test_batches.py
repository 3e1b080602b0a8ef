"""/v1/batches over the scripted engine: the SDK round trip per endpoint, validation, failing lines, cancel,
expiry, resume after a crash, limits, and a 20k-line input validated in bounded memory."""

import json
import logging
import threading
import time
import tracemalloc
from pathlib import Path

import openai
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving import cli
from hybridserve.serving.app import build_app
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.batches.store import BatchStore
from hybridserve.serving.openai.batches.validate import validate_input
from hybridserve.serving.openai.priority import BATCH_OFFSET
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.storage import DATABASE_FILE, Database
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, QUESTION, error_body, serve_with_engine, small_disk, without_ids

TEXT = "The capital of France is Paris."
BODIES = {
    "/v1/chat/completions": {"messages": QUESTION, "max_tokens": 16},
    "/v1/completions": {"prompt": "The capital of France is", "max_tokens": 16},
    "/v1/responses": {"input": "What is the capital of France?", "max_output_tokens": 16},
}
FAST = BatchSettings(progress_interval_s=0.02)


def line(custom_id: str, url: str = "/v1/chat/completions", body: dict | None = None, **fields) -> dict:
    return {
        "custom_id": custom_id,
        "method": "POST",
        "url": url,
        "body": BODIES[url] if body is None else body,
        **fields,
    }


def jsonl(lines: list) -> bytes:
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


def upload(client, data: bytes) -> str:
    r = client.post("/v1/files", files={"file": ("in.jsonl", data)}, data={"purpose": "batch"})
    assert r.status_code == 200, r.text
    return r.json()["id"]


def create(client, data: bytes, endpoint: str = "/v1/chat/completions", **extra) -> dict:
    body = {"input_file_id": upload(client, data), "endpoint": endpoint, "completion_window": "24h", **extra}
    r = client.post("/v1/batches", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def wait_for(client, batch_id: str, *statuses: str, until=None) -> dict:
    deadline = time.monotonic() + 10
    while True:
        batch = client.get(f"/v1/batches/{batch_id}").json()
        if batch["status"] in statuses and (until is None or until(batch)):
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.01)


def wait(condition, what: str) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline, what
        time.sleep(0.01)


def lines_of(client, file_id: str | None) -> list[dict]:
    if file_id is None:
        return []
    return [json.loads(x) for x in client.get(f"/v1/files/{file_id}/content").text.splitlines()]


@pytest.fixture
def app_client(tokenizer, tmp_path):
    """`make(engine=None, **settings)`: a started app on `tmp_path`, stopped at the end of the test."""
    clients = []

    def make(engine: FakeEngine | None = None, **settings):
        engine = engine or FakeEngine(tokenizer, [PARIS])
        client = TestClient(
            build_app(engine, None, tmp_path, batch_settings=BatchSettings(**{**vars(FAST), **settings}))
        )
        client.__enter__()
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.__exit__(None, None, None)


@pytest.mark.parametrize("endpoint", list(BODIES))
def test_sdk_round_trip_answers_what_the_endpoint_answers(app_client, tokenizer, endpoint):
    engine = FakeEngine(tokenizer, [PARIS])
    client = app_client(engine)
    sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    data = jsonl([line(f"request-{i}", endpoint) for i in range(3)])
    uploaded = sdk.files.create(file=("requests.jsonl", data), purpose="batch")
    batch = sdk.batches.create(
        input_file_id=uploaded.id,
        endpoint=endpoint,
        completion_window="24h",
        metadata={"job": "nightly"},
        output_expires_after={"anchor": "created_at", "seconds": 7200},
    )
    assert (batch.status, batch.endpoint, batch.metadata, batch.request_counts.total) == (
        "validating",
        endpoint,
        {"job": "nightly"},
        0,
    )
    deadline = time.monotonic() + 10
    while (batch := sdk.batches.retrieve(batch.id)).status != "completed":
        assert time.monotonic() < deadline, batch
        time.sleep(0.01)
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert batch.error_file_id is None and batch.errors is None
    assert batch.in_progress_at <= batch.finalizing_at <= batch.completed_at
    output = sdk.files.retrieve(batch.output_file_id)
    assert (output.purpose, output.filename) == ("batch_output", f"{batch.id}_output.jsonl")
    assert output.expires_at == output.created_at + 7200  # anchored at the file's creation
    assert sdk.files.retrieve(uploaded.id).expires_at is None
    results = [json.loads(x) for x in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in results] == ["request-0", "request-1", "request-2"]
    direct = client.post(endpoint, json=BODIES[endpoint]).json()
    for result in results:
        assert result["id"].startswith("batch_req_") and result["error"] is None
        response = result["response"]
        assert (response["status_code"], response["request_id"]) == (200, response["body"]["id"])
        assert without_ids(response["body"]) == without_ids(direct)
    assert [b.id for b in sdk.batches.list()] == [batch.id]
    # Batch work reaches the engine behind online traffic: the scheduler admits it after waiting online
    # requests and preempts it first (tests/engine/test_scheduler.py).
    batch = BATCH_OFFSET
    assert [engine.priorities[request_id] for _, _, request_id in engine.calls] == [batch, batch, batch, 0]


def test_validation_errors_name_each_line(app_client):
    client = app_client()
    data = jsonl(
        [
            line("ok-1"),
            "{not json",
            line("ok-1"),
            line("wrong-url", "/v1/completions"),
            {**line("wrong-method"), "method": "GET"},
            line("bad-body", body={"messages": "hello", "max_tokens": 3}),
            line("streamed", body={**BODIES["/v1/chat/completions"], "stream": True}),
            {"method": "POST", "url": "/v1/chat/completions", "body": {}},
            "[1, 2]",
        ]
    )
    batch = wait_for(client, create(client, data)["id"], "failed")
    assert batch["errors"] == {
        "object": "list",
        "data": [
            {
                "code": "invalid_json_line",
                "line": 2,
                "message": "Line 2 is not valid JSON: Invalid JSON: key must be a string at line 1 column 2.",
                "param": None,
            },
            {
                "code": "duplicate_custom_id",
                "line": 3,
                "message": "Line 3: custom_id 'ok-1' is already used on line 1; custom_ids must be unique within a "
                "batch.",
                "param": "custom_id",
            },
            {
                "code": "invalid_url",
                "line": 4,
                "message": "Line 4: url '/v1/completions' does not match the batch's endpoint '/v1/chat/completions'.",
                "param": "url",
            },
            {
                "code": "invalid_method",
                "line": 5,
                "message": "Line 5: method must be 'POST', got 'GET'.",
                "param": "method",
            },
            {
                "code": "invalid_request",
                "line": 6,
                "message": "Line 6: invalid body: Invalid value for 'messages': Input should be a valid list, got "
                '"hello".',
                "param": "body.messages",
            },
            {
                "code": "invalid_request",
                "line": 7,
                "message": "Line 7: body.stream is not supported in a batch.",
                "param": "body.stream",
            },
            {
                "code": "missing_required_parameter",
                "line": 8,
                "message": "Line 8: Missing required parameter: 'custom_id'.",
                "param": "custom_id",
            },
            {"code": "invalid_json_line", "line": 9, "message": "Line 9 is not a JSON object.", "param": None},
        ],
    }
    assert (batch["request_counts"], batch["output_file_id"], batch["error_file_id"]) == (
        {"total": 0, "completed": 0, "failed": 0},
        None,
        None,
    )
    assert batch["failed_at"] is not None and batch["in_progress_at"] is None


def test_failing_lines_are_error_lines_and_the_batch_goes_on(app_client, tokenizer, caplog):
    caplog.set_level(logging.INFO, "hybridserve.serving.openai.batches.runner")
    client = app_client(FakeEngine(tokenizer, [PARIS], max_model_len=64))
    too_long = {"messages": [{"role": "user", "content": "word " * 80}]}
    data = jsonl(
        [
            line("fine-1"),
            line("other-model", body={**BODIES["/v1/chat/completions"], "model": "gpt-4o"}),
            line("too-long", body=too_long),
            line("fine-2"),
        ]
    )
    batch = wait_for(client, create(client, data)["id"], "completed")
    assert batch["request_counts"] == {"total": 4, "completed": 2, "failed": 2}
    assert [r["custom_id"] for r in lines_of(client, batch["output_file_id"])] == ["fine-1", "fine-2"]
    errors = {r["custom_id"]: r for r in lines_of(client, batch["error_file_id"])}
    assert list(errors) == ["other-model", "too-long"]
    assert errors["other-model"]["response"]["status_code"] == 404
    assert errors["other-model"]["response"]["body"] == error_body(
        "The model `gpt-4o` does not exist.", param="model", code="model_not_found"
    )
    assert errors["other-model"]["error"] is None
    direct = client.post("/v1/chat/completions", json=too_long)
    assert errors["too-long"]["response"]["status_code"] == direct.status_code == 400
    assert errors["too-long"]["response"]["body"] == direct.json()
    assert direct.json()["error"]["code"] == "context_length_exceeded"
    assert f"batch {batch['id']}: request 'other-model' answered 404" in caplog.text  # whole custom_ids
    metrics = client.get("/metrics").text
    assert 'hybridserve:batch_requests_total{model_name="smollm2",outcome="completed"} 2.0' in metrics
    assert 'hybridserve:batch_requests_total{model_name="smollm2",outcome="failed"} 2.0' in metrics
    assert 'hybridserve:batches{model_name="smollm2",status="completed"} 1.0' in metrics


def paused_engine(tokenizer, finished_first: int) -> FakeEngine:
    """The first `finished_first` requests finish at once (an EOS script); every later one pauses at step 1."""
    engine = FakeEngine(tokenizer, [PARIS])
    engine.turns = [[2] for _ in range(finished_first)]
    engine.pause_at_step = 1
    return engine


def test_cancel_aborts_in_flight_and_keeps_what_finished(app_client, tokenizer, caplog):
    caplog.set_level(logging.INFO, "hybridserve.serving.openai.batches.runner")
    engine = paused_engine(tokenizer, 2)
    client = app_client(engine, max_requests_in_flight=3)
    batch = create(client, jsonl([line(f"c-{i}") for i in range(6)]))
    wait_for(client, batch["id"], "in_progress", until=lambda b: b["request_counts"]["completed"] == 2)
    wait(lambda: engine.running == 3, "three requests to pause")
    progress = f"batch {batch['id']}: 2/6 requests done (2 completed, 0 failed), "
    wait(lambda: progress in caplog.text, "a progress line")
    cancelling = client.post(f"/v1/batches/{batch['id']}/cancel").json()
    assert cancelling["status"] == "cancelling" and cancelling["cancelling_at"] is not None
    done = wait_for(client, batch["id"], "cancelled")
    assert done["request_counts"] == {"total": 6, "completed": 2, "failed": 0}
    assert done["cancelled_at"] is not None and done["error_file_id"] is None
    assert [r["custom_id"] for r in lines_of(client, done["output_file_id"])] == ["c-0", "c-1"]
    wait(lambda: engine.running == 0, "the paused requests to be aborted")
    assert len(engine.aborted) == 3 and len(engine.calls) == 5  # nothing started after the cancel
    r = client.post(f"/v1/batches/{batch['id']}/cancel")
    assert (r.status_code, r.json()) == (
        409,
        error_body("Cannot cancel a batch with status 'cancelled'.", param="batch_id", code="invalid_state"),
    )


def test_past_the_window_it_expires_with_partial_results(app_client, tokenizer):
    now = [1_000_000.0]
    engine = paused_engine(tokenizer, 1)
    client = app_client(engine, max_requests_in_flight=1, clock=lambda: now[0])
    batch = create(client, jsonl([line(f"e-{i}") for i in range(3)]))
    assert batch["expires_at"] == batch["created_at"] + 24 * 3600 == 1_000_000 + 24 * 3600
    wait_for(client, batch["id"], "in_progress", until=lambda b: b["request_counts"]["completed"] == 1)
    wait(lambda: engine.running == 1, "the second request to pause")
    now[0] += 24 * 3600
    done = wait_for(client, batch["id"], "expired")
    assert (done["expired_at"], done["request_counts"]) == (
        1_000_000 + 24 * 3600,
        {"total": 3, "completed": 1, "failed": 2},
    )
    assert [r["custom_id"] for r in lines_of(client, done["output_file_id"])] == ["e-0"]
    expired = lines_of(client, done["error_file_id"])
    assert [(r["custom_id"], r["response"], r["error"]) for r in expired] == [
        (
            f"e-{i}",
            None,
            {
                "code": "batch_expired",
                "message": "This request could not be executed before the completion window expired.",
            },
        )
        for i in (1, 2)
    ]
    wait(lambda: engine.running == 0, "the paused request to be aborted")


def test_restart_resumes_and_writes_every_line_exactly_once(app_client, tokenizer, tmp_path):
    """A server stops mid-batch (its last line written but not committed, as a kill -9 can leave it); the
    next one runs only the requests without a committed result."""
    first = paused_engine(tokenizer, 2)
    client = app_client(first, max_requests_in_flight=2)
    batch = create(client, jsonl([line(f"job-{i:03d}") for i in range(6)]))
    wait_for(client, batch["id"], "in_progress", until=lambda b: b["request_counts"]["completed"] == 2)
    wait(lambda: first.running == 2, "two requests to pause")
    client.__exit__(None, None, None)
    db = Database(tmp_path / DATABASE_FILE)
    stored = BatchStore(db).get(batch["id"])
    db.close()
    assert (stored.status, stored.completed) == ("in_progress", 2)
    output = tmp_path / "files" / stored.output_file_id
    committed = output.read_bytes()
    with output.open("ab") as f:
        f.write(b'{"id": "batch_req_torn", "custom_id": "job-002", "respo')

    second = FakeEngine(tokenizer, [PARIS])
    client = app_client(second)
    done = wait_for(client, batch["id"], "completed")
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    results = lines_of(client, done["output_file_id"])
    assert [r["custom_id"] for r in results] == [f"job-{i:03d}" for i in range(6)]
    assert output.read_bytes().startswith(committed) and b"batch_req_torn" not in output.read_bytes()
    assert len(second.calls) == 4


@pytest.mark.parametrize("then", ["engine recovers", "server restarts"])
def test_a_stopped_engine_writes_no_error_lines_and_the_batch_goes_on_after(
    app_client, tokenizer, tmp_path, caplog, then
):
    """The engine dies under two requests in flight: neither is written (no 500 lines), the batch stays in
    progress and waits; once the engine serves again (a router restarts its worker), or on the next server,
    the batch runs what has no result, and every line is in the output exactly once."""
    caplog.set_level(logging.INFO, "hybridserve.serving.openai.batches.runner")
    engine = paused_engine(tokenizer, 2)
    client = app_client(engine, max_requests_in_flight=2, engine_wait_s=0.02)
    batch = create(client, jsonl([line(f"job-{i}") for i in range(6)]))
    wait_for(client, batch["id"], "in_progress", until=lambda b: b["request_counts"]["completed"] == 2)
    wait(lambda: engine.running == 2, "two requests to pause")
    engine.dead, engine.raise_at_step = True, 1  # the paused requests fail, the health check says why
    client.portal.call(engine.resume.set)
    stopped = f"batch {batch['id']}: the engine stopped serving (engine process exited with code 1) with 2/6"
    wait(lambda: stopped in caplog.text, "the runner to see the engine stop")
    wait(
        lambda: "requests done (2 completed, 0 failed), " in caplog.text and "waiting for the engine" in caplog.text,
        "a progress line",
    )
    paused = client.get(f"/v1/batches/{batch['id']}").json()
    assert (paused["status"], paused["request_counts"]) == ("in_progress", {"total": 6, "completed": 2, "failed": 0})
    db = Database(tmp_path / DATABASE_FILE)
    stored = BatchStore(db).get(batch["id"])
    db.close()
    assert stored.error_bytes == 0 and not (tmp_path / "files" / stored.error_file_id).read_bytes()
    assert len(engine.calls) == 4  # nothing more was sent to a dead engine

    if then == "server restarts":  # stopped before the engine is back, so the old server cannot resume the batch
        client.__exit__(None, None, None)
    engine.dead, engine.raise_at_step, engine.pause_at_step = False, None, None
    if then == "server restarts":
        client = app_client(engine)
    done = wait_for(client, batch["id"], "completed")
    assert done["request_counts"] == {"total": 6, "completed": 6, "failed": 0}
    assert done["error_file_id"] is None
    results = lines_of(client, done["output_file_id"])
    assert sorted(r["custom_id"] for r in results) == [f"job-{i}" for i in range(6)]
    assert len(engine.calls) == 8  # the two that failed ran again


def test_output_files_expire_and_the_sweep_deletes_them(app_client, tokenizer, tmp_path, caplog):
    caplog.set_level(logging.INFO, "hybridserve.serving.openai.files.service")
    now = [1_000_000.0]
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=64)
    engine.pause_at_step = 0  # the batch cannot end before the clock has moved
    client = app_client(engine, clock=lambda: now[0], file_sweep_interval_s=0.02)
    too_long = {"messages": [{"role": "user", "content": "word " * 80}]}
    policy = {"anchor": "created_at", "seconds": 3600}
    batch = create(client, jsonl([line("fine"), line("too-long", body=too_long)]), output_expires_after=policy)
    wait(engine.paused.is_set, "the batch's request to reach the engine")
    now[0] += 600  # the files' clock starts when the batch ends, not when it was created
    client.portal.call(engine.resume.set)
    done = wait_for(client, batch["id"], "completed")
    files = [client.get(f"/v1/files/{done[kind]}").json() for kind in ("output_file_id", "error_file_id")]
    assert [(f["created_at"], f["expires_at"]) for f in files] == [(1_000_600, 1_004_200)] * 2
    now[0] = 1_004_200
    for f in files:
        r = client.get(f"/v1/files/{f['id']}/content")
        assert (r.status_code, r.json()) == (
            404,
            error_body(f"No such File object: {f['id']}", param="file_id", code="not_found"),
        )
    assert [f["id"] for f in client.get("/v1/files").json()["data"]] == [batch["input_file_id"]]
    wait(lambda: not any((tmp_path / "files" / f["id"]).exists() for f in files), "the sweep to delete the files")
    assert f"deleted 2 expired files: {files[0]['id']}, {files[1]['id']}" in caplog.text
    batch = client.get(f"/v1/batches/{batch['id']}").json()  # the batch still names them, as OpenAI's does
    assert (batch["output_file_id"], batch["error_file_id"]) == (files[0]["id"], files[1]["id"])


def test_output_expiry_errors(app_client):
    client = app_client()
    file_id = upload(client, jsonl([line("a")]))
    good = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases = [
        (
            {"anchor": "created_at", "seconds": 60},
            "Invalid value for 'output_expires_after.seconds': Input should be greater than or equal to 3600, got 60.",
            "output_expires_after.seconds",
            "invalid_value",
        ),
        (
            {"anchor": "created_at", "seconds": 2592001},
            "Invalid value for 'output_expires_after.seconds': Input should be less than or equal to 2592000, got "
            "2592001.",
            "output_expires_after.seconds",
            "invalid_value",
        ),
        (
            {"anchor": "completed_at", "seconds": 3600},
            "Invalid value for 'output_expires_after.anchor': Input should be 'created_at', got \"completed_at\".",
            "output_expires_after.anchor",
            "invalid_value",
        ),
        (
            {"anchor": "created_at"},
            "Missing required parameter: 'output_expires_after.seconds'.",
            "output_expires_after.seconds",
            "missing_required_parameter",
        ),
    ]
    for policy, message, param, code in cases:
        r = client.post("/v1/batches", json={**good, "output_expires_after": policy})
        assert (r.status_code, r.json()) == (400, error_body(message, param=param, code=code)), policy
    assert client.get("/v1/batches").json()["data"] == []


def test_create_errors(app_client):
    client = app_client(max_active_batches=1)
    file_id = upload(client, jsonl([line("a")]))
    good = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    cases = [
        (
            {**good, "endpoint": "/v1/embeddings"},
            400,
            error_body(
                "Invalid value for 'endpoint': '/v1/embeddings'. This server batches /v1/chat/completions, "
                "/v1/completions, /v1/responses.",
                param="endpoint",
                code="invalid_value",
            ),
        ),
        (
            {**good, "completion_window": "1h"},
            400,
            error_body(
                "Invalid value for 'completion_window': '1h'. Supported: 24h.",
                param="completion_window",
                code="invalid_value",
            ),
        ),
        (
            {**good, "input_file_id": "file-nope"},
            404,
            error_body("No such File object: file-nope", param="input_file_id", code="not_found"),
        ),
        (
            {"endpoint": "/v1/chat/completions", "completion_window": "24h"},
            400,
            error_body(
                "Missing required parameter: 'input_file_id'.",
                param="input_file_id",
                code="missing_required_parameter",
            ),
        ),
    ]
    notes = client.post("/v1/files", files={"file": ("n.txt", b"x")}, data={"purpose": "user_data"}).json()["id"]
    cases.append(
        (
            {**good, "input_file_id": notes},
            400,
            error_body(
                f"File '{notes}' has purpose 'user_data'; a batch input needs purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            ),
        )
    )
    for body, status, error in cases:
        r = client.post("/v1/batches", json=body)
        assert (r.status_code, r.json()) == (status, error), body
    assert client.get("/v1/batches").json()["data"] == []  # none of them left a batch behind
    r = client.get("/v1/batches/batch_nope")
    assert (r.status_code, r.json()) == (
        404,
        error_body("No batch with id 'batch_nope'.", param="batch_id", code="not_found"),
    )


def test_batches_past_the_limit_wait_queued_and_start_in_order(app_client, tokenizer):
    engine = paused_engine(tokenizer, 0)
    client = app_client(engine, max_active_batches=1, max_queued_batches=2)

    def body(n: int) -> dict:  # max_tokens tells the batches' requests apart in engine.calls
        return {"messages": QUESTION, "max_tokens": n}

    running, second, third = (create(client, jsonl([line("a", body=body(n))])) for n in (10, 11, 12))
    wait(lambda: engine.running == 1, "the first batch's request to pause")
    for queued in (second, third):
        batch = client.get(f"/v1/batches/{queued['id']}").json()
        assert (batch["status"], batch["request_counts"], batch["in_progress_at"]) == (
            "validating",
            {"total": 0, "completed": 0, "failed": 0},
            None,
        )
    r = client.post(
        "/v1/batches",
        json={
            "input_file_id": upload(client, jsonl([line("a")])),
            "endpoint": "/v1/chat/completions",
            "completion_window": "24h",
        },
    )
    message = (
        "This server already has 2 batches queued for a runner slot, its limit (--max-queued-batches 2), and runs 1 "
        "at once (--max-active-batches): wait for one to finish or cancel one."
    )
    assert (r.status_code, r.json()) == (429, error_body(message, code="too_many_batches"))

    cancelled = client.post(f"/v1/batches/{third['id']}/cancel").json()  # queued: ends at once
    assert cancelled["status"] == "cancelled" and cancelled["cancelling_at"] <= cancelled["cancelled_at"]
    assert cancelled["output_file_id"] is None and cancelled["error_file_id"] is None
    fourth = create(client, jsonl([line("a", body=body(13))]))  # the cancel freed a place in the queue

    r = client.delete(f"/v1/files/{second['input_file_id']}")  # a queued batch's input is in use too
    assert r.status_code == 409 and r.json()["error"]["code"] == "file_in_use"
    client.portal.call(engine.resume.set)
    for batch in (running, second, fourth):
        done = wait_for(client, batch["id"], "completed")
        assert done["request_counts"] == {"total": 1, "completed": 1, "failed": 0}
    assert [params.max_tokens for _, params, _ in engine.calls] == [10, 11, 13]  # FIFO, the cancelled one skipped
    assert client.delete(f"/v1/files/{second['input_file_id']}").json()["deleted"] is True


def test_queued_batches_survive_a_restart(app_client, tokenizer, tmp_path):
    engine = paused_engine(tokenizer, 0)
    client = app_client(engine, max_active_batches=1, max_requests_in_flight=1)
    first, second = (create(client, jsonl([line(f"{n}-{i}") for i in range(2)])) for n in ("first", "second"))
    wait(lambda: engine.running == 1, "the first batch's request to pause")
    client.__exit__(None, None, None)
    db = Database(tmp_path / DATABASE_FILE)
    assert [(b.id, b.status) for b in BatchStore(db).unfinished()] == [
        (first["id"], "in_progress"),
        (second["id"], "validating"),
    ]
    db.close()
    again = FakeEngine(tokenizer, [PARIS])
    client = app_client(again, max_active_batches=1, max_requests_in_flight=1)
    for batch in (first, second):
        assert wait_for(client, batch["id"], "completed")["request_counts"]["completed"] == 2
    assert len(again.calls) == 4  # the first batch resumed first, then the queued one ran
    first_done = client.get(f"/v1/batches/{first['id']}").json()["completed_at"]
    assert first_done <= client.get(f"/v1/batches/{second['id']}").json()["in_progress_at"]


def test_a_batch_still_queued_past_its_window_expires(app_client, tokenizer, caplog):
    caplog.set_level(logging.INFO, "hybridserve.serving.openai.batches.runner")
    now = [1_000_000.0]
    engine = paused_engine(tokenizer, 0)
    client = app_client(engine, max_active_batches=1, clock=lambda: now[0])
    running = create(client, jsonl([line("r")]))
    queued = create(client, jsonl([line("q-0"), line("q-1")]))
    wait(lambda: engine.running == 1, "the running batch's request to pause")
    now[0] += 24 * 3600  # the window counts from creation, queued or not
    done = wait_for(client, queued["id"], "expired")
    assert (done["request_counts"], done["in_progress_at"], done["error_file_id"]) == (
        {"total": 0, "completed": 0, "failed": 0},
        None,
        None,
    )
    assert f"batch {queued['id']}: past its completion window while queued" in caplog.text
    assert wait_for(client, running["id"], "expired")["request_counts"]["failed"] == 1
    assert len(engine.calls) == 1  # the queued batch ran nothing


def test_list_pages_newest_first(app_client):
    client = app_client()
    ids = [create(client, jsonl([line("a")]))["id"] for _ in range(3)]
    page = client.get("/v1/batches", params={"limit": 2}).json()
    assert ([b["id"] for b in page["data"]], page["has_more"], page["last_id"]) == (ids[:0:-1], True, ids[1])
    page = client.get("/v1/batches", params={"limit": 2, "after": ids[1]}).json()
    assert ([b["id"] for b in page["data"]], page["has_more"]) == ([ids[0]], False)
    for batch_id in ids:
        wait_for(client, batch_id, "completed")


def test_too_many_lines_fails_validation(app_client):
    client = app_client(max_lines=2)
    batch = wait_for(client, create(client, jsonl([line(f"n-{i}") for i in range(3)]))["id"], "failed")
    assert batch["errors"]["data"] == [
        {
            "code": "too_many_requests",
            "line": 3,
            "message": "The input file has more than 2 requests, this server's limit (--batch-max-lines).",
            "param": None,
        }
    ]


def test_20k_lines_validate_in_bounded_memory(tmp_path: Path):
    path = tmp_path / "big.jsonl"
    with path.open("wb") as f:
        for i in range(20_000):
            f.write(json.dumps(line(f"eval-run-42-item-{i:06d}", body={"messages": QUESTION * 4})).encode() + b"\n")
        f.write(json.dumps(line("eval-run-42-item-000000")).encode() + b"\n")  # the first id, once more
    size = path.stat().st_size
    small = tmp_path / "small.jsonl"
    small.write_bytes(jsonl([line("warm-up")]))
    validate_input(small, {"/v1/chat/completions": ChatCompletionRequest}, 10, threading.Event())  # one-time caches
    tracemalloc.start()
    try:
        result = validate_input(path, {"/v1/chat/completions": ChatCompletionRequest}, 1_000_000, threading.Event())
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert result.total == 20_001
    assert [(e["line"], e["code"]) for e in result.errors] == [(20_001, "duplicate_custom_id")]
    assert size > 7_000_000 and peak < 256 * 1024, (peak, size)  # nothing grows with the number of lines


def test_cli_flags_reach_the_batch_settings(monkeypatch, tokenizer, capsys):
    seen = {}

    def build_engine(config):
        return FakeEngine(tokenizer, [PARIS])

    def fake_build_app(*args, batch_settings, max_body_bytes, **_):
        seen["settings"] = batch_settings
        raise SystemExit(0)

    serve_with_engine(monkeypatch, build_engine)
    monkeypatch.setattr("hybridserve.serving.app.build_app", fake_build_app)
    flags = ["--max-upload-bytes", "2MiB", "--batch-max-lines", "7", "--max-active-batches", "3"]
    with pytest.raises(SystemExit):
        cli.main(["serve", *flags, "--batch-max-requests-in-flight", "5", "--max-queued-batches", "0"])
    assert seen["settings"] == BatchSettings(
        max_upload_bytes=2 * 1024 * 1024,
        max_lines=7,
        max_active_batches=3,
        max_queued_batches=0,
        max_requests_in_flight=5,
    )
    for flag, bad, expected in (("--max-active-batches", "0", 1), ("--max-queued-batches", "-1", 0)):
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", flag, bad])
        assert exit_info.value.code == 2
        assert f"{flag}: must be at least {expected}, got {bad}" in capsys.readouterr().err


def test_a_full_disk_fails_the_batch_naming_it_and_keeps_the_results_written_whole(app_client, tmp_path):
    with small_disk(tmp_path / "files", 16 * 1024) as files:
        client = app_client()
        custom_ids = [f"request-{i}" for i in range(60)]
        batch = wait_for(client, create(client, jsonl([line(c) for c in custom_ids]))["id"], "failed")
        message = (
            f"The batch failed: its results could not be written to {files}: No space left on device. The results "
            "written before are in its output and error files."
        )
        assert batch["errors"]["data"] == [
            {"code": "insufficient_storage", "line": None, "message": message, "param": None}
        ]
        written = lines_of(client, batch["output_file_id"])  # each parses: no line torn by the failed write
        assert 0 < len(written) == batch["request_counts"]["completed"] < len(custom_ids)
        assert {r["custom_id"] for r in written} <= set(custom_ids)
        output = client.get(f"/v1/files/{batch['output_file_id']}").json()
        assert output["bytes"] == (files / batch["output_file_id"]).stat().st_size


def test_a_batch_created_on_a_full_disk_is_a_507(tokenizer, tmp_path):
    """The database cannot grow (SQLite's SQLITE_FULL, as on a full disk): creating a batch is refused with a 507,
    not a 500, and nothing is left half-made. (The server then logs the traceback, as for every unexpected error.)"""
    app = build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path, batch_settings=FAST)
    with TestClient(app, raise_server_exceptions=False) as client:
        file_id = upload(client, jsonl([line("one")]))
        app.state.response_store.db.execute("PRAGMA max_page_count = 1")  # never below its size: full as it is
        body = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        body["metadata"] = {f"key-{i}": "x" * 500 for i in range(16)}  # a row that needs pages of its own
        r = client.post("/v1/batches", json=body)
        message = "The server could not store what the request writes: database or disk is full."
        assert (r.status_code, r.json()) == (507, error_body(message, type="server_error"))
        assert client.get("/v1/batches").json()["data"] == []
