"""The response store: stored Responses, their input items and the conversations they continued, in SQLite.

`responses.prompt_messages` holds the conversation a response continued: the items of every earlier turn
and this turn's input, in order (rows written before tool support hold plain chat messages, which read as
message items). Input and output items are indexed by id for `item_reference` inputs.

Calls are synchronous and small (one indexed read, or one transaction of a few inserts, on the frontend's
shared `Database`), so the service makes them on the event loop.

A response is stored when it is created and updated when it ends (`finish`); a terminal state is never
overwritten, and one whose write failed is held in memory (see `finish`).

Retention (count and age) is enforced inside every put's transaction, oldest first by (created_at, seq),
where seq is the insertion order; an evicted response is gone exactly as a deleted one is.
"""

from __future__ import annotations

import json
import logging
import sqlite3
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hybridserve.serving.openai.errors import SERVER_ERROR, APIError
from hybridserve.serving.storage import Database, disk_full

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    prompt_messages TEXT NOT NULL,
    seq INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS response_input_items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (response_id, position)
);
CREATE TABLE IF NOT EXISTS response_output_items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (response_id, position)
);
CREATE TABLE IF NOT EXISTS response_events (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    sequence_number INTEGER NOT NULL,
    frame BLOB NOT NULL,
    PRIMARY KEY (response_id, sequence_number)
);
CREATE INDEX IF NOT EXISTS input_items_by_id ON response_input_items (item_id);
CREATE INDEX IF NOT EXISTS output_items_by_id ON response_output_items (item_id);
"""
DAY_S = 24 * 60 * 60
logger = logging.getLogger(__name__)
TERMINAL = ("completed", "failed", "cancelled", "incomplete")
_UNENDED = "json_extract(response, '$.status') NOT IN (" + ", ".join(f"'{s}'" for s in TERMINAL) + ")"


@dataclass(frozen=True)
class Retention:
    """How many responses the store keeps and for how long (seconds); 0 means unlimited."""

    max_count: int = 10_000
    max_age_s: int = 30 * DAY_S

    def __post_init__(self) -> None:
        for name in ("max_count", "max_age_s"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be at least 0 (0 means unlimited), got {getattr(self, name)}")


class ResponseStore:
    """`db` is the shared Database, or a path (a database file, or ":memory:") for a store of its own.

    `clock` (seconds since the epoch) is the "now" that age retention measures from.
    """

    def __init__(
        self, db: Database | str | Path, retention: Retention | None = None, clock: Callable[[], float] = time.time
    ) -> None:
        self.db = db if isinstance(db, Database) else Database(db)
        self.db.script(SCHEMA)
        columns = [row[1] for row in self.db.all("PRAGMA table_info(responses)")]
        if "seq" not in columns:  # a database written before retention: rowid is its insertion order
            self.db.execute("ALTER TABLE responses ADD COLUMN seq INTEGER NOT NULL DEFAULT 0")
            self.db.execute("UPDATE responses SET seq = rowid")
        self.db.execute("CREATE INDEX IF NOT EXISTS responses_age ON responses (created_at, seq)")
        self.retention = retention or Retention()
        self.clock = clock
        self._unwritten: dict[str, dict[str, Any]] = {}  # how responses ended whose end could not be stored

    def close(self) -> None:
        self.db.close()

    def put(
        self, response: dict[str, Any], input_items: list[dict[str, Any]], conversation: list[dict[str, Any]]
    ) -> None:
        """Stores (or replaces) `response` with this turn's input items and the conversation it continued
        (ending with those inputs), then evicts the oldest others beyond the retention limits (never
        `response` itself: a client is never handed an id that already answers 404)."""
        rows = [(response["id"], i, item["id"], json.dumps(item)) for i, item in enumerate(input_items)]
        outputs = [(response["id"], i, item["id"], json.dumps(item)) for i, item in enumerate(response["output"])]
        with self.db.transaction() as db:
            db.execute("DELETE FROM responses WHERE id = ?", (response["id"],))
            db.execute(
                "INSERT INTO responses (id, created_at, response, prompt_messages, seq) "
                "VALUES (?, ?, ?, ?, (SELECT COALESCE(MAX(seq), 0) + 1 FROM responses))",
                (response["id"], response["created_at"], json.dumps(response), json.dumps(conversation)),
            )
            db.executemany("INSERT INTO response_input_items VALUES (?, ?, ?, ?)", rows)
            db.executemany("INSERT INTO response_output_items VALUES (?, ?, ?, ?)", outputs)
            self._evict(db, response["id"])

    def start(self, response_id: str) -> None:
        """A queued response (background) began generating: it reads in_progress from now on."""
        self.db.execute(
            "UPDATE responses SET response = json_set(response, '$.status', 'in_progress') "
            "WHERE id = ? AND json_extract(response, '$.status') = 'queued'",
            response_id,
        )

    def update(self, response: dict[str, Any], events: list[bytes] | None = None) -> bool:
        """A new state of a stored response (its input and conversation stay) and, if given, its events (frame
        i being sequence number i), in one transaction, unless the stored state is terminal: a completed,
        failed, cancelled or incomplete response is never overwritten. Whether it was written (False also when
        the response is gone)."""
        response_id = response["id"]
        outputs = [(response_id, i, item["id"], json.dumps(item)) for i, item in enumerate(response["output"])]
        with self.db.transaction() as db:
            written = db.execute(
                f"UPDATE responses SET response = ? WHERE id = ? AND {_UNENDED}", (json.dumps(response), response_id)
            ).rowcount
            if written:
                db.execute("DELETE FROM response_output_items WHERE response_id = ?", (response_id,))
                db.executemany("INSERT INTO response_output_items VALUES (?, ?, ?, ?)", outputs)
            if written and events is not None:
                db.execute("DELETE FROM response_events WHERE response_id = ?", (response_id,))
                rows = [(response_id, i, frame) for i, frame in enumerate(events)]
                db.executemany("INSERT INTO response_events VALUES (?, ?, ?)", rows)
        return bool(written)

    def finish(self, response: dict[str, Any], events: list[bytes] | None = None) -> dict[str, Any]:
        """Stores how a response ended (`update`) and returns the state the store reports from now on, which
        is the one its client must be told: `response`; the stored state if that was already terminal; or,
        when the write fails (a full disk), `response` as failed, naming the error, with its output. That one
        is kept in memory and reported until the server stops (the next start's recovery marks the row
        failed), so a failed write never raises here and never leaves a response in progress."""
        response_id = response["id"]
        try:
            if self.update(response, events):
                return response
        except sqlite3.Error as exc:
            logger.error("response %s ended %s but could not be stored: %s", response_id, response["status"], exc)
            failed = response
            if response["status"] != "failed":
                error = {"code": "server_error", "message": self.write_error(exc).message}
                failed = {**response, "status": "failed", "completed_at": None, "incomplete_details": None}
                failed["error"] = error
            self._unwritten[response_id] = failed
            return failed
        stored = self.get(response_id)
        if stored is None:  # deleted while it ran
            return response
        logger.warning(
            "response %s ended %s, but its stored state %s is final", response_id, response["status"], stored["status"]
        )
        return stored

    def write_error(self, exc: sqlite3.Error) -> APIError:
        """What a client is told when a response could not be stored: 507 when the disk (or the database) is
        full, 500 for any other failed write."""
        status = 507 if disk_full(exc) else 500
        return APIError(status, f"The response could not be stored in {self.db.path}: {exc}.", type=SERVER_ERROR)

    def events(self, response_id: str) -> list[bytes]:
        rows = self.db.all(
            "SELECT frame FROM response_events WHERE response_id = ? ORDER BY sequence_number", response_id
        )
        return [bytes(frame) for (frame,) in rows]

    def fail_unfinished(self, message: str) -> list[str]:
        """Marks responses stored as queued or in progress (their server stopped under them) failed."""
        rows = self.db.all(
            "SELECT response FROM responses WHERE json_extract(response, '$.status') IN ('queued', 'in_progress')"
        )
        failed = []
        for (text,) in rows:
            response = json.loads(text)
            response.update(status="failed", error={"code": "server_error", "message": message})
            self.update(response)
            failed.append(response["id"])
        return failed

    def _evict(self, db: sqlite3.Connection, keep_id: str) -> None:
        if self.retention.max_age_s:
            db.execute(
                "DELETE FROM responses WHERE id != ? AND created_at < ?",
                (keep_id, self.clock() - self.retention.max_age_s),
            )
        if self.retention.max_count:
            db.execute(
                "DELETE FROM responses WHERE id IN (SELECT id FROM responses WHERE id != ? "
                "ORDER BY created_at DESC, seq DESC LIMIT -1 OFFSET ?)",
                (keep_id, self.retention.max_count - 1),
            )

    def count(self) -> int:
        return self._one("SELECT COUNT(*) FROM responses")[0]

    def get(self, response_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT response FROM responses WHERE id = ?", response_id)
        if row is None:
            return None
        unwritten = self._unwritten.get(response_id)
        return json.loads(row[0]) if unwritten is None else unwritten

    def conversation(self, response_id: str) -> list[dict[str, Any]] | None:
        """The items that preceded this response's output (without its instructions)."""
        row = self._one("SELECT prompt_messages FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row[0])

    def item(self, item_id: str) -> dict[str, Any] | None:
        """The newest stored input or output item with this id."""
        row = self._one(
            "SELECT item FROM (SELECT item, rowid AS r, 0 AS o FROM response_output_items WHERE item_id = ?1 "
            "UNION ALL SELECT item, rowid AS r, 1 AS o FROM response_input_items WHERE item_id = ?1) "
            "ORDER BY r DESC, o LIMIT 1",
            item_id,
        )
        return None if row is None else json.loads(row[0])

    def delete(self, response_id: str) -> bool:
        self._unwritten.pop(response_id, None)
        return self.db.execute("DELETE FROM responses WHERE id = ?", response_id).rowcount > 0

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of the response's input items and whether more follow; None if the response is not stored.

        `order` "asc" is input order; `after` is an item id of the same response (KeyError if it is not one).
        """
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self.db.transaction() as db:
            if db.execute("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is None:
                return None
            start = -1 if order == "asc" else 1 << 62
            if after is not None:
                row = db.execute(
                    "SELECT position FROM response_input_items WHERE response_id = ? AND item_id = ?",
                    (response_id, after),
                ).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row[0]
            rows = db.execute(
                f"SELECT item FROM response_input_items WHERE response_id = ? AND position {compare} ? "
                f"ORDER BY position {direction} LIMIT ?",
                (response_id, start, limit + 1),
            ).fetchall()
        return [json.loads(item) for (item,) in rows[:limit]], len(rows) > limit

    def _one(self, sql: str, *args: Any) -> tuple | None:
        return self.db.one(sql, *args)
