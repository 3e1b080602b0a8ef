"""/v1/files: the openai SDK's upload / list / retrieve / content / delete, the size limit, and bad uploads."""

import time

import openai
import pytest
from fastapi.testclient import TestClient

from hybridserve.serving.app import build_app
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.storage import DATABASE_FILE, Database
from tests.serving.helpers import error_body, small_disk

DATA = b'{"custom_id": "a", "method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}}\n'


@pytest.fixture
def http(engine, tmp_path):
    settings = BatchSettings(max_upload_bytes=1000)
    with TestClient(build_app(engine, None, tmp_path, batch_settings=settings)) as client:
        yield client


@pytest.fixture
def sdk(http):
    return openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)


def test_sdk_round_trip(sdk, http, tmp_path):
    uploaded = sdk.files.create(file=("in.jsonl", DATA), purpose="batch")
    assert uploaded.id.startswith("file-") and uploaded.expires_at is None
    assert (uploaded.object, uploaded.bytes, uploaded.filename, uploaded.purpose, uploaded.status) == (
        "file",
        len(DATA),
        "in.jsonl",
        "batch",
        "processed",
    )
    assert (tmp_path / "files" / uploaded.id).read_bytes() == DATA  # bytes on disk under --data-dir
    notes = sdk.files.create(file=("notes.txt", b"hello"), purpose="user_data")
    assert sdk.files.retrieve(uploaded.id) == uploaded
    assert sdk.files.content(uploaded.id).content == DATA
    assert [f.id for f in sdk.files.list()] == [notes.id, uploaded.id]  # newest first
    assert [f.id for f in sdk.files.list(purpose="user_data")] == [notes.id]
    assert [f.id for f in sdk.files.list(order="asc")] == [uploaded.id, notes.id]
    page = http.get("/v1/files", params={"limit": 1}).json()
    assert (page["first_id"], page["has_more"]) == (notes.id, True)
    page = http.get("/v1/files", params={"limit": 1, "after": notes.id}).json()
    assert ([f["id"] for f in page["data"]], page["has_more"]) == ([uploaded.id], False)
    deleted = sdk.files.delete(uploaded.id)
    assert (deleted.id, deleted.deleted, deleted.object) == (uploaded.id, True, "file")
    assert not (tmp_path / "files" / uploaded.id).exists()
    with pytest.raises(openai.NotFoundError):
        sdk.files.retrieve(uploaded.id)


def test_expires_after(engine, tmp_path):
    now = [1_000_000.0]
    settings = BatchSettings(clock=lambda: now[0], file_sweep_interval_s=0.02)
    with TestClient(build_app(engine, None, tmp_path, batch_settings=settings)) as http:
        sdk = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=http, max_retries=0)
        policy = {"anchor": "created_at", "seconds": 3600}
        brief = sdk.files.create(file=("notes.txt", b"hello"), purpose="user_data", expires_after=policy)
        kept = sdk.files.create(file=("in.jsonl", DATA), purpose="batch")
        assert (brief.created_at, brief.expires_at, kept.expires_at) == (1_000_000, 1_003_600, None)
        assert sdk.files.retrieve(brief.id) == brief
        now[0] += 3600
        with pytest.raises(openai.NotFoundError):
            sdk.files.retrieve(brief.id)
        r = http.get(f"/v1/files/{brief.id}/content")
        assert (r.status_code, r.json()) == (
            404,
            error_body(f"No such File object: {brief.id}", param="file_id", code="not_found"),
        )
        assert [f.id for f in sdk.files.list()] == [kept.id]
        deadline = time.monotonic() + 10
        while (tmp_path / "files" / brief.id).exists():  # the sweep deletes the bytes too
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert sdk.files.retrieve(kept.id) == kept


def test_expires_after_errors(http):
    cases = [
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "59"},
            "Invalid value for 'expires_after.seconds': Input should be greater than or equal to 3600, got 59.",
            "expires_after.seconds",
            "invalid_value",
        ),
        (
            {"expires_after[anchor]": "created_at", "expires_after[seconds]": "soon"},
            "Invalid value for 'expires_after.seconds': expected an integer, got 'soon'.",
            "expires_after.seconds",
            "invalid_type",
        ),
        (
            {"expires_after[anchor]": "last_used_at", "expires_after[seconds]": "3600"},
            "Invalid value for 'expires_after.anchor': Input should be 'created_at', got \"last_used_at\".",
            "expires_after.anchor",
            "invalid_value",
        ),
        (
            {"expires_after[seconds]": "3600"},
            "Missing required parameter: 'expires_after.anchor'.",
            "expires_after.anchor",
            "missing_required_parameter",
        ),
    ]
    for fields, message, param, code in cases:
        r = http.post("/v1/files", files={"file": ("a.jsonl", DATA)}, data={"purpose": "batch", **fields})
        assert (r.status_code, r.json()) == (400, error_body(message, param=param, code=code)), fields
    assert http.get("/v1/files").json()["data"] == []


def test_too_large_is_413_and_keeps_nothing(http, tmp_path):
    r = http.post("/v1/files", files={"file": ("big.jsonl", b"x" * 1001)}, data={"purpose": "batch"})
    message = "File 'big.jsonl' is larger than this server's upload limit of 1000 bytes (--max-upload-bytes)."
    assert (r.status_code, r.json()) == (413, error_body(message, param="file", code="file_too_large"))
    assert list((tmp_path / "files").iterdir()) == []
    assert http.get("/v1/files").json()["data"] == []
    r = http.post("/v1/files", files={"file": ("ok.jsonl", b"x" * 1000)}, data={"purpose": "batch"})
    assert (r.status_code, r.json()["bytes"]) == (200, 1000)


def test_bad_uploads(http, tmp_path):
    r = http.post("/v1/files", files={"file": ("a.jsonl", DATA)}, data={"purpose": "fine-tune"})
    message = "Invalid value for 'purpose': 'fine-tune'. This server accepts batch, user_data."
    assert (r.status_code, r.json()) == (400, error_body(message, param="purpose", code="invalid_value"))
    r = http.post("/v1/files", files={"file": ("a.jsonl", DATA)})
    assert (r.status_code, r.json()) == (
        400,
        error_body("Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter"),
    )
    r = http.post("/v1/files", files={"other": ("a.jsonl", DATA)}, data={"purpose": "batch"})
    assert (r.status_code, r.json()) == (
        400,
        error_body("Missing required parameter: 'file'.", param="file", code="missing_required_parameter"),
    )
    r = http.post("/v1/files", json={"purpose": "batch"})
    message = "Expected a multipart/form-data body, got content type 'application/json'."
    assert (r.status_code, r.json()) == (400, error_body(message))
    # A part whose header line is cut by the closing boundary (found by schemathesis: it was a 500).
    body = b"--b\r\nTrue--b--\r\n"
    r = http.post("/v1/files", content=body, headers={"content-type": "multipart/form-data; boundary=b"})
    assert r.status_code == 400
    assert r.json()["error"]["message"].startswith("The multipart body is malformed: Found invalid character")
    assert list((tmp_path / "files").iterdir()) == []


def test_unknown_ids(http):
    for r in (
        http.get("/v1/files/file-nope"),
        http.get("/v1/files/file-nope/content"),
        http.delete("/v1/files/file-nope"),
    ):
        assert (r.status_code, r.json()) == (
            404,
            error_body("No such File object: file-nope", param="file_id", code="not_found"),
        )
    r = http.get("/v1/files", params={"after": "file-nope"})
    assert (r.status_code, r.json()) == (
        404,
        error_body("No such File object: file-nope", param="after", code="not_found"),
    )
    r = http.get("/v1/files", params={"limit": 0})
    assert (r.status_code, r.json()) == (
        400,
        error_body("limit must be between 1 and 10000, got 0.", param="limit", code="invalid_value"),
    )


def test_files_survive_a_restart(engine, tmp_path):
    with TestClient(build_app(engine, None, tmp_path)) as client:
        uploaded = client.post("/v1/files", files={"file": ("in.jsonl", DATA)}, data={"purpose": "batch"}).json()
    (tmp_path / "files" / "file-torn.part").write_bytes(b"half an upload")  # a server killed mid-upload
    with TestClient(build_app(engine, None, tmp_path)) as client:
        assert client.get(f"/v1/files/{uploaded['id']}").json() == uploaded
        assert client.get(f"/v1/files/{uploaded['id']}/content").content == DATA
    assert sorted(p.name for p in (tmp_path / "files").iterdir()) == [uploaded["id"]]


def test_a_database_from_before_expiry_opens(engine, tmp_path):
    """Tables written before files had expires_at and batches output_expires_s gain the columns (null)."""
    db = Database(tmp_path / DATABASE_FILE)
    db.script(
        "CREATE TABLE files (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, created_at INTEGER NOT NULL, "
        "bytes INTEGER NOT NULL, filename TEXT NOT NULL, purpose TEXT NOT NULL);"
        "INSERT INTO files VALUES ('file-old', 1, 1000, 5, 'old.txt', 'user_data');"
        "CREATE TABLE batches (id TEXT PRIMARY KEY, seq INTEGER NOT NULL, status TEXT NOT NULL, "
        "endpoint TEXT NOT NULL, input_file_id TEXT NOT NULL, completion_window TEXT NOT NULL, metadata TEXT, "
        "errors TEXT, created_at INTEGER NOT NULL, expires_at INTEGER NOT NULL, in_progress_at INTEGER, "
        "finalizing_at INTEGER, completed_at INTEGER, failed_at INTEGER, expired_at INTEGER, cancelling_at INTEGER, "
        "cancelled_at INTEGER, total INTEGER NOT NULL DEFAULT 0, completed INTEGER NOT NULL DEFAULT 0, "
        "failed INTEGER NOT NULL DEFAULT 0, output_file_id TEXT NOT NULL, error_file_id TEXT NOT NULL, "
        "output_bytes INTEGER NOT NULL DEFAULT 0, error_bytes INTEGER NOT NULL DEFAULT 0);"
    )
    db.close()
    (tmp_path / "files").mkdir()
    (tmp_path / "files" / "file-old").write_bytes(b"hello")
    with TestClient(build_app(engine, None, tmp_path)) as client:
        old = client.get("/v1/files/file-old").json()
        assert (old["filename"], old["expires_at"]) == ("old.txt", None)
        assert client.get("/v1/batches").json()["data"] == []


def test_an_upload_on_a_full_disk_is_a_507_and_leaves_nothing_behind(engine, tmp_path):
    settings = BatchSettings(max_upload_bytes=1024**2)
    with (
        small_disk(tmp_path / "files", 64 * 1024) as files,
        TestClient(build_app(engine, None, tmp_path, batch_settings=settings)) as http,
    ):
        r = http.post("/v1/files", files={"file": ("big.jsonl", DATA * 1000)}, data={"purpose": "batch"})
        message = f"The file could not be stored in {files}: No space left on device."
        assert (r.status_code, r.json()) == (507, error_body(message, type="server_error"))
        assert list(files.iterdir()) == []  # the partial upload is gone, its room back
        assert http.get("/v1/files").json()["data"] == []
        small = http.post("/v1/files", files={"file": ("in.jsonl", DATA)}, data={"purpose": "batch"})
        assert small.status_code == 200, small.json()
        assert (files / small.json()["id"]).read_bytes() == DATA
