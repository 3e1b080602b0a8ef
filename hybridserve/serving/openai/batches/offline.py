"""The work of `hybridserve run-batch`: a batch input file run in this process through the endpoints' services
(`execute.call_endpoint`, the online runner's path), each result appended to one output file as it finishes.

The output file holds every result, 2xx and error statuses alike, one line per custom_id in the order the
requests finished (like vLLM's run-batch; the online API splits them into an output and an error file, with
the same line format). Each line is flushed as it is written and the file fsynced every FSYNC_EVERY_S and at
the end, so a partial file is useful and survives a killed process. `read_done` reads what an earlier run
wrote: everything after the last newline is a torn line (that run died mid-write) and is cut off by
`ResultFile`; the custom_ids of the complete lines are skipped (kept in CustomIds: bounded memory).

A request the engine could not serve because the engine itself stopped is not written: the run stops with
EngineFailed, and a resumed run retries it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.openai.batches.execute import Progress, call_endpoint, engine_stopped, run_bounded
from hybridserve.serving.openai.batches.protocol import BatchEndpoint, InputLine, result_line
from hybridserve.serving.openai.batches.validate import CustomIds, read_lines

logger = logging.getLogger(__name__)
FSYNC_EVERY_S = 1.0
WHO = "run-batch"


class OutputFileError(ValueError):
    """An output file that --resume cannot continue (a line that is not a result, a custom_id twice)."""


class EngineFailed(RuntimeError):
    """The engine stopped serving mid-run."""


class _Response(msgspec.Struct):
    status_code: int


class _Result(msgspec.Struct):
    custom_id: str
    response: _Response | None = None


class _Id(msgspec.Struct):
    custom_id: str


@dataclass
class Done:
    """What an earlier run's output holds: its complete lines' custom_ids and counts, and their length."""

    ids: CustomIds
    completed: int = 0
    failed: int = 0
    length: int = 0  # bytes of complete lines; what follows is a torn line
    torn: int = 0  # bytes after the last newline

    def progress(self) -> Progress:
        return Progress(self.completed, self.failed)


def read_done(path: Path) -> Done:
    """The results `path` holds (none if it does not exist). Raises OutputFileError naming the line."""
    done = Done(CustomIds())
    if not path.exists():
        return done
    decode = msgspec.json.Decoder(_Result).decode
    try:
        with path.open("rb") as f:
            for number, raw in enumerate(f, 1):
                if not raw.endswith(b"\n"):
                    done.torn = len(raw)
                    break
                try:
                    result = decode(raw)
                except msgspec.DecodeError as exc:
                    raise OutputFileError(f"{path} line {number} is not a result line ({exc})") from None
                if (first := done.ids.add(result.custom_id, number)) is not None:
                    raise OutputFileError(
                        f"{path} line {number}: custom_id '{result.custom_id}' is already on line {first}"
                    )
                done.length += len(raw)
                if result.response is not None and result.response.status_code < 400:
                    done.completed += 1
                else:
                    done.failed += 1
    except BaseException:
        done.ids.close()
        raise
    return done


def count_in_input(path: Path, ids: CustomIds) -> int:
    """How many of the (validated) input's custom_ids are in `ids`."""
    decode = msgspec.json.Decoder(_Id).decode
    return sum(decode(raw).custom_id in ids for _, raw in read_lines(path) if raw is not None)


def pending_lines(path: Path, done: CustomIds) -> Iterator[InputLine]:
    """The (validated) input's lines whose custom_id is not in `done`, in order, read one at a time."""
    for _, raw in read_lines(path):
        if raw is not None and (line := InputLine.model_validate_json(raw)).custom_id not in done:
            yield line


class ResultFile:
    """The output file opened to append after its first `length` bytes (a torn line past them is cut off)."""

    def __init__(self, path: Path, length: int) -> None:
        self.path = path
        self._f: BinaryIO = path.open("ab")
        self._f.truncate(length)
        self._synced = time.monotonic()

    def write(self, line: bytes) -> None:
        self._f.write(line)
        self._f.flush()
        if time.monotonic() - self._synced >= FSYNC_EVERY_S:
            self.sync()

    def sync(self) -> None:
        os.fsync(self._f.fileno())
        self._synced = time.monotonic()

    def close(self) -> None:
        self._f.flush()
        self.sync()
        self._f.close()


@dataclass
class OfflineRun:
    """Runs `lines` through `endpoints` (by each line's url) into `results`, at most `max_in_flight` at a time,
    logging `progress` every `progress_interval_s`."""

    engine: ServingEngine
    endpoints: dict[str, BatchEndpoint]
    results: ResultFile
    progress: Progress
    total: int
    max_in_flight: int
    progress_interval_s: float

    async def run(self, lines: Iterator[InputLine]) -> None:
        self.progress.started = time.monotonic()  # the rate counts from the first request, not the model load
        ticker = asyncio.create_task(self._tick(), name="run-batch progress")
        try:
            await run_bounded((self._request(line) for line in lines), self.max_in_flight)
        finally:
            ticker.cancel()

    async def _request(self, line: InputLine) -> None:
        status, body = await call_endpoint(self.endpoints[line.url], line, WHO)
        if (why := await engine_stopped(status, self.engine.check_health)) is not None:
            raise EngineFailed(f"the engine stopped serving: {why}")  # not written: a resumed run retries it
        ok = status < 400
        if not ok:
            logger.info("%s: request %r answered %d: %s", WHO, line.custom_id, status, body[:300])
        self.results.write(result_line(line.custom_id, status, body))
        self.progress.count(ok)

    async def _tick(self) -> None:
        while True:
            await asyncio.sleep(self.progress_interval_s)
            logger.info("%s: %s", WHO, self.progress.line(self.total))
