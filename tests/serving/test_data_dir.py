"""The data directory: one server per --data-dir (a second one on it refuses to start and touches nothing), and
its database's errors reach callers as they are."""

import os
import sqlite3
import time

import pytest
from fastapi.testclient import TestClient

from hybridserve.serving import cli
from hybridserve.serving.app import build_app
from hybridserve.serving.storage import Database, DataDir, DataDirInUse
from tests.serving.fake_engine import FakeEngine
from tests.serving.helpers import PARIS, serve_with_engine
from tests.serving.openai.responses.test_responses import ASK, TEXT
from tests.serving.openai.responses.test_responses_background import wait_for


def test_a_second_app_on_the_same_dir_refuses_and_the_first_keeps_working(tokenizer, tmp_path):
    engine = FakeEngine(tokenizer, [PARIS])
    engine.pause_at_step = 2
    with TestClient(build_app(engine, None, tmp_path)) as first:
        rid = first.post("/v1/responses", json={"input": ASK, "background": True}).json()["id"]
        wait(engine.paused.is_set)
        with pytest.raises(DataDirInUse) as refused:
            build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path)
        assert str(refused.value) == (
            f"the data directory {tmp_path} is in use by another hybridserve server (pid {os.getpid()}); "
            "stop it or choose another --data-dir"
        )
        assert first.get(f"/v1/responses/{rid}").json()["status"] != "failed"  # its run was not taken over
        engine.resume.set()
        done = wait_for(first, rid, "completed")
        assert done["output"][0]["content"][0]["text"] == TEXT
        assert first.post("/v1/responses", json={"input": ASK}).json()["status"] == "completed"
    with TestClient(build_app(FakeEngine(tokenizer, [PARIS]), None, tmp_path)) as again:  # released at shutdown
        assert again.get(f"/v1/responses/{rid}").json() == done


def wait(condition) -> None:
    deadline = time.monotonic() + 10
    while not condition():
        assert time.monotonic() < deadline
        time.sleep(0.01)


def test_a_second_server_exits_before_loading_its_model(monkeypatch, capsys, data_dir):
    loaded = []
    serve_with_engine(monkeypatch, loaded.append)
    held = DataDir(data_dir)
    try:
        with pytest.raises(SystemExit) as exit_info:
            cli.main(["serve", "--data-dir", str(data_dir)])
    finally:
        held.close()
    assert exit_info.value.code == 1 and loaded == []
    assert capsys.readouterr().err == (
        f"hybridserve serve: error: the data directory {data_dir} is in use by another hybridserve server "
        f"(pid {os.getpid()}); stop it or choose another --data-dir\n"
    )
    DataDir(data_dir).close()  # free again once its holder let go


def test_a_full_database_fails_a_transaction_with_its_own_error(tmp_path):
    """SQLite rolls back by itself on SQLITE_FULL; the caller must see "full", not a failed ROLLBACK."""
    db = Database(tmp_path / "db.sqlite3")
    db.script("CREATE TABLE t (x TEXT)")
    db.execute("PRAGMA max_page_count = 1")  # never below the current size: full as it is
    with pytest.raises(sqlite3.OperationalError, match="^database or disk is full$"), db.transaction() as conn:
        conn.execute("INSERT INTO t VALUES (?)", ("x" * 10_000,))
    with db.transaction() as conn:  # the connection is usable again
        assert conn.execute("SELECT COUNT(*) FROM t").fetchone() == (0,)
