"""The batch store: batch jobs and which of their input lines have a result, in the shared SQLite database.

A finished request is committed in one transaction with the length its output or error file now has
(`output_bytes` / `error_bytes`) and its line number (`batch_done`): after a crash the runner truncates
the files to those lengths (dropping a line written but not committed) and skips the committed lines, so
every line ends up in the files exactly once. The output and error file ids are chosen at creation; the
files are registered in the file store when the batch ends (the API shows them from then on).
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection, Iterator
from dataclasses import dataclass, fields
from typing import Any

from hybridserve.serving.openai.batches.protocol import STATUSES, TERMINAL
from hybridserve.serving.openai.files.store import new_file_id
from hybridserve.serving.storage import Database

SCHEMA = """
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY,
    seq INTEGER NOT NULL,
    status TEXT NOT NULL,
    endpoint TEXT NOT NULL,
    input_file_id TEXT NOT NULL,
    completion_window TEXT NOT NULL,
    metadata TEXT,
    errors TEXT,
    created_at INTEGER NOT NULL,
    expires_at INTEGER NOT NULL,
    in_progress_at INTEGER,
    finalizing_at INTEGER,
    completed_at INTEGER,
    failed_at INTEGER,
    expired_at INTEGER,
    cancelling_at INTEGER,
    cancelled_at INTEGER,
    total INTEGER NOT NULL DEFAULT 0,
    completed INTEGER NOT NULL DEFAULT 0,
    failed INTEGER NOT NULL DEFAULT 0,
    output_file_id TEXT NOT NULL,
    error_file_id TEXT NOT NULL,
    output_bytes INTEGER NOT NULL DEFAULT 0,
    error_bytes INTEGER NOT NULL DEFAULT 0,
    output_expires_s INTEGER
);
CREATE INDEX IF NOT EXISTS batches_by_seq ON batches (seq);
CREATE INDEX IF NOT EXISTS batches_by_status ON batches (status);
CREATE TABLE IF NOT EXISTS batch_done (
    batch_id TEXT NOT NULL REFERENCES batches(id) ON DELETE CASCADE,
    line INTEGER NOT NULL,
    PRIMARY KEY (batch_id, line)
) WITHOUT ROWID;
"""
_TIMES = ("in_progress_at", "finalizing_at", "completed_at", "failed_at", "expired_at", "cancelling_at", "cancelled_at")


@dataclass(frozen=True)
class Batch:
    id: str
    seq: int
    status: str
    endpoint: str
    input_file_id: str
    completion_window: str
    metadata: str | None
    errors: str | None
    created_at: int
    expires_at: int
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    total: int
    completed: int
    failed: int
    output_file_id: str
    error_file_id: str
    output_bytes: int
    error_bytes: int
    output_expires_s: int | None  # the output and error files expire this long after they are created

    @property
    def done(self) -> int:
        return self.completed + self.failed

    def body(self) -> dict[str, Any]:
        """The API's batch object; the output and error files appear once the batch has ended with lines in them."""
        ended = self.status in TERMINAL
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": None if self.errors is None else {"object": "list", "data": json.loads(self.errors)},
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id if ended and self.output_bytes else None,
            "error_file_id": self.error_file_id if ended and self.error_bytes else None,
            "created_at": self.created_at,
            **{name: getattr(self, name) for name in _TIMES},
            "expires_at": self.expires_at,
            "request_counts": {"total": self.total, "completed": self.completed, "failed": self.failed},
            "metadata": None if self.metadata is None else json.loads(self.metadata),
        }


_COLUMNS = ", ".join(f.name for f in fields(Batch))


class BatchStore:
    def __init__(self, db: Database) -> None:
        self.db = db
        db.script(SCHEMA)
        columns = [row[1] for row in db.all("PRAGMA table_info(batches)")]
        if "output_expires_s" not in columns:  # a database written before output_expires_after
            db.execute("ALTER TABLE batches ADD COLUMN output_expires_s INTEGER")

    def create(
        self,
        endpoint: str,
        input_file_id: str,
        window: str,
        metadata: dict[str, str] | None,
        now: int,
        window_s: int,
        output_expires_s: int | None,
    ) -> Batch:
        batch_id = f"batch_{uuid.uuid4().hex}"
        self.db.execute(
            "INSERT INTO batches (id, seq, status, endpoint, input_file_id, completion_window, metadata, created_at, "
            "expires_at, output_file_id, error_file_id, output_expires_s) "
            "VALUES (?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM batches), 'validating', ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            batch_id,
            endpoint,
            input_file_id,
            window,
            None if metadata is None else json.dumps(metadata),
            now,
            now + window_s,
            new_file_id(),
            new_file_id(),
            output_expires_s,
        )
        batch = self.get(batch_id)
        assert batch is not None
        return batch

    def get(self, batch_id: str) -> Batch | None:
        row = self.db.one(f"SELECT {_COLUMNS} FROM batches WHERE id = ?", batch_id)
        return None if row is None else Batch(*row)

    def list(self, limit: int, after: str | None) -> tuple[list[Batch], bool]:
        """A page, newest first, of the batches created before `after` (KeyError if unknown); more follow?"""
        with self.db.transaction() as db:
            start = 1 << 62
            if after is not None:
                row = db.execute("SELECT seq FROM batches WHERE id = ?", (after,)).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row[0]
            rows = db.execute(
                f"SELECT {_COLUMNS} FROM batches WHERE seq < ? ORDER BY seq DESC LIMIT ?", (start, limit + 1)
            ).fetchall()
        return [Batch(*row) for row in rows[:limit]], len(rows) > limit

    def unfinished(self) -> list[Batch]:
        marks = ", ".join("?" * len(TERMINAL))
        rows = self.db.all(f"SELECT {_COLUMNS} FROM batches WHERE status NOT IN ({marks}) ORDER BY seq", *TERMINAL)
        return [Batch(*row) for row in rows]

    def next_queued(self, running: Collection[str], limit: int) -> list[Batch]:
        """Up to `limit` unfinished batches not in `running`, in the order they get a runner slot: those a
        previous server had started (past validating) first, then the others oldest first (FIFO)."""
        terminal, others = ", ".join("?" * len(TERMINAL)), ", ".join("?" * len(running))
        rows = self.db.all(
            f"SELECT {_COLUMNS} FROM batches WHERE status NOT IN ({terminal}) AND id NOT IN ({others}) "
            "ORDER BY status = 'validating', seq LIMIT ?",
            *TERMINAL,
            *running,
            limit,
        )
        return [Batch(*row) for row in rows]

    def count_queued(self, running: Collection[str]) -> int:
        """How many unfinished batches are not in `running` (they wait for a runner slot)."""
        terminal, others = ", ".join("?" * len(TERMINAL)), ", ".join("?" * len(running))
        row = self.db.one(
            f"SELECT COUNT(*) FROM batches WHERE status NOT IN ({terminal}) AND id NOT IN ({others})",
            *TERMINAL,
            *running,
        )
        assert row is not None
        return row[0]

    def past_window(self, now: int) -> list[Batch]:
        """The unfinished batches whose completion window has ended by `now`."""
        marks = ", ".join("?" * len(TERMINAL))
        rows = self.db.all(
            f"SELECT {_COLUMNS} FROM batches WHERE status NOT IN ({marks}) AND expires_at <= ? ORDER BY seq",
            *TERMINAL,
            now,
        )
        return [Batch(*row) for row in rows]

    def reading(self, file_id: str) -> str | None:
        """The unfinished batch whose input is `file_id`, if any."""
        marks = ", ".join("?" * len(TERMINAL))
        row = self.db.one(
            f"SELECT id FROM batches WHERE input_file_id = ? AND status NOT IN ({marks}) LIMIT 1", file_id, *TERMINAL
        )
        return None if row is None else row[0]

    def status_counts(self) -> dict[str, int]:
        counts = dict.fromkeys(STATUSES, 0)
        counts.update(self.db.all("SELECT status, COUNT(*) FROM batches GROUP BY status"))
        return counts

    def update(self, batch_id: str, status: str, **values: Any) -> None:
        """Sets the status and the given columns (timestamps, `total`, `errors` as a list) together."""
        if status not in STATUSES:
            raise ValueError(f"unknown batch status {status!r}")
        if "errors" in values:
            values["errors"] = json.dumps(values["errors"])
        for name in values:
            if name not in _TIMES and name not in ("total", "errors"):
                raise ValueError(f"batch column {name!r} is not updatable")
        assignments = "".join(f", {name} = ?" for name in values)
        self.db.execute(f"UPDATE batches SET status = ?{assignments} WHERE id = ?", status, *values.values(), batch_id)

    def record(self, batch_id: str, line: int, ok: bool, file_bytes: int) -> None:
        """Commits the result of input line `line`: its output (`ok`) or error file is now `file_bytes` long."""
        count, size = ("completed", "output_bytes") if ok else ("failed", "error_bytes")
        with self.db.transaction() as db:
            db.execute("INSERT INTO batch_done (batch_id, line) VALUES (?, ?)", (batch_id, line))
            db.execute(f"UPDATE batches SET {count} = {count} + 1, {size} = ? WHERE id = ?", (file_bytes, batch_id))

    def done_lines(self, batch_id: str, page: int = 4096) -> Iterator[int]:
        """The committed line numbers, ascending, read a page at a time."""
        last = 0
        while rows := self.db.all(
            "SELECT line FROM batch_done WHERE batch_id = ? AND line > ? ORDER BY line LIMIT ?", batch_id, last, page
        ):
            yield from (line for (line,) in rows)
            last = rows[-1][0]
