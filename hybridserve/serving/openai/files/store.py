"""The file store: bytes on disk under `<data dir>/files/<file id>`, metadata in the shared SQLite database.

A file becomes visible only once its bytes are complete: an upload is written to `<id>.part` and renamed
when it ends, and a batch's output is registered when the batch finishes. `.part` files left by a crash
are removed when the store opens.

A file may have an `expires_at` (files/expiry.py): from then on lookups and listings no longer see it, and
`delete_expired` (the periodic sweep) removes its row and bytes.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable
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
    purpose TEXT NOT NULL,
    expires_at INTEGER
);
CREATE INDEX IF NOT EXISTS files_by_seq ON files (seq);
"""
_COLUMNS = "id, created_at, bytes, filename, purpose, expires_at"
_LIVE = "(expires_at IS NULL OR expires_at > ?)"


def new_file_id() -> str:
    return f"file-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class StoredFile:
    id: str
    created_at: int
    bytes: int
    filename: str
    purpose: str
    expires_at: int | None

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
            "expires_at": self.expires_at,
            "status_details": None,
        }


class FileStore:
    """`clock` (seconds since the epoch) dates files and decides which have expired."""

    def __init__(self, db: Database, directory: Path, clock: Callable[[], float]) -> None:
        self.db = db
        self.directory = directory
        self.clock = clock
        directory.mkdir(parents=True, exist_ok=True)
        db.script(SCHEMA)
        if "expires_at" not in [row[1] for row in db.all("PRAGMA table_info(files)")]:  # written before expiry
            db.execute("ALTER TABLE files ADD COLUMN expires_at INTEGER")
        db.execute("CREATE INDEX IF NOT EXISTS files_by_expiry ON files (expires_at) WHERE expires_at IS NOT NULL")
        for partial in directory.glob("*.part"):
            partial.unlink()

    def now(self) -> int:
        return int(self.clock())

    def path(self, file_id: str) -> Path:
        return self.directory / file_id

    def partial_path(self, file_id: str) -> Path:
        return self.directory / f"{file_id}.part"

    def commit_upload(self, file_id: str, filename: str, purpose: str, expires_after_s: int | None) -> StoredFile:
        """Makes the finished upload `<id>.part` the file `file_id`."""
        path = self.path(file_id)
        self.partial_path(file_id).replace(path)
        return self.add(file_id, filename, purpose, path.stat().st_size, expires_after_s)

    def add(self, file_id: str, filename: str, purpose: str, size: int, expires_after_s: int | None) -> StoredFile:
        """Registers `path(file_id)`, whose bytes are complete, expiring `expires_after_s` from now if given
        (joins the caller's transaction if any)."""
        now = self.now()
        expires_at = None if expires_after_s is None else now + expires_after_s
        stored = StoredFile(file_id, now, size, filename, purpose, expires_at)
        self.db.execute(
            f"INSERT INTO files (seq, {_COLUMNS}) "
            "VALUES ((SELECT COALESCE(MAX(seq), 0) + 1 FROM files), ?, ?, ?, ?, ?, ?)",
            stored.id,
            stored.created_at,
            stored.bytes,
            stored.filename,
            stored.purpose,
            stored.expires_at,
        )
        return stored

    def get(self, file_id: str) -> StoredFile | None:
        """The file, unless it does not exist or has expired."""
        row = self.db.one(f"SELECT {_COLUMNS} FROM files WHERE id = ? AND {_LIVE}", file_id, self.now())
        return None if row is None else StoredFile(*row)

    def list(self, purpose: str | None, limit: int, order: str, after: str | None) -> tuple[list[StoredFile], bool]:
        """A page of the unexpired files in creation order (`order` "asc" or "desc") after the file `after`
        (KeyError if unknown), and whether more follow."""
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self.db.transaction() as db:
            start = 0 if order == "asc" else 1 << 62
            if after is not None:
                row = db.execute("SELECT seq FROM files WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row[0]
            where, args = f"seq {compare} ? AND {_LIVE}", [start, self.now()]
            if purpose is not None:
                where, args = f"{where} AND purpose = ?", [*args, purpose]
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM files WHERE {where} ORDER BY seq {direction} LIMIT ?", (*args, limit + 1)
            ).fetchall()
        return [StoredFile(*row) for row in rows[:limit]], len(rows) > limit

    def delete(self, file_id: str) -> bool:
        if self.db.execute("DELETE FROM files WHERE id = ?", file_id).rowcount == 0:
            return False
        self.path(file_id).unlink(missing_ok=True)
        return True

    def delete_expired(self, in_use: Callable[[str], str | None]) -> list[str]:
        """Deletes every expired file (row and bytes) but those `in_use` names a batch for (an unfinished
        batch still reads them: a later sweep takes them); returns their ids."""
        rows = self.db.all("SELECT id FROM files WHERE expires_at <= ? ORDER BY expires_at", self.now())
        return [file_id for (file_id,) in rows if in_use(file_id) is None and self.delete(file_id)]
