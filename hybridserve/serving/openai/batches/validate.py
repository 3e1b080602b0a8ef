"""Validation of a batch input file, read as a stream: memory stays bounded whatever the number of lines.

Each line must be JSON with `custom_id`, `method` POST, a `url` among the batch's endpoints (the online API:
its one endpoint; `hybridserve run-batch`: every batchable one) and a `body` that endpoint's request model
accepts (not streamed, not background). custom_ids must be unique: they are kept in CustomIds, a private
temporary SQLite database (on disk past a small cache), not in a set. The first MAX_REPORTED_ERRORS invalid
lines are reported, each with its 1-based line number and why.
"""

from __future__ import annotations

import sqlite3
import threading
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ValidationError

from hybridserve.serving.openai.batches.protocol import InputLine
from hybridserve.serving.openai.errors import validation_error

MAX_LINE_BYTES = 16 * 1024 * 1024
MAX_REPORTED_ERRORS = 100


def read_lines(path: Path) -> Iterator[tuple[int, bytes | None]]:
    """`(line number, line)` for each non-blank line; None for a line longer than MAX_LINE_BYTES, never read
    whole."""
    with path.open("rb") as f:
        number = 0
        while raw := f.readline(MAX_LINE_BYTES + 1):
            number += 1
            if len(raw) > MAX_LINE_BYTES:
                while raw and not raw.endswith(b"\n"):
                    raw = f.readline(1 << 16)
                yield number, None
            elif raw.strip():
                yield number, raw


class CustomIds:
    """custom_ids, each with the line number it was added with, in a private temporary SQLite database
    (deleted on close) that keeps a small cache in memory: memory stays bounded whatever their number."""

    def __init__(self) -> None:
        self._db = sqlite3.connect("")
        self._db.execute("PRAGMA cache_size=-2048")
        self._db.execute("CREATE TABLE ids (custom_id TEXT PRIMARY KEY, line INTEGER NOT NULL) WITHOUT ROWID")
        self._db.execute("BEGIN")  # never committed: the database is thrown away
        self._count = 0

    def add(self, custom_id: str, line: int) -> int | None:
        """None if `custom_id` is new, else the line it was first added with (the first stays)."""
        if self._db.execute("INSERT OR IGNORE INTO ids VALUES (?, ?)", (custom_id, line)).rowcount:
            self._count += 1
            return None
        (first,) = self._db.execute("SELECT line FROM ids WHERE custom_id = ?", (custom_id,)).fetchone()
        return first

    def __contains__(self, custom_id: str) -> bool:
        return self._db.execute("SELECT 1 FROM ids WHERE custom_id = ?", (custom_id,)).fetchone() is not None

    def __len__(self) -> int:
        return self._count

    def close(self) -> None:
        self._db.close()


@dataclass
class Validation:
    total: int = 0
    errors: list[dict[str, Any]] = field(default_factory=list)
    num_errors: int = 0

    def add(self, line: int | None, code: str, message: str, param: str | None = None) -> None:
        self.num_errors += 1
        if len(self.errors) < MAX_REPORTED_ERRORS:
            self.errors.append({"code": code, "line": line, "message": message, "param": param})

    def report(self) -> list[dict[str, Any]]:
        """The errors, with a last entry counting those not listed."""
        unlisted = self.num_errors - len(self.errors)
        if not unlisted:
            return self.errors
        more = f"{unlisted} more invalid lines are not listed."
        return [*self.errors, {"code": "too_many_errors", "line": None, "message": more, "param": None}]


def validate_input(
    path: Path, models: Mapping[str, type[BaseModel]], max_lines: int | None, stop: threading.Event
) -> Validation:
    """Checks every line of `path` against `models` (url → the endpoint's request model); stops early once
    `stop` is set or past `max_lines` requests (None: no limit)."""
    result = Validation()
    ids = CustomIds()
    try:
        for number, raw in read_lines(path):
            if stop.is_set():
                break
            if result.total == max_lines:
                result.add(
                    number,
                    "too_many_requests",
                    f"The input file has more than {max_lines} requests, this server's limit (--batch-max-lines).",
                )
                break
            result.total += 1
            custom_id = _check_line(number, raw, models, result)
            if custom_id is not None and (first := ids.add(custom_id, number)) is not None:
                result.add(
                    number,
                    "duplicate_custom_id",
                    f"Line {number}: custom_id '{custom_id}' is already used on line {first}; custom_ids must be "
                    "unique within a batch.",
                    "custom_id",
                )
    finally:
        ids.close()
    if result.total == 0 and not result.num_errors:
        result.add(None, "empty_file", "The input file has no requests.")
    return result


def _check_line(
    number: int, raw: bytes | None, models: Mapping[str, type[BaseModel]], result: Validation
) -> str | None:
    """The line's custom_id if the line is valid (its custom_id is checked for uniqueness by the caller)."""
    if raw is None:
        result.add(number, "line_too_long", f"Line {number} is longer than {MAX_LINE_BYTES} bytes.")
        return None
    try:
        line = InputLine.model_validate_json(raw)
    except ValidationError as exc:
        first = exc.errors()[0]
        if first["type"] == "json_invalid":
            result.add(number, "invalid_json_line", f"Line {number} is not valid JSON: {first['msg']}.")
        elif first["type"] == "model_type":
            result.add(number, "invalid_json_line", f"Line {number} is not a JSON object.")
        else:
            error = validation_error([first])
            result.add(number, error.code or "invalid_request", f"Line {number}: {error.message}", error.param)
        return None
    if line.method != "POST":
        result.add(number, "invalid_method", f"Line {number}: method must be 'POST', got '{line.method}'.", "method")
    elif line.url not in models:
        result.add(number, "invalid_url", f"Line {number}: url '{line.url}' {_not_batched(models)}.", "url")
    elif (problem := _check_body(line.body, models[line.url])) is not None:
        message, param = problem
        result.add(number, "invalid_request", f"Line {number}: {message}", param)
    else:
        return line.custom_id
    return None


def _not_batched(models: Mapping[str, type[BaseModel]]) -> str:
    if len(models) == 1:
        return f"does not match the batch's endpoint '{next(iter(models))}'"
    return f"is not an endpoint a batch runs ({', '.join(models)})"


def _check_body(body: dict[str, Any], model: type[BaseModel]) -> tuple[str, str | None] | None:
    try:
        request = model.model_validate(body)
    except ValidationError as exc:
        error = validation_error(list(exc.errors()))
        return f"invalid body: {error.message}", None if error.param is None else f"body.{error.param}"
    for flag in ("stream", "background"):
        if getattr(request, flag, None):
            return f"body.{flag} is not supported in a batch.", f"body.{flag}"
    return None
