"""The file store: bytes on disk under `<data dir>/files/<file id>`, metadata in the shared SQLite database.

A file becomes visible only once its bytes are complete: an upload is written to `<id>.part` and renamed
when it ends, and a batch's output is registered when the batch finishes. `.part` files left by a crash
are removed when the store opens.
"""

from __future__ import annotations

import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.serving.storage import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    created_at INTEGER NOT NULL,
    bytes INTEGER NOT NULL,
    filename TEXT NOT NULL,
    purpose TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS files_by_seq ON files (seq);
"""
_COLUMNS = "id, created_at, bytes, filename, purpose"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class StoredFile:
    id: str
    created_at: int
    bytes: int
    filename: str
    purpose: str

    def body(self) -> dict[str, Any]:
        """The API's file object."""
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",
            "expires_at": None,
            "status_details": None,
        }


class FileStore:
    def __init__(self, db: Database, directory: Path) -> None:
        self.db = db
        self.directory = directory
        directory.mkdir(parents=True, exist_ok=True)
        db.script(SCHEMA)
        for partial in directory.glob("*.part"):
            partial.unlink()

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    def partial_path(self, file_id: str) -> Path:
        return self.directory / f"{file_id}.part"

    def commit_upload(self, file_id: str, filename: str, purpose: str) -> StoredFile:
        """Makes the finished upload `<id>.part` the file `file_id`."""
        path = self.path(file_id)
        self.partial_path(file_id).replace(path)
        return self.add(file_id, filename, purpose, path.stat().st_size)

    def add(self, file_id: str, filename: str, purpose: str, size: int) -> StoredFile:
        """Registers `path(file_id)`, whose bytes are complete (joins the caller's transaction if any)."""
        stored = StoredFile(file_id, int(time.time()), size, filename, purpose)
        self.db.execute(
            f"INSERT INTO files (seq, {_COLUMNS}) "
            "VALUES ((SELECT COALESCE(MAX(seq), 0) + 1 FROM files), ?, ?, ?, ?, ?)",
            stored.id,
            stored.created_at,
            stored.bytes,
            stored.filename,
            stored.purpose,
        )
        return stored

    def get(self, file_id: str) -> StoredFile | None:
        row = self.db.one(f"SELECT {_COLUMNS} FROM files WHERE id = ?", file_id)
        return None if row is None else StoredFile(*row)

    def list(self, purpose: str | None, limit: int, order: str, after: str | None) -> tuple[list[StoredFile], bool]:
        """A page in creation order (`order` "asc" or "desc") after the file `after` (KeyError if unknown),
        and whether more follow."""
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self.db.transaction() as db:
            start = 0 if order == "asc" else 1 << 62
            if after is not None:
                row = db.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row[0]
            where, args = f"seq {compare} ?", [start]
            if purpose is not None:
                where, args = f"{where} AND purpose = ?", [start, purpose]
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM files WHERE {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)
            ).fetchall()
        return [StoredFile(*row) for row in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str) -> bool:
        if self.db.execute("DELETE FROM files WHERE id = ?", file_id).rowcount == 0:
            return False
        self.path(file_id).unlink(missing_ok=True)
        return True
