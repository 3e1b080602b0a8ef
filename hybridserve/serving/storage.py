"""The frontend's SQLite database: one connection shared by the response, file and batch stores.

One file (`hybridserve.sqlite3` under `--data-dir`) in WAL mode with synchronous=NORMAL, so a commit survives
a killed process (not a power loss) without an fsync per transaction. Calls are small and synchronous; a
re-entrant lock serialises the connection for callers on other threads (batch validation runs on one), and
`transaction()` nests, so a store can write its rows inside another store's transaction.

A data directory belongs to one server at a time: `DataDir` holds an exclusive lock on it for the server's
life, because a second server on the same directory would take the first one's running responses and
batches for abandoned ones and recover them under it.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import sqlite3
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

DATABASE_FILE = "hybridserve.sqlite3"
LOCK_FILE = "hybridserve.lock"


def disk_full(exc: BaseException) -> bool:
    """Whether a failed write failed for want of room: a full disk or quota (ENOSPC, EDQUOT), or SQLite's
    "database or disk is full"."""
    if isinstance(exc, sqlite3.Error):
        return getattr(exc, "sqlite_errorcode", None) == sqlite3.SQLITE_FULL
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT)


def write_failure(exc: BaseException) -> str:
    """Why a write failed, in words (an OSError's without its errno prefix)."""
    if isinstance(exc, OSError) and exc.strerror:
        return exc.strerror
    return str(exc)


class DataDirInUse(RuntimeError):
    """Another process (another server) holds the data directory's lock."""


class DataDir:
    """A data directory (created if missing) held by this process: an exclusive `flock` on its
    `hybridserve.lock`, which names the holder's pid, taken here and held until `close()` or the process
    ends (the kernel drops it then, so a killed server leaves no stale lock). Raises DataDirInUse, naming
    the directory and the holder's pid, when another process holds it."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.mkdir(parents=True, exist_ok=True)
        self._file = open(self.path / LOCK_FILE, "a+")  # noqa: SIM115 (held open for the server's life)
        try:
            fcntl.flock(self._file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._file.seek(0)
            holder = self._file.read().strip() or "unknown"
            self._file.close()
            raise DataDirInUse(
                f"the data directory {self.path} is in use by another hybridserve server (pid {holder}); "
                "stop it or choose another --data-dir"
            ) from None
        self._file.truncate(0)
        self._file.write(f"{os.getpid()}\n")
        self._file.flush()

    @property
    def database_path(self) -> Path:
        return self.path / DATABASE_FILE

    def close(self) -> None:
        """Releases the lock (again: nothing). The lock file stays: removing it would race a new holder."""
        self._file.close()


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
                if outermost and self._db.in_transaction:  # SQLite itself rolls back on a full disk
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
