"""The batch runner: one task per unfinished batch, from validation to its terminal status.

validating → (input checked in a thread) → in_progress or failed → finalizing → completed. Each request runs
through its endpoint's service (`execute.call_endpoint`: the code behind the HTTP route), at most
`max_requests_in_flight` at a time per batch; its answer is appended to the output file (2xx) or the error
file and committed at once (`BatchStore.record`), so a failing request is one error line and the batch goes
on. Every batch not in a terminal state has a task here: at start-up `resume()` picks up what a stopped or
killed server left (the committed lines are skipped), and an unexpected error ends the batch `failed`, with
the error and its partial results, never stuck in progress.

Stopping: `cancel()` aborts the requests in flight and ends the batch `cancelled` with what finished; past
`expires_at` the batch ends `expired`, its unrun requests written to the error file as `batch_expired`;
`shutdown()` (the server is stopping) aborts in-flight requests and leaves the batch to be resumed.
A progress line per running batch is logged every `progress_interval_s`; logs name requests by their
whole custom_id.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.execute import Progress, call_endpoint, run_bounded
from hybridserve.serving.openai.batches.protocol import (
    BatchEndpoint,
    InputLine,
    not_run_line,
    result_line,
)
from hybridserve.serving.openai.batches.store import Batch, BatchStore
from hybridserve.serving.openai.batches.validate import read_lines, validate_input
from hybridserve.serving.openai.files.store import FileStore

logger = logging.getLogger(__name__)
EXPIRED = "This request could not be executed before the completion window expired."


@dataclass(frozen=True)
class BatchSettings:
    """Limits of the Files and Batch APIs, and the runner's clock.

    `clock` (seconds since the epoch) is the "now" of created_at and of the completion window: the runner
    checks it every `progress_interval_s`, so a test can move it past `expires_at`.
    """

    max_upload_bytes: int = 512 * 1024 * 1024
    max_lines: int = 1_000_000
    max_active_batches: int = 16
    max_requests_in_flight: int = 64
    progress_interval_s: float = 5.0
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        for name in ("max_upload_bytes", "max_lines", "max_active_batches", "max_requests_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.progress_interval_s <= 0:
            raise ValueError(f"progress_interval_s must be positive, got {self.progress_interval_s}")


class _Job:
    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.stop: str | None = None  # "cancel" or "expire" once asked to end; None when the server stops
        self.halt = threading.Event()  # tells a validation thread to give up
        self.task: asyncio.Task[None] | None = None
        self.progress = Progress(batch.completed, batch.failed)


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        endpoints: dict[str, BatchEndpoint],
        metrics: ServingMetrics,
        settings: BatchSettings,
    ) -> None:
        self.store = store
        self.files = files
        self.endpoints = endpoints
        self.metrics = metrics
        self.settings = settings
        self._jobs: dict[str, _Job] = {}
        self._ticker: asyncio.Task[None] | None = None

    def now(self) -> int:
        return int(self.settings.clock())

    def resume(self) -> None:
        """Starts a task for every unfinished batch (those a previous server left), and the progress ticker."""
        self._ticker = asyncio.create_task(self._tick(), name="batch progress")
        for batch in self.store.unfinished():
            logger.info("batch %s: resuming (%s, %d/%d requests done)", batch.id, batch.status, batch.done, batch.total)
            self.start(batch)

    def start(self, batch: Batch) -> None:
        job = _Job(batch)
        self._jobs[batch.id] = job
        job.task = asyncio.create_task(self._run(job), name=f"batch {batch.id}")

    def cancel(self, batch_id: str) -> None:
        """Asks the batch's task to end it `cancelled` (its status is already `cancelling`)."""
        job = self._jobs.get(batch_id)
        if job is not None:
            self._stop(job, "cancel")

    async def shutdown(self) -> None:
        """Stops every task without ending its batch: the next server resumes them."""
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        if self._ticker is not None:
            tasks.append(self._ticker)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _stop(self, job: _Job, reason: str) -> None:
        if job.stop is None and job.task is not None:
            job.stop = reason
            job.halt.set()
            job.task.cancel()

    async def _run(self, job: _Job) -> None:
        batch_id = job.batch.id
        try:
            try:
                await self._work(job)
            except asyncio.CancelledError:
                if job.stop is None:
                    logger.info(
                        "batch %s: stopped with the server, %d/%d requests done",
                        batch_id,
                        job.progress.done,
                        job.batch.total,
                    )
                    raise
            if job.stop == "cancel":
                self._end(batch_id, "cancelled")
            elif job.stop == "expire":
                await self._expire(job)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug, or the disk: the batch fails loudly, with what it has
            logger.exception("batch %s failed", batch_id)
            error = {"code": "server_error", "line": None, "message": f"The batch failed: {exc}", "param": None}
            self._end(batch_id, "failed", errors=[error])
        finally:
            del self._jobs[batch_id]

    async def _work(self, job: _Job) -> None:
        batch = job.batch
        if batch.status == "cancelling":
            job.stop = "cancel"
            return
        if self.now() >= batch.expires_at:
            job.stop = "expire"
            return
        endpoint = self.endpoints[batch.endpoint]
        if batch.status == "validating":
            path = self.files.path(batch.input_file_id)
            args = (path, {batch.endpoint: endpoint.model}, self.settings.max_lines, job.halt)
            validation = await asyncio.to_thread(validate_input, *args)
            if validation.num_errors:
                logger.info("batch %s: input invalid (%d lines)", batch.id, validation.num_errors)
                self.store.update(batch.id, "failed", errors=validation.report(), failed_at=self.now())
                return
            self.store.update(batch.id, "in_progress", total=validation.total, in_progress_at=self.now())
            batch = job.batch = self._get(batch.id)
        if batch.status == "in_progress":
            await self._execute(job, endpoint)
            batch = self._get(batch.id)
        if batch.status == "cancelling":
            job.stop = "cancel"
            return
        if batch.status != "finalizing":
            self.store.update(batch.id, "finalizing", finalizing_at=self.now())
        self._end(batch.id, "completed")
        elapsed, failed = time.monotonic() - job.progress.started, job.progress.failed
        logger.info("batch %s: completed, %d requests (%d failed) in %.1f s", batch.id, batch.total, failed, elapsed)

    def _get(self, batch_id: str) -> Batch:
        batch = self.store.get(batch_id)
        if batch is None:
            raise RuntimeError(f"batch {batch_id} vanished from the store")
        return batch

    async def _execute(self, job: _Job, endpoint: BatchEndpoint) -> None:
        """Runs the input lines without a committed result, at most max_requests_in_flight at a time."""
        with _ResultFiles(self.store, self.files, job.batch) as results:
            requests = (self._request(job, endpoint, results, n, raw) for n, raw in self._pending(job.batch))
            await run_bounded(requests, self.settings.max_requests_in_flight)

    def _pending(self, batch: Batch) -> Iterator[tuple[int, bytes]]:
        """The input lines whose result is not committed yet, in order."""
        done = self.store.done_lines(batch.id)
        next_done = next(done, None)
        for number, raw in read_lines(self.files.path(batch.input_file_id)):
            while next_done is not None and next_done < number:
                next_done = next(done, None)
            if next_done == number or raw is None:  # (validation rejects overlong lines)
                continue
            yield number, raw

    async def _request(
        self, job: _Job, endpoint: BatchEndpoint, results: _ResultFiles, number: int, raw: bytes
    ) -> None:
        line = InputLine.model_validate_json(raw)
        status, body = await call_endpoint(endpoint, line, f"batch {job.batch.id}")
        ok = status < 400
        if not ok:
            logger.info("batch %s: request %r answered %d: %s", job.batch.id, line.custom_id, status, body[:300])
        results.write(number, ok, result_line(line.custom_id, status, body))
        job.progress.count(ok)
        self.metrics.batch_requests["completed" if ok else "failed"].inc()

    async def _expire(self, job: _Job) -> None:
        """Writes every request that did not run as a `batch_expired` error line, then ends the batch `expired`."""
        batch = self._get(job.batch.id)
        if batch.status == "validating":  # nothing was checked, nothing ran
            self._end(batch.id, "expired")
            return
        expired = 0
        with _ResultFiles(self.store, self.files, batch) as results:
            for number, raw in self._pending(batch):
                custom_id = msgspec.json.decode(raw).get("custom_id")
                results.write(number, False, not_run_line(custom_id, "batch_expired", EXPIRED))
                expired += 1
                if expired % 1000 == 0:
                    await asyncio.sleep(0)
        self.metrics.batch_requests["expired"].inc(expired)
        logger.info("batch %s: expired with %d requests not run", batch.id, expired)
        self._end(batch.id, "expired")

    def _end(self, batch_id: str, status: str, errors: list | None = None) -> None:
        """The terminal status, with the output and error files registered (empty ones are removed)."""
        batch = self._get(batch_id)
        values: dict = {f"{status}_at": self.now()}
        if errors is not None:
            values["errors"] = errors
        with self.store.db.transaction():
            for file_id, size, kind in (
                (batch.output_file_id, batch.output_bytes, "output"),
                (batch.error_file_id, batch.error_bytes, "error"),
            ):
                if size and self.files.get(file_id) is None:
                    self.files.add(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", size)
            self.store.update(batch_id, status, **values)
        for file_id, size in ((batch.output_file_id, batch.output_bytes), (batch.error_file_id, batch.error_bytes)):
            if not size:
                self.files.path(file_id).unlink(missing_ok=True)

    async def _tick(self) -> None:
        """Every progress_interval_s: a progress line per running batch, and the end of those past their window."""
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            now = self.now()
            for job in list(self._jobs.values()):
                if now >= job.batch.expires_at:
                    logger.info(
                        "batch %s: past its completion window (expires_at %d)", job.batch.id, job.batch.expires_at
                    )
                    self._stop(job, "expire")
                elif job.batch.status == "in_progress" and job.stop is None:
                    logger.info("batch %s: %s", job.batch.id, job.progress.line(job.batch.total))


class _ResultFiles:
    """A batch's output and error files, opened at their committed lengths (a line written after the last
    commit, by a server that then died, is cut off); each line is committed as it is written."""

    def __init__(self, store: BatchStore, files: FileStore, batch: Batch) -> None:
        self.store = store
        self.batch_id = batch.id
        self.output = _open_at(files.path(batch.output_file_id), batch.output_bytes)
        self.errors = _open_at(files.path(batch.error_file_id), batch.error_bytes)

    def __enter__(self) -> _ResultFiles:
        return self

    def __exit__(self, *exc: object) -> None:
        self.output.close()
        self.errors.close()

    def write(self, number: int, ok: bool, line: bytes) -> None:
        f = self.output if ok else self.errors
        f.write(line)
        f.flush()
        self.store.record(self.batch_id, number, ok, f.tell())


def _open_at(path: Path, length: int) -> BinaryIO:
    f = path.open("ab")
    f.truncate(length)
    f.seek(length)
    return f
