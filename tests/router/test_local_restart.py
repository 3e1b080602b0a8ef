"""A local engine worker that cannot start again makes the server exit non-zero. (One killed with SIGKILL and
started again is tested on the supervised server of tests/e2e/test_e2e_server.py, which SIGTERM then
ends: one server start-up for both.)"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
from pathlib import Path

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
