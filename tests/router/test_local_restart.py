"""A local engine worker killed with SIGKILL: its requests fail cleanly, the frontend starts it again (logged,
counted) and serves within seconds; one that cannot start again makes the server exit non-zero."""

from __future__ import annotations

import json
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest

from tests.router.test_workers import TIMEOUT_S, Proc, _free_port, _health, _wait_until

FLAGS = ["--dtype", "float32", "--kv-cache-memory-bytes", "128MiB", "--worker-timeout", "3"]


def _serve(model: Path, tmp_path: Path) -> tuple[Proc, str]:
    port = _free_port()
    argv = [
        sys.executable,
        "-m",
        "hybridserve.serving.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--data-dir",
        str(tmp_path / "data"),
        "--served-model-name",
        "smollm2",
        *FLAGS,
    ]
    proc = Proc(argv, tmp_path / "serve.log")
    base = f"http://127.0.0.1:{port}"
    _wait_until(lambda: [w["state"] for w in _health(base).get("workers", [])] == ["up"], "the server")
    return proc, base


def _engine_worker(proc: Proc) -> psutil.Process:
    """The frontend's child holding the model: the largest one."""
    children = psutil.Process(proc.popen.pid).children(recursive=True)
    return max(children, key=lambda c: c.memory_info().rss)


def _ask(base: str) -> httpx.Response:
    body = {
        "model": "smollm2",
        "temperature": 0,
        "max_tokens": 12,
        "messages": [{"role": "user", "content": "What is the capital of France?"}],
    }
    return httpx.post(f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S)


def _metric(base: str, name: str) -> float:
    for line in httpx.get(f"{base}/metrics", timeout=10).text.splitlines():
        if line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no {name} in /metrics")


def test_a_killed_local_worker_is_started_again(smollm2_dir: Path, tmp_path: Path) -> None:
    proc, base = _serve(smollm2_dir, tmp_path)
    try:
        body = {
            "model": "smollm2",
            "temperature": 0,
            "max_tokens": 400,
            "stream": True,
            "ignore_eos": True,
            "messages": [{"role": "user", "content": "Tell me a long story."}],
        }
        error = None
        with httpx.stream("POST", f"{base}/v1/chat/completions", json=body, timeout=TIMEOUT_S) as r:
            for i, line in enumerate(r.iter_lines()):
                if i == 4:
                    _engine_worker(proc).send_signal(signal.SIGKILL)
                if line.startswith("data: {") and "error" in (chunk := json.loads(line[6:])):
                    error = chunk["error"]
        assert error is not None and error["code"] == "engine_unavailable", error
        assert "engine worker local-0 went down: its process exited (exit code -9)" in error["message"]
        _wait_until(lambda: [w["state"] for w in _health(base).get("workers", [])] == ["up"], "the restart", 120)
        r = _ask(base)
        assert (
            r.status_code == 200 and r.json()["choices"][0]["message"]["content"] == "The capital of France is Paris."
        )
        assert _metric(base, "hybridserve:worker_restarts_total") == 1
        assert "worker local-0: starting its process again (restart 1)" in (tmp_path / "serve.log").read_text()
    finally:
        proc.stop()


@pytest.mark.slow
def test_a_worker_that_cannot_start_again_ends_the_server_with_an_error(smollm2_dir: Path, tmp_path: Path) -> None:
    model = tmp_path / "model"
    shutil.copytree(smollm2_dir, model)
    proc, base = _serve(model, tmp_path)
    try:
        shutil.rmtree(model)  # the next start of the worker cannot load it
        _engine_worker(proc).send_signal(signal.SIGKILL)
        assert proc.popen.wait(TIMEOUT_S) == 1
        log = (tmp_path / "serve.log").read_text()
        assert "hybridserve serve: worker local-0 failed to start 3 times in a row" in log
    finally:
        proc.stop()
    assert not subprocess.run(["pgrep", "-f", str(model)], capture_output=True).stdout
