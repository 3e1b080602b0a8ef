"""The response store: stored Responses, their input items and prompt messages, in one SQLite file.

Calls are synchronous and small (one indexed read, or one transaction of a few inserts, in WAL mode with
synchronous=NORMAL), so the service makes them on the event loop; a lock serialises the shared connection
for servers that call from other threads.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS responses (
    id TEXT PRIMARY KEY,
    created_at INTEGER NOT NULL,
    response TEXT NOT NULL,
    prompt_messages TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS response_input_items (
    response_id TEXT NOT NULL REFERENCES responses(id) ON DELETE CASCADE,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    item TEXT NOT NULL,
    PRIMARY KEY (response_id, position)
);
"""


class ResponseStore:
    """`path` is a database file (its directory is created) or ":memory:"."""

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")
        self._db.executescript(SCHEMA)

    def close(self) -> None:
        with self._lock:
            self._db.close()

    def put(
        self, response: dict[str, Any], input_items: list[dict[str, Any]], prompt_messages: list[dict[str, Any]]
    ) -> None:
        """Stores (or replaces) `response` with this turn's input items and the conversation it continued."""
        rows = [(response["id"], i, item["id"], json.dumps(item)) for i, item in enumerate(input_items)]
        with self._lock:
            self._db.execute("BEGIN")
            try:
                self._db.execute("DELETE FROM responses WHERE id = ?", (response["id"],))
                self._db.execute(
                    "INSERT INTO responses VALUES (?, ?, ?, ?)",
                    (response["id"], response["created_at"], json.dumps(response), json.dumps(prompt_messages)),
                )
                self._db.executemany("INSERT INTO response_input_items VALUES (?, ?, ?, ?)", rows)
            except BaseException:
                self._db.execute("ROLLBACK")
                raise
            self._db.execute("COMMIT")

    def get(self, response_id: str) -> dict[str, Any] | None:
        row = self._one("SELECT response FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row[0])

    def prompt_messages(self, response_id: str) -> list[dict[str, Any]] | None:
        """The messages that preceded this response's output (without its instructions)."""
        row = self._one("SELECT prompt_messages FROM responses WHERE id = ?", response_id)
        return None if row is None else json.loads(row[0])

    def delete(self, response_id: str) -> bool:
        with self._lock:
            return self._db.execute("DELETE FROM responses WHERE id = ?", (response_id,)).rowcount > 0

    def input_items(
        self, response_id: str, limit: int = 20, order: str = "desc", after: str | None = None
    ) -> tuple[list[dict[str, Any]], bool] | None:
        """A page of the response's input items and whether more follow; None if the response is not stored.

        `order` "asc" is input order; `after` is an item id of the same response (KeyError if it is not one).
        """
        direction, compare = ("ASC", ">") if order == "asc" else ("DESC", "<")
        with self._lock:
            if self._db.execute("SELECT 1 FROM responses WHERE id = ?", (response_id,)).fetchone() is None:
                return None
            start = -1 if order == "asc" else 1 << 62
            if after is not None:
                row = self._db.execute(
                    "SELECT position FROM response_input_items WHERE response_id = ? AND item_id = ?",
                    (response_id, after),
                ).fetchone()
                if row is None:
                    raise KeyError(after)
                start = row[0]
            rows = self._db.execute(
                f"SELECT item FROM response_input_items WHERE response_id = ? AND position {compare} ? "
                f"ORDER BY position {direction} LIMIT ?",
                (response_id, start, limit + 1),
            ).fetchall()
        return [json.loads(item) for (item,) in rows[:limit]], len(rows) > limit

    def _one(self, sql: str, *args: Any) -> tuple | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()
