"""Shared test helpers: scripted tokens, SSE parsing, error bodies, a raw ASGI driver, a threaded server."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import uvicorn

from tests.serving.openapi_schema import check

# "The capital of France is Paris." then EOS (id 2, which decodes to "" with skip_special_tokens).
PARIS = [504, 3575, 282, 4649, 314, 7042, 30, 2]
PARIS_PIECES = ["The", " capital", " of", " France", " is", " Paris", "."]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def chat_prompt(tokenizer, messages=QUESTION) -> list[int]:
    text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    return tokenizer.encode(text, add_special_tokens=False)


def sse_payloads(text: str) -> list:
    """The `data:` payloads of an SSE body, JSON-decoded except the final "[DONE]"."""
    assert text.endswith("\n\n"), text[-50:]
    events = text.split("\n\n")[:-1]
    assert all(e.startswith("data: ") for e in events), events
    return [e[6:] if e[6:] == "[DONE]" else json.loads(e[6:]) for e in events]


def without_ids(body: dict) -> dict:
    """The body with what differs between two identical requests (ids, timestamps) taken out."""
    text = json.dumps(body)
    for key in ("id", "created", "created_at", "completed_at"):
        text = text.replace(json.dumps(body.get(key)), "null") if key in body else text
    body = json.loads(text)
    for item in body.get("output", []):
        item.pop("id", None)
    return body


def error_body(message: str, type: str = "invalid_request_error", param=None, code=None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def assert_error(r, status, message, param=None, code=None, type="invalid_request_error"):
    """`r` is exactly this OpenAI error, in the shape of OpenAI's ErrorResponse schema."""
    assert (r.status_code, r.json()) == (status, error_body(message, type, param, code))
    check(r.json(), "ErrorResponse")


async def call_until_disconnect(app, path: str, body: dict, disconnect_after: asyncio.Event) -> list[dict]:
    """Sends one POST straight to the ASGI app; the client disconnects once `disconnect_after` is set.

    Returns the ASGI messages the app sent.
    """
    sent: list[dict] = []
    pending = [{"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}]

    async def receive() -> dict:
        if pending:
            return pending.pop()
        await disconnect_after.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    await asyncio.wait_for(app(post_scope(path), receive, send), 10)
    return sent


def post_scope(path: str, headers: list[tuple[bytes, bytes]] = ()) -> dict:
    """The ASGI scope of a JSON POST to `path` from a loopback client."""
    return {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), *headers],
        "client": ("127.0.0.1", 50000),
        "server": ("127.0.0.1", 8000),
    }


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """Serves `app` with uvicorn on a free local port in a background thread; yields the base URL.

    For clients that need a real socket (their own HTTP stack, streaming as it arrives)."""
    config = uvicorn.Config(app, host="127.0.0.1", port=0, log_config=None, log_level="warning", lifespan="on")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.01)
    host, port = server.servers[0].sockets[0].getsockname()[:2]
    try:
        yield f"http://{host}:{port}"
    finally:
        server.should_exit = True
        thread.join(10)


def serve_with_engine(monkeypatch, build) -> None:
    """`hybridserve serve` / `run-batch` get their engine from `build(config)` instead of starting workers."""
    import sys
    import types

    module = types.ModuleType("hybridserve.router.deploy")
    module.build_engine = lambda config, deployment=None, serving=None, on_fatal=None: build(config)
    monkeypatch.setitem(sys.modules, "hybridserve.router.deploy", module)


@contextlib.contextmanager
def small_disk(path: Path, size: int) -> Iterator[Path]:
    """`path` as a filesystem of `size` bytes (a tmpfs; mounting one needs root, as CI has), unmounted after."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)], capture_output=True, text=True, timeout=30
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a {size}-byte tmpfs here: {mounted.stderr.strip()}")
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=True, timeout=30)
