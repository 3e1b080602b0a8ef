"""End to end: a real `hybridserve serve` subprocess (the embedded SmolLM2-135M) driven by the openai SDK."""

import asyncio
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import psutil
import pytest

KEY = "sk-e2e"
MAX_MODEL_LEN = 2048
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
REPO = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def running_server(log: Path, *args: str, env: dict[str, str] | None = None) -> Iterator[tuple[str, subprocess.Popen]]:
    """A real `hybridserve serve [args]` subprocess, healthy, stopped (SIGINT) on exit."""
    port = free_port()
    cmd = [
        sys.executable,
        "-m",
        "hybridserve.serving.cli",
        "serve",
        *args,
        "--port",
        str(port),
        "--api-key",
        KEY,
        "--max-model-len",
        str(MAX_MODEL_LEN),
        "--kv-cache-memory-bytes",
        "256MiB",
        "--data-dir",
        str(log.parent / "data"),
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, cwd=REPO, stdout=out, stderr=subprocess.STDOUT, env=env or os.environ.copy())
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 120
    while True:
        if proc.poll() is not None:
            pytest.fail(f"server exited with {proc.returncode}:\n{log.read_text()[-4000:]}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            proc.kill()
            pytest.fail(f"server not healthy after 120 s:\n{log.read_text()[-4000:]}")
        time.sleep(0.5)
    try:
        yield url, proc
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module", params=[1, 2], ids=["one-worker", "two-workers"])
def server(tmp_path_factory, request):
    """The server with one local engine worker, and once more with two behind the kv_aware router."""
    log = tmp_path_factory.mktemp("server") / "server.log"
    with running_server(log, "--num-workers", str(request.param)) as (url, _):
        yield url
    text = log.read_text()
    assert "hybridserve ready: serving smollm2 at http://127.0.0.1:" in text
    # each process that serves keeps its start-up heap out of the collector's walks (no 100-200 ms pauses)
    assert len(re.findall(r"frontend: \d+ objects from start-up kept out of garbage collection", text)) == 1
    frozen = re.findall(r"engine worker: \d+ objects from start-up kept out of garbage collection", text)
    assert len(frozen) == request.param


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)


def chat(client, **kwargs):
    kwargs.setdefault("model", "smollm2")
    return client.chat.completions.create(messages=kwargs.pop("messages", QUESTION), **kwargs)


def metric(url: str, name: str) -> float:
    """The metric summed over its series (engine gauges have one per worker)."""
    text = httpx.get(url + "/metrics").text
    values = re.findall(rf"^{re.escape(name)}{{[^}}]*}} (\S+)$", text, re.M)
    assert values, f"{name} missing from /metrics"
    return sum(map(float, values))


def test_models(client):
    [model] = client.models.list().data
    assert (model.id, model.owned_by, model.model_extra["max_model_len"]) == (
        "smollm2",
        "hybridserve",
        MAX_MODEL_LEN,
    )


def test_greedy_chat_knows_paris(client):
    r = chat(client, temperature=0, max_tokens=32)
    assert "Paris" in r.choices[0].message.content
    assert r.choices[0].finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == 37  # SmolLM2's template around the question
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens
    assert 0 < r.usage.completion_tokens <= 32


def test_chat_stream_matches_non_stream(client):
    full = chat(client, temperature=0, max_tokens=24)
    chunks = list(chat(client, temperature=0, max_tokens=24, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == full.choices[0].finish_reason
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens


def test_completions(client):
    r = client.completions.create(model="smollm2", prompt="The capital of France is", max_tokens=8, temperature=0)
    assert r.choices[0].text and r.choices[0].finish_reason in ("stop", "length")
    batch = client.completions.create(
        model="smollm2", prompt=["One, two,", "The capital of France is"], max_tokens=8, temperature=0
    )
    assert [c.index for c in batch.choices] == [0, 1] and all(c.text for c in batch.choices)


def test_logprobs(client):
    r = chat(client, temperature=0, max_tokens=5, logprobs=True, top_logprobs=3, extra_body={"ignore_eos": True})
    content = r.choices[0].logprobs.content
    assert len(content) == 5 == r.usage.completion_tokens
    for entry in content:
        assert len(entry.top_logprobs) == 3
        assert [t.logprob for t in entry.top_logprobs] == sorted((t.logprob for t in entry.top_logprobs), reverse=True)
        assert entry.token == entry.top_logprobs[0].token  # greedy takes the best token
        assert entry.logprob == pytest.approx(entry.top_logprobs[0].logprob, abs=1e-4) and entry.logprob <= 0
    c = client.completions.create(
        model="smollm2",
        prompt="The capital of France is",
        max_tokens=4,
        temperature=0,
        logprobs=2,
        extra_body={"ignore_eos": True},
    )
    lp = c.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset) == 4


def test_n2(client):
    r = chat(client, temperature=1, max_tokens=8, n=2, seed=5)
    assert [c.index for c in r.choices] == [0, 1]
    assert all(c.message.content for c in r.choices)


def test_stop_strings(client):
    base = chat(client, temperature=0, max_tokens=32).choices[0].message.content
    words = base.split()
    assert len(words) >= 3, base
    stop = " " + words[2]
    cut = chat(client, temperature=0, max_tokens=32, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].message.content == base[: base.index(stop)]


def test_seed_reproducible_at_temperature_1(client):
    a = chat(client, temperature=1, max_tokens=16, seed=1234).choices[0].message.content
    b = chat(client, temperature=1, max_tokens=16, seed=1234).choices[0].message.content
    assert a == b


def test_bad_inputs(client, server):
    with pytest.raises(openai.NotFoundError) as info:
        chat(client, model="gpt-4o")
    assert info.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, temperature=-1)
    assert info.value.param == "temperature"
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, messages=[{"role": "user", "content": "Paris " * 3000}])
    assert f"maximum context length is {MAX_MODEL_LEN} tokens" in info.value.message
    with pytest.raises(openai.BadRequestError) as info:
        chat(client, max_tokens=MAX_MODEL_LEN)
    assert f"(37 in the messages, {MAX_MODEL_LEN} in the completion)" in info.value.message
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server + "/v1", api_key="wrong", max_retries=0).models.list()
    assert chat(client, temperature=0, max_tokens=4).choices[0].message.content  # still serving


def test_concurrent_requests(server):
    async def main():
        aclient = openai.AsyncOpenAI(base_url=server + "/v1", api_key=KEY, max_retries=0, timeout=120)
        prompts = [f"Count from {i} to {i + 5}." for i in range(8)]
        return await asyncio.gather(
            *[
                aclient.chat.completions.create(
                    model="smollm2", messages=[{"role": "user", "content": p}], max_tokens=16, temperature=0
                )
                for p in prompts
            ]
        )

    for r in asyncio.run(main()):
        assert r.choices[0].message.content and r.usage.completion_tokens > 0


def test_disconnect_frees_blocks(server):
    body = {"model": "smollm2", "messages": QUESTION, "max_tokens": 1500, "stream": True, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    with httpx.stream("POST", server + "/v1/chat/completions", json=body, headers=headers, timeout=60) as r:
        lines = r.iter_lines()
        for _ in range(6):
            next(lines)
    deadline = time.monotonic() + 15
    while metric(server, "hybridserve:num_requests_running") or metric(server, "hybridserve:kv_cache_usage_perc"):
        assert time.monotonic() < deadline, "the aborted request still holds KV blocks"
        time.sleep(0.2)
    text = httpx.get(server + "/metrics").text
    assert re.search(r'hybridserve:request_outcome_total\{model_name="smollm2",outcome="abort"\} [1-9]', text)


def test_responses_knows_paris(client):
    r = client.responses.create(
        model="smollm2", input="What is the capital of France?", temperature=0, max_output_tokens=32
    )
    assert "Paris" in r.output_text and r.status in ("completed", "incomplete")
    assert r.usage.input_tokens == 37 and 0 < r.usage.output_tokens <= 32
    assert client.responses.retrieve(r.id).output_text == r.output_text
    with client.responses.stream(
        model="smollm2", input="What is the capital of France?", temperature=0, max_output_tokens=32
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
        final = stream.get_final_response() if r.status == "completed" else None
    assert "".join(deltas) == r.output_text
    if final is not None:
        assert final.output_text == r.output_text


def test_anthropic_sdk_knows_paris(server):
    """The Messages API on the real model: the anthropic SDK's create, stream and count_tokens agree."""
    import anthropic

    client = anthropic.Anthropic(base_url=server, api_key=KEY, max_retries=0, timeout=120)
    # this SDK has no sampling arguments any more; the server still reads them, sent as extra fields
    request = {"model": "smollm2", "max_tokens": 32, "messages": QUESTION, "extra_body": {"temperature": 0}}
    m = client.messages.create(**request)
    [block] = m.content
    assert "Paris" in block.text and m.stop_reason in ("end_turn", "max_tokens")
    assert m.usage.input_tokens + m.usage.cache_read_input_tokens == 37 and 0 < m.usage.output_tokens <= 32
    with client.messages.stream(**request) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == block.text and (final.stop_reason, final.usage.output_tokens) == (
        m.stop_reason,
        m.usage.output_tokens,
    )
    assert client.messages.count_tokens(model="smollm2", messages=QUESTION).input_tokens == 37


CITY_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string"}, "country": {"type": "string", "enum": ["France", "Italy"]}},
    "required": ["city", "country"],
}


def test_chat_json_schema_is_enforced(client):
    r = client.chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Name a city in France."}],
        response_format={"type": "json_schema", "json_schema": {"name": "place", "schema": CITY_SCHEMA}},
        temperature=0,
        max_tokens=48,
    )
    assert r.choices[0].finish_reason == "stop"
    value = json.loads(r.choices[0].message.content)
    assert set(value) == {"city", "country"} and value["country"] in ("France", "Italy")


def test_responses_required_tool_choice_gives_a_valid_call(client):
    tools = [
        {
            "type": "function",
            "name": "get_weather",
            "description": "Current weather in a city.",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
        }
    ]
    r = client.responses.create(
        model="smollm2",
        input="What is the weather in Paris?",
        tools=tools,
        tool_choice="required",
        temperature=0,
        max_output_tokens=64,
    )
    [call] = [item for item in r.output if item.type == "function_call"]
    assert call.name == "get_weather" and isinstance(json.loads(call.arguments)["city"], str)
    assert r.status == "completed"


@pytest.fixture(scope="module")
def supervised(tmp_path_factory) -> Iterator[tuple[str, subprocess.Popen, Path, Path]]:
    """One server with a local engine worker and a post-processing worker, its sockets under a short $TMPDIR,
    for a supervisor's view: the worker killed and started again, then SIGTERM ending it all (in that order;
    one start-up for both). Yields its URL, process, log and socket directory."""
    sockets = Path(tempfile.mkdtemp(prefix="hs-"))  # short: socket paths must fit a Unix socket address
    log = tmp_path_factory.mktemp("supervised") / "server.log"
    try:
        env = {**os.environ, "TMPDIR": str(sockets)}
        with running_server(log, "--num-postprocess-workers", "1", env=env) as (url, proc):
            yield url, proc, log, sockets
    finally:
        shutil.rmtree(sockets, ignore_errors=True)


def _worker_states(url: str) -> list[str]:
    try:
        return [w["state"] for w in httpx.get(url + "/health", timeout=5).json().get("workers", [])]
    except httpx.HTTPError:
        return []


def _until(check, what: str, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out after {timeout_s:g}s waiting for {what}"
        time.sleep(0.25)


def test_a_killed_local_worker_is_started_again(supervised):
    """A local engine worker killed with SIGKILL mid-stream: the stream fails cleanly, the frontend starts it
    again (logged, counted) and serves the same answer. (One that cannot start again: test_local_restart.py.)"""
    url, proc, log, _ = supervised
    headers = {"Authorization": f"Bearer {KEY}"}
    # The frontend's child holding the model: the largest one (the post-processing worker has a tokenizer only).
    children = psutil.Process(proc.pid).children(recursive=True)
    worker = max(children, key=lambda c: c.memory_info().rss)
    body = {"model": "smollm2", "temperature": 0, "max_tokens": 400, "stream": True, "ignore_eos": True}
    body["messages"] = [{"role": "user", "content": "Tell me a long story."}]
    error = None
    with httpx.stream("POST", url + "/v1/chat/completions", json=body, headers=headers, timeout=120) as r:
        for i, line in enumerate(r.iter_lines()):
            if i == 4:
                worker.send_signal(signal.SIGKILL)
            if line.startswith("data: {") and "error" in (chunk := json.loads(line[6:])):
                error = chunk["error"]
    assert error is not None and error["code"] == "engine_unavailable", error
    assert "engine worker local-0 went down: its process exited (exit code -9)" in error["message"]
    _until(lambda: _worker_states(url) == ["up"], "the restart", 120)
    ask = {"model": "smollm2", "temperature": 0, "max_tokens": 12, "messages": QUESTION}
    r = httpx.post(url + "/v1/chat/completions", json=ask, headers=headers, timeout=120)
    assert r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
    assert metric(url, "hybridserve:worker_restarts_total") == 1
    assert "worker local-0: starting its process again (restart 1)" in log.read_text()


def test_sigterm_stops_the_workers_and_removes_their_sockets(supervised):
    """A supervisor's SIGTERM: the server, its engine worker (here the one started again) and post-processing
    worker all exit, and the socket directories they used under $TMPDIR are gone."""
    _, proc, _, sockets = supervised
    names = sorted(p.name for p in sockets.glob("hybridserve-*"))
    pid = proc.pid
    assert [re.sub(rf"-{pid}-\w+$", "", n) for n in names] == ["hybridserve-postprocess", "hybridserve-workers"]
    proc.send_signal(signal.SIGTERM)
    proc.wait(60)
    assert proc.returncode == -signal.SIGTERM  # uvicorn's shutdown re-raises the signal, after ours
    assert list(sockets.glob("hybridserve-*")) == []  # (torch keeps its own compile cache there)


@pytest.mark.slow  # two server start-ups and a third that is refused before it loads a model
def test_one_server_per_data_dir_and_a_killed_one_leaves_its_stream_failed(tmp_path):
    """A second server on a running one's --data-dir exits 1 naming the directory and the holder; the first
    goes on. Killed (SIGKILL) mid-stream, the first leaves the response it streamed failed, never missing."""
    data = tmp_path / "data"  # what running_server passes for logs in tmp_path
    headers = {"Authorization": f"Bearer {KEY}"}
    with running_server(tmp_path / "first.log") as (url, proc):
        refused = subprocess.run(
            [sys.executable, "-m", "hybridserve.serving.cli", "serve", "--data-dir", str(data)],
            cwd=REPO,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert refused.returncode == 1, refused.stderr
        assert refused.stderr.endswith(
            f"hybridserve serve: error: the data directory {data} is in use by another hybridserve server "
            f"(pid {proc.pid}); stop it or choose another --data-dir\n"
        )
        assert httpx.get(url + "/health").status_code == 200
        body = {"model": "smollm2", "input": "Count from one to five hundred.", "max_output_tokens": 1500}
        with httpx.stream("POST", url + "/v1/responses", json={**body, "stream": True}, headers=headers) as r:
            created = json.loads(next(line for line in r.iter_lines() if line.startswith("data: "))[6:])
            proc.send_signal(signal.SIGKILL)
            proc.wait(30)
    rid = created["response"]["id"]
    with running_server(tmp_path / "second.log") as (url, _):
        recovered = httpx.get(f"{url}/v1/responses/{rid}", headers=headers).json()
    assert (recovered["status"], recovered["error"]) == (
        "failed",
        {"code": "server_error", "message": "The server stopped before this response finished."},
    )
