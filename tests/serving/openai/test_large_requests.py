"""Large requests (issue 14, item 6): past --max-request-body-bytes a JSON body is a 413, answered as soon as it
passes the limit (at once when its Content-Length says so), while /v1/files keeps its own --max-upload-bytes; and
a large request below the limit does not hold up the others while its prompt is tokenized or its tool schemas
checked."""

import asyncio
import json
import socket
import threading

import httpx
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving import cli
from hybridserve.serving.app import build_app
from hybridserve.serving.openai import tools
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.body import DEFAULT_MAX_BODY_BYTES, OFF_LOOP_BYTES
from hybridserve.serving.openai.prompt import OFF_LOOP_SIZE
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import (
    PARIS,
    QUESTION,
    assert_error,
    error_body,
    post_scope,
    serve_in_thread,
    serve_with_engine,
)

LIMIT = 4096
MESSAGE = f"The request body is larger than this server's limit of {LIMIT} bytes (--max-request-body-bytes)."
TOO_LARGE = (413, MESSAGE, None, "request_too_large")
JSON = {"content-type": "application/json"}


@pytest.fixture
def small_app(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=100_000)
    return build_app(engine, None, max_body_bytes=LIMIT, batch_settings=BatchSettings(max_upload_bytes=10 * LIMIT))


def padded(body: dict, size: int) -> bytes:
    """`body` as JSON, padded with trailing whitespace to exactly `size` bytes."""
    data = json.dumps(body).encode()
    return data + b" " * (size - len(data))


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": QUESTION}),
        ("/v1/completions", {"prompt": "hi"}),
        ("/v1/responses", {"input": "hi"}),
    ],
)
def test_a_body_over_the_limit_is_413(small_app, path, body):
    with TestClient(small_app) as client:
        assert client.post(path, content=padded(body, LIMIT), headers=JSON).status_code == 200
        assert_error(client.post(path, content=padded(body, LIMIT + 1), headers=JSON), *TOO_LARGE)
    assert len(small_app.state.engine.calls) == 1


def test_batch_creation_is_bounded_and_uploads_keep_their_own_limit(small_app):
    with TestClient(small_app) as client:
        body = {"input_file_id": "file-x", "endpoint": "/v1/chat/completions", "completion_window": "24h"}
        assert_error(client.post("/v1/batches", content=padded(body, LIMIT + 1), headers=JSON), *TOO_LARGE)
        big = b"x" * (5 * LIMIT)  # over the JSON limit, under --max-upload-bytes
        r = client.post("/v1/files", files={"file": ("big.jsonl", big)}, data={"purpose": "user_data"})
        assert (r.status_code, r.json()["bytes"]) == (200, len(big))
        r = client.post("/v1/files", files={"file": ("huge.jsonl", big * 3)}, data={"purpose": "user_data"})
        assert r.status_code == 413 and r.json()["error"]["code"] == "file_too_large"


async def post_chunks(app, chunks: list[bytes], headers: list[tuple[bytes, bytes]]) -> tuple[int, dict, int]:
    """One POST of `chunks` straight to the ASGI app: its status, its JSON body and how many chunks it read."""
    read = 0
    sent: list[dict] = []

    async def receive() -> dict:
        nonlocal read
        read += 1
        return {"type": "http.request", "body": chunks[read - 1], "more_body": read < len(chunks)}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(post_scope("/v1/chat/completions", headers), receive, send), 10)
    body = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    return sent[0]["status"], json.loads(body), read


def test_a_streamed_body_is_refused_as_soon_as_it_passes_the_limit(small_app):
    chunks = [b"x" * 1024] * 100  # no Content-Length: the limit is passed in the fifth chunk
    status, body, read = asyncio.run(post_chunks(small_app, chunks, []))
    assert (status, body, read) == (413, error_body(MESSAGE, code="request_too_large"), 5)


def test_a_declared_length_over_the_limit_is_refused_before_reading(small_app):
    status, _, read = asyncio.run(post_chunks(small_app, [b"{}"], [(b"content-length", b"%d" % (LIMIT + 1))]))
    assert (status, read) == (413, 0)


def test_the_client_never_sends_a_body_the_server_would_refuse(small_app):
    """Over a socket: a client that waits for `100 Continue` gets the 413 instead, and sends nothing."""
    with serve_in_thread(small_app) as url:
        host, port = url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            conn.sendall(
                b"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                b"Content-Length: 1000000000\r\nExpect: 100-continue\r\n\r\n"
            )
            response = conn.recv(65536)
            head, _, body = response.partition(b"\r\n\r\n")
            length = int(next(line for line in head.split(b"\r\n") if line.startswith(b"content-length:")).split()[1])
            while len(body) < length:
                body += conn.recv(65536)
    assert head.startswith(b"HTTP/1.1 413 ")  # and no "100 Continue" before it
    assert json.loads(body) == error_body(MESSAGE, code="request_too_large")


def test_a_large_body_is_parsed_off_the_event_loop_and_served(tokenizer):
    engine = FakeEngine(tokenizer, [PARIS], max_model_len=10**7)
    with TestClient(build_app(engine, None)) as client:
        prompt = list(range(1, 40_000)) * 8  # about 2 MiB of token ids, over OFF_LOOP_BYTES
        body = json.dumps({"prompt": prompt, "max_tokens": 1}).encode()
        assert OFF_LOOP_BYTES < len(body) < DEFAULT_MAX_BODY_BYTES
        assert client.post("/v1/completions", content=body, headers=JSON).status_code == 200
    assert engine.calls[0][0] == prompt


def test_max_request_body_bytes_flag(monkeypatch, tokenizer, capsys):
    assert cli.build_parser().parse_args(["serve"]).max_request_body_bytes == DEFAULT_MAX_BODY_BYTES == 16 * 1024**2
    seen = {}

    def fake_build_app(*args, batch_settings, max_body_bytes, **_):
        seen["max_body_bytes"] = max_body_bytes
        raise SystemExit(0)

    serve_with_engine(monkeypatch, lambda config: FakeEngine(tokenizer, [PARIS]))
    monkeypatch.setattr("hybridserve.serving.app.build_app", fake_build_app)
    with pytest.raises(SystemExit):
        cli.main(["serve", "--max-request-body-bytes", "1MiB"])
    assert seen == {"max_body_bytes": 1024**2}
    with pytest.raises(SystemExit) as exit_info:
        cli.main(["serve", "--max-request-body-bytes", "0"])
    assert exit_info.value.code == 2
    assert "--max-request-body-bytes: must be at least 1, got 0" in capsys.readouterr().err


LONG = "word " * 4000  # 20,000 characters: tokenized on a worker thread


class Gate:
    """Holds the work that calls `wait()` until /health has answered. Work on the event loop would wait in vain
    (nothing else could run there, /health included) until its 5 s ran out."""

    def __init__(self) -> None:
        self.reached = threading.Event()
        self.health_answered = threading.Event()
        self.waited_in_vain: list[bool] = []

    def wait(self) -> None:
        self.reached.set()
        self.waited_in_vain.append(not self.health_answered.wait(5))

    def run(self, app, path: str, body: dict) -> tuple[httpx.Response, httpx.Response]:
        """POSTs `body`, asks /health once the gated work has begun, then lets the work go on."""

        async def scenario() -> tuple[httpx.Response, httpx.Response]:
            transport = httpx.ASGITransport(app)
            async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=30) as client:
                large = asyncio.create_task(client.post(path, json=body))
                await asyncio.to_thread(self.reached.wait, 5)
                health = await client.get("/health")
                self.health_answered.set()
                return health, await large

        health, large = asyncio.run(scenario())
        assert (health.status_code, health.json()["status"]) == (200, "ok")
        return health, large


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": LONG}], "max_tokens": 1}),
        ("/v1/completions", {"prompt": LONG, "max_tokens": 1}),
        ("/v1/responses", {"input": LONG, "max_output_tokens": 1}),
    ],
)
def test_tokenizing_a_long_prompt_does_not_hold_up_other_requests(tokenizer, monkeypatch, path, body):
    assert len(LONG) > OFF_LOOP_SIZE
    gate = Gate()
    encode = tokenizer.encode

    def slow_encode(text, **kwargs):
        if len(text) > OFF_LOOP_SIZE:
            gate.wait()
        return encode(text, **kwargs)

    monkeypatch.setattr(tokenizer, "encode", slow_encode)
    _, large = gate.run(build_app(FakeEngine(tokenizer, [PARIS], max_model_len=10_000), None), path, body)
    assert large.status_code == 200
    assert gate.waited_in_vain == [False]


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/responses"])
def test_checking_a_large_tool_schema_does_not_hold_up_other_requests(tokenizer, monkeypatch, path):
    gate = Gate()
    validator_for = tools.validator_for

    class GatedValidator:
        def __init__(self, schema) -> None:
            self.validator = validator_for(schema)

        def check_schema(self, schema) -> None:
            gate.wait()
            self.validator.check_schema(schema)

    monkeypatch.setattr(tools, "validator_for", GatedValidator)
    fields = {f"field_{i}": {"type": "string", "description": f"{path}: field {i} of a long form"} for i in range(60)}
    parameters = {"type": "object", "properties": fields}  # unique to this test: never a cached check
    assert len(json.dumps(parameters)) > tools.OFF_LOOP_SCHEMA_CHARS
    function = {"name": "fill_form", "parameters": parameters}
    if path == "/v1/responses":
        body = {"input": "hi", "tools": [{"type": "function", **function}]}
    else:
        body = {"messages": QUESTION, "tools": [{"type": "function", "function": function}]}
    _, large = gate.run(build_app(FakeEngine(tokenizer, [PARIS], max_model_len=10_000), None), path, body)
    assert large.status_code == 200
    assert gate.waited_in_vain == [False]
