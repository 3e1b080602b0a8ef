"""The app behind a real uvicorn socket, driven by the openai SDK; the fake engine stands in for the model."""

import logging
import threading
import time

import httpx
import openai
import pytest
import uvicorn

from hybridserve.serving.app import build_app
from hybridserve.serving.cli import ReadyServer
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, QUESTION


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())


@pytest.fixture(scope="module")
def served(tokenizer):
    records = _Records()
    logging.getLogger("hybridserve.serve").addHandler(records)
    logging.getLogger("hybridserve.serve").setLevel(logging.INFO)
    engine = FakeEngine(tokenizer, [PARIS])
    config = uvicorn.Config(build_app(engine, "sk-test"), host="127.0.0.1", port=0, log_level="warning")
    server = ReadyServer(config, engine.model_name, engine.shutdown)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not server.started:
        assert time.monotonic() < deadline and thread.is_alive(), "server did not start"
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    assert records.messages == [f"hybridserve ready: serving smollm2 at http://127.0.0.1:{port}/v1"]
    logging.getLogger("hybridserve.serve").removeHandler(records)
    yield engine, f"http://127.0.0.1:{port}"
    server.should_exit = True
    thread.join(10)


@pytest.fixture
def sdk(served):
    return openai.OpenAI(base_url=served[1] + "/v1", api_key="sk-test", max_retries=0)


def test_sdk_parses_every_response(sdk):
    assert [m.id for m in sdk.models.list()] == ["smollm2"]
    chat = sdk.chat.completions.create(model="smollm2", messages=QUESTION, logprobs=True, top_logprobs=1)
    assert chat.choices[0].message.content == "The capital of France is Paris."
    assert chat.choices[0].logprobs.content[0].token == "The"
    assert chat.usage.total_tokens == 45 and chat.usage.prompt_tokens_details.cached_tokens == 0
    stream = sdk.chat.completions.create(
        model="smollm2", messages=QUESTION, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == chat.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == 8
    completion = sdk.completions.create(model="smollm2", prompt="Hi", max_tokens=3, n=2)
    assert [c.index for c in completion.choices] == [0, 1]
    assert (
        "".join(
            c.choices[0].text for c in sdk.completions.create(model="smollm2", prompt="Hi", max_tokens=3, stream=True)
        )
        == "The capital of"
    )


def test_sdk_raises_typed_errors(served, sdk):
    with pytest.raises(openai.NotFoundError) as info:
        sdk.chat.completions.create(model="nope", messages=QUESTION)
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        sdk.chat.completions.create(model="smollm2", messages=QUESTION, temperature=-1)
    assert info.value.param == "temperature"
    bad_key = openai.OpenAI(base_url=served[1] + "/v1", api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad_key.models.list()


@pytest.mark.parametrize("stream", [True, False])
def test_socket_disconnect_aborts(served, stream):
    engine, url = served
    engine.paused.clear()
    engine.resume.clear()
    engine.pause_at_step = 2
    body = {"messages": QUESTION, "stream": stream}
    try:
        with httpx.Client(base_url=url, headers={"Authorization": "Bearer sk-test"}) as client:
            if stream:
                with client.stream("POST", "/v1/chat/completions", json=body) as r:
                    lines = r.iter_lines()  # kept: a dropped line iterator closes the connection at once
                    assert next(lines).startswith("data: ")
                    # The role chunk goes out before the engine request starts: leave only once it is running.
                    deadline = time.monotonic() + 5
                    while not engine.paused.is_set():
                        assert time.monotonic() < deadline, "the engine request never started"
                        time.sleep(0.01)
            else:
                with pytest.raises(httpx.ReadTimeout):
                    client.post("/v1/chat/completions", json=body, timeout=httpx.Timeout(30.0, read=0.5))
        deadline = time.monotonic() + 5
        while engine.running or not engine.aborted:
            assert time.monotonic() < deadline, "engine request still running after the client left"
            time.sleep(0.01)
        assert engine.aborted[-1] == engine.calls[-1][2]
    finally:
        engine.pause_at_step = None
