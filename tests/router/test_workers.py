"""Real engine workers on loopback behind one frontend: identity checks, routing, the KV index against the
workers' caches, and faults (kill -9 under concurrent streams, SIGSTOP) that fail only the requests the
worker held, then the worker rejoining.

Two good workers (`hybridserve worker`, default model) and one whose block size differs are shared by the
module; the frontend is a `hybridserve serve --worker ...` process, with a short heartbeat deadline.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import msgspec
import pytest
import zmq

from hybridserve.config import DeploymentConfig, EngineConfig
from hybridserve.engine.cache.events import CachedSet
from hybridserve.engine.protocol import GetCachedSet, Hello, Refused, Welcome, protocol_fingerprint
from hybridserve.router.deploy import build_engine
from hybridserve.sampling_params import SamplingParams

TIMEOUT_S = 240.0
WORKER_TIMEOUT_S = 3.0
ENGINE_FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "192MiB", "--num-threads", "1"]
PROMPTS = [
    "Name a color.",
    "What is two plus two?",
    "Say hello in French.",
    "Name a planet.",
    "What is the capital of Italy?",
    "Count to five.",
    "Name a fruit.",
    "What is water made of?",
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Proc:
    """A child in its own process group, stopped by group at the end."""

    def __init__(self, argv: list[str], log: Path) -> None:
        self.log = log
        self.popen = subprocess.Popen(argv, stdout=log.open("wb"), stderr=subprocess.STDOUT, start_new_session=True)

    def signal(self, sig: int) -> None:
        os.killpg(self.popen.pid, sig)

    def stop(self) -> None:
        if self.popen.poll() is None:
            self.signal(signal.SIGTERM)
            try:
                self.popen.wait(20)
            except subprocess.TimeoutExpired:
                self.signal(signal.SIGKILL)
                self.popen.wait(20)


def _worker(model: Path, port: int, log: Path, *extra: str) -> Proc:
    argv = [
        sys.executable,
        "-m",
        "hybridserve.serving.cli",
        "worker",
        str(model),
        "--listen",
        f"tcp://127.0.0.1:{port}",
        *ENGINE_FLAGS,
        *extra,
    ]
    return Proc(argv, log)


def _wait_until(check, what: str, timeout_s: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.25)
    raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}")


def _health(base: str) -> dict:
    try:
        r = httpx.get(f"{base}/health", timeout=5)
    except httpx.HTTPError:
        return {}
    return r.json()


def _states(base: str) -> dict[str, str]:
    return {w["name"]: w["state"] for w in _health(base).get("workers", [])}


def _hello(url: str, protocol: str) -> Welcome | Refused:
    ctx = zmq.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(url)
        sock.send(msgspec.msgpack.encode(Hello("test-probe", "s1", "", protocol)))
        assert sock.poll(int(TIMEOUT_S * 1000)), f"{url} did not answer"
        return msgspec.msgpack.decode(sock.recv(), type=Welcome | Refused)
    finally:
        ctx.destroy(linger=0)


def _welcome(url: str) -> Welcome:
    reply = _hello(url, protocol_fingerprint())
    assert isinstance(reply, Welcome), reply
    return reply


@pytest.fixture(scope="module")
def workers(smollm2_dir: Path, tmp_path_factory) -> Iterator[dict[str, object]]:
    logs = tmp_path_factory.mktemp("workers")
    ports = {name: _free_port() for name in ("a", "b", "odd")}
    procs = {
        "a": _worker(smollm2_dir, ports["a"], logs / "a.log"),
        "b": _worker(smollm2_dir, ports["b"], logs / "b.log"),
        "odd": _worker(smollm2_dir, ports["odd"], logs / "odd.log", "--block-size", "32"),
    }
    urls = {name: f"tcp://127.0.0.1:{port}" for name, port in ports.items()}
    try:
        for name in procs:
            _welcome(urls[name])  # loaded and serving
        yield {"procs": procs, "urls": urls, "logs": logs, "model": smollm2_dir}
    finally:
        for proc in procs.values():
            proc.stop()


@pytest.fixture(scope="module")
def frontend(workers, tmp_path_factory) -> Iterator[str]:
    port = _free_port()
    urls = workers["urls"]
    argv = [
        sys.executable,
        "-m",
        "hybridserve.serving.cli",
        "serve",
        str(workers["model"]),
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path_factory.mktemp("data")),
        "--worker-timeout",
        str(WORKER_TIMEOUT_S),
        "--served-model-name",
        "smollm2",
    ]
    for name in ("a", "b", "odd"):
        argv += ["--worker", urls[name]]
    proc = Proc(argv, workers["logs"] / "frontend.log")
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_until(
            lambda: _states(base).get(urls["b"]) == "up" and _states(base).get(urls["a"]) == "up",
            "the frontend and its two good workers",
        )
        yield base
    finally:
        proc.stop()


def _chat(base: str, content: str, **extra) -> httpx.Response:
    body = {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": 16,
        "messages": [{"role": "user", "content": content}],
        **extra,
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def _decisions(base: str) -> dict[tuple[str, str], float]:
    """router decisions by (worker, outcome)."""
    out = {}
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith("hybridserve:router_decisions_total{"):
            labels = dict(kv.split("=", 1) for kv in line[line.index("{") + 1 : line.index("}")].split(","))
            out[(labels["worker"].strip('"'), labels["outcome"].strip('"'))] = float(line.rsplit(" ", 1)[1])
    return out


def test_a_mismatched_worker_is_refused_with_both_values_named(frontend, workers) -> None:
    odd = workers["urls"]["odd"]
    # It may answer after the good workers at start-up (then it is down until its first retry, a second later).
    _wait_until(lambda: _states(frontend).get(odd) == "refused", "the mismatched worker refused", 30)
    health = _health(frontend)
    worker = next(w for w in health["workers"] if w["name"] == odd)
    assert worker["state"] == "refused"
    assert worker["error"].startswith("block_size 32 != 16 (the deployment's, set by worker tcp://127.0.0.1:")
    assert health["status"] == "ok"


def test_a_frontend_speaking_another_protocol_is_refused(workers) -> None:
    """Messages travel as arrays: a frontend of another hybridserve build would misread fields silently, so the
    worker compares message-layout fingerprints at Hello (an old frontend sends none)."""
    ours = protocol_fingerprint()
    for theirs, named in (("0123456789abcdef", "0123456789abcdef"), ("", "none")):
        reply = _hello(workers["urls"]["a"], theirs)
        assert reply == Refused(f"protocol {named} != {ours} (the frontend's and this worker's hybridserve differ)"), (
            reply
        )


def test_kv_aware_sends_a_conversation_back_to_the_worker_holding_its_prefix(frontend) -> None:
    system = "You are a careful assistant who answers in one short sentence. " * 6
    first = _chat(frontend, system + "Name a river.")
    assert first.status_code == 200
    before = _decisions(frontend)
    again = _chat(frontend, system + "Name a mountain.")
    assert again.status_code == 200
    after = _decisions(frontend)
    hits = {
        key: after[key] - before.get(key, 0) for key in after if key[1] == "hit" and after[key] > before.get(key, 0)
    }
    assert len(hits) == 1, (before, after)
    assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] >= 64


def test_the_choices_of_one_request_go_to_one_worker(frontend) -> None:
    before = _decisions(frontend)
    r = _chat(frontend, "Name a bird.", n=3)
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    after = _decisions(frontend)
    assert sum(after.values()) - sum(before.values()) == 1


def test_the_router_index_equals_each_workers_cache(workers, smollm2_dir: Path) -> None:
    """An in-process frontend over the two good workers: after a workload its index is, block for block,
    what each worker reports it holds."""
    urls = [workers["urls"]["a"], workers["urls"]["b"]]
    config = EngineConfig.of(model=str(smollm2_dir), dtype="float32", kv_cache_prefault=False)
    engine = build_engine(config, DeploymentConfig(workers=urls, worker_timeout=WORKER_TIMEOUT_S))
    router = engine.client

    async def run() -> None:
        ids = [engine.tokenizer.encode((p + " ") * 10) for p in PROMPTS]  # several full blocks each
        params = SamplingParams(max_tokens=4, temperature=0)

        async def one(i: int) -> None:
            async for _ in engine.generate(ids[i % len(ids)], params, f"index-{i}"):
                pass

        await asyncio.gather(*(one(i) for i in range(12)))
        await asyncio.sleep(0.5)  # the last event batches are on their way
        held = [await _wait_synced(router, url) for url in urls]
        assert all(held), f"blocks held per worker: {held}"  # both workers served and cached something

    try:
        asyncio.run(run())
    finally:
        engine.shutdown()


async def _wait_synced(router, url: str) -> int:
    """Waits until the router's index has the worker's latest batch, checks they agree; the blocks it holds."""
    ctx = zmq.asyncio.Context()
    try:
        sock = ctx.socket(zmq.DEALER)
        sock.connect(url)
        sock.send(msgspec.msgpack.encode(Hello("index-check", "s1", "", protocol_fingerprint())))
        await sock.recv()  # Welcome
        deadline = time.monotonic() + 10
        while True:
            sock.send(msgspec.msgpack.encode(GetCachedSet()))
            actual = msgspec.msgpack.decode(await sock.recv(), type=CachedSet)
            mirror = router.index.workers[url]
            if mirror.seq == actual.seq or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.1)
        assert mirror.seq == actual.seq
        assert mirror.blocks == set(actual.blocks)
        assert mirror.snapshots == set(actual.snapshots)
        return len(actual.blocks)
    finally:
        ctx.destroy(linger=0)


def _stream(
    base: str, content: str, max_tokens: int, streaming: Callable[[], None] = lambda: None
) -> tuple[list[str], dict | None]:
    """A streamed greedy chat completion of exactly `max_tokens` tokens: its text pieces and the error object,
    if the stream ended with one. `streaming()` is called once its second piece has arrived."""
    body = {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        "stream": True,
        "messages": [{"role": "user", "content": content}],
    }
    pieces: list[str] = []
    with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
        if r.status_code != 200:
            return pieces, json.loads(r.read())["error"]
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if "error" in chunk:
                return pieces, chunk["error"]
            for choice in chunk["choices"]:
                pieces.append(choice["delta"].get("content") or "")
                if len(pieces) == 2:
                    streaming()
    return pieces, None


def test_kill_9_fails_only_the_dead_workers_streams_and_it_rejoins(frontend, workers) -> None:
    urls, procs = workers["urls"], workers["procs"]
    # 32 tokens: enough that all 16 streams are under way when the worker dies, none finished
    prompts = PROMPTS * 2  # 16 concurrent streams over the two workers
    streaming = threading.Semaphore(0)

    async def run() -> list[tuple[list[str], dict | None]]:
        loop = asyncio.get_running_loop()
        with ThreadPoolExecutor(len(prompts)) as pool:
            tasks = [loop.run_in_executor(pool, _stream, frontend, p, 32, streaming.release) for p in prompts]
            for _ in prompts:  # every stream is under way, none can have finished
                assert await loop.run_in_executor(None, streaming.acquire, True, TIMEOUT_S), "a stream never started"
            procs["b"].signal(signal.SIGKILL)
            return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    failed = [(p, err) for p, (_, err) in zip(prompts, results, strict=True) if err is not None]
    finished = [(p, "".join(pieces)) for p, (pieces, err) in zip(prompts, results, strict=True) if err is None]
    assert failed and finished, results
    for _, error in failed:
        assert error["code"] == "engine_unavailable", error
        assert f"engine worker {urls['b']} went down" in error["message"]
    _wait_until(lambda: _states(frontend).get(urls["b"]) == "down", "the dead worker marked down", 30)
    assert all(_chat(frontend, p).status_code == 200 for p in PROMPTS[:4])  # new requests avoid it
    procs["b"] = _worker(workers["model"], int(urls["b"].rsplit(":", 1)[1]), workers["logs"] / "b2.log")
    # The finished streams against the same requests streamed one at a time (greedy: the same on any worker),
    # while the restarted worker loads its model.
    expected = {}
    for prompt in dict.fromkeys(p for p, _ in finished):
        pieces, error = _stream(frontend, prompt, 32)
        assert error is None, error
        expected[prompt] = "".join(pieces)
    for prompt, text in finished:
        assert text == expected[prompt]
    _wait_until(lambda: _states(frontend).get(urls["b"]) == "up", "the restarted worker rejoining")


def test_a_stopped_worker_is_bounded_by_the_heartbeat_deadline(frontend, workers) -> None:
    urls, procs = workers["urls"], workers["procs"]
    _wait_until(lambda: _states(frontend).get(urls["a"]) == _states(frontend).get(urls["b"]) == "up", "both up")
    procs["a"].signal(signal.SIGSTOP)
    try:
        start = time.monotonic()
        results = [_stream(frontend, p, 24) for p in PROMPTS[:4]]  # some land on the stopped worker
        assert time.monotonic() - start < 4 * WORKER_TIMEOUT_S + 60
        assert any(err is None for _, err in results)
        for _, err in results:
            assert err is None or err["code"] == "engine_unavailable", err
        _wait_until(lambda: _states(frontend).get(urls["a"]) == "down", "the stopped worker marked down", 30)
    finally:
        procs["a"].signal(signal.SIGCONT)
    _wait_until(lambda: _states(frontend).get(urls["a"]) == "up", "the resumed worker rejoining", 60)
