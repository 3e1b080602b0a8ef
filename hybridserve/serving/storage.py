"""The frontend's SQLite database: one connection shared by the response, file and batch stores.

One file (`hybridserve.sqlite3` under `--data-dir`) in WAL mode with synchronous=NORMAL, so a commit survives
a killed process (not a power loss) without an fsync per transaction. Calls are small and synchronous; a
re-entrant lock serialises the connection for callers on other threads (batch validation runs on one), and
`transaction()` nests, so a store can write its rows inside another store's transaction.
"""

from __future__ import annotations

import contextlib
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATABASE_FILE = "hybridserve.sqlite3"


class Database:
    """`path` is a database file (its directory is created) or ":memory:"."""

    def __init__(self, path: str | Path) -> None:
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self.path = str(path)
        self._lock = threading.RLock()
        self._depth = 0
        self._db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None)
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.execute("PRAGMA foreign_keys=ON")

    def close(self) -> None:
        """Closes the connection (which flushes the WAL into the database file)."""
        with self._lock:
            self._db.close()

    def script(self, sql: str) -> None:
        """Runs a schema script (CREATE ... IF NOT EXISTS statements)."""
        with self._lock:
            self._db.executescript(sql)

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """The connection inside one transaction, committed on exit, rolled back on an exception; nested
        calls join the outermost transaction."""
        with self._lock:
            outermost = self._depth == 0
            if outermost:
                self._db.execute("BEGIN")
            self._depth += 1
            try:
                yield self._db
            except BaseException:
                self._depth -= 1
                if outermost:
                    self._db.execute("ROLLBACK")
                raise
            self._depth -= 1
            if outermost:
                self._db.execute("COMMIT")

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:
        """One statement, committed on its own unless inside a transaction."""
        with self._lock:
            return self._db.execute(sql, args)

    def one(self, sql: str, *args: Any) -> tuple | None:
        with self._lock:
            return self._db.execute(sql, args).fetchone()

    def all(self, sql: str, *args: Any) -> list[tuple]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()
