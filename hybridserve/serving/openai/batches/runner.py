"""The batch runner: one task per running batch, from validation to its terminal status.

validating → (input checked in a thread) → in_progress or failed → finalizing → completed. Each request runs
through its endpoint's service (`execute.call_endpoint`: the code behind the HTTP route), at most
`max_requests_in_flight` at a time per batch; its answer is appended to the output file (2xx) or the error
file and committed at once (`BatchStore.record`), so a failing request is one error line and the batch goes
on. At start-up `resume()` picks up what a stopped or killed server left (the committed lines are skipped),
and an unexpected error ends the batch `failed`, with the error and its partial results, never stuck in
progress.

Queue: at most `max_active_batches` batches have a task (a runner slot) at once. A batch created while every
slot is taken is stored `validating` and waits; the queue is the batches table itself (durable: a restarted
server finds it), served by `BatchStore.next_queued` whenever a slot frees: batches a previous server had
started first, then the others oldest first. A queued batch is cancelled at once (nothing of it runs) and its
completion window runs from its creation, so one still queued past `expires_at` ends `expired`.

Stopping: `cancel()` aborts the requests in flight and ends the batch `cancelled` with what finished; past
`expires_at` the batch ends `expired`, its unrun requests written to the error file as `batch_expired`;
`shutdown()` (the server is stopping) aborts in-flight requests and leaves the batch to be resumed.

The engine stopping is not the requests' fault: a request answered 503, or another 5xx while the engine's
health check fails (`execute.engine_stopped`), is not written. The batch's requests in flight are aborted,
the batch stays `in_progress` with its task, which checks the engine every `engine_wait_s` and runs what has
no result once it is healthy again (a router restarts a dead worker); if the server stops first, the next
server resumes it. Expiry and cancel still apply while it waits.
A progress line per running batch is logged every `progress_interval_s`; logs name requests by their
whole custom_id.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import msgspec

from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.execute import Progress, call_endpoint, engine_stopped, run_bounded
from hybridserve.serving.openai.batches.protocol import (
    BatchEndpoint,
    InputLine,
    not_run_line,
    result_line,
)
from hybridserve.serving.openai.batches.store import Batch, BatchStore
from hybridserve.serving.openai.batches.validate import read_lines, validate_input
from hybridserve.serving.openai.files.store import FileStore
from hybridserve.serving.storage import disk_full, write_failure

logger = logging.getLogger(__name__)
EXPIRED = "This request could not be executed before the completion window expired."


@dataclass(frozen=True)
class BatchSettings:
    """Limits of the Files and Batch APIs, and the runner's clock.

    `clock` (seconds since the epoch) is the "now" of created_at, of the completion window and of file
    expiry: the runner checks windows every `progress_interval_s` and the file sweep runs every
    `file_sweep_interval_s`, so a test can move it past `expires_at`. A batch paused on a stopped engine
    checks it again every `engine_wait_s`.
    """

    max_upload_bytes: int = 512 * 1024 * 1024
    max_lines: int = 1_000_000
    max_active_batches: int = 16
    max_queued_batches: int = 256
    max_requests_in_flight: int = 64
    progress_interval_s: float = 5.0
    engine_wait_s: float = 2.0
    file_sweep_interval_s: float = 60.0
    clock: Callable[[], float] = time.time

    def __post_init__(self) -> None:
        for name in ("max_upload_bytes", "max_lines", "max_active_batches", "max_requests_in_flight"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_queued_batches < 0:
            raise ValueError(f"max_queued_batches must be at least 0, got {self.max_queued_batches}")
        for name in ("progress_interval_s", "engine_wait_s", "file_sweep_interval_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(self, name)}")


class _EngineStopped(Exception):
    """A request the engine could not serve because the engine stopped (not written: it runs again)."""


class _Job:
    def __init__(self, batch: Batch) -> None:
        self.batch = batch
        self.stop: str | None = None  # "cancel" or "expire" once asked to end; None when the server stops
        self.halt = threading.Event()  # tells a validation thread to give up
        self.task: asyncio.Task[None] | None = None
        self.progress = Progress(batch.completed, batch.failed)
        self.engine_down: str | None = None  # why, while the batch waits for a stopped engine


class BatchRunner:
    """`health` is the engine's check_health: it raises saying why when the engine cannot serve."""

    def __init__(
        self,
        store: BatchStore,
        files: FileStore,
        endpoints: dict[str, BatchEndpoint],
        metrics: ServingMetrics,
        settings: BatchSettings,
        health: Callable[[], Awaitable[None]],
    ) -> None:
        self.store = store
        self.files = files
        self.endpoints = endpoints
        self.metrics = metrics
        self.settings = settings
        self.health = health
        self._jobs: dict[str, _Job] = {}
        self._ticker: asyncio.Task[None] | None = None
        self._stopping = False

    def now(self) -> int:
        return int(self.settings.clock())

    def resume(self) -> None:
        """Gives runner slots to the unfinished batches a previous server left (the rest stay queued), and
        starts the progress ticker."""
        self._ticker = asyncio.create_task(self._tick(), name="batch progress")
        unfinished = self.store.unfinished()
        self._admit()
        for batch in unfinished:
            state = "resuming" if batch.id in self._jobs else "queued for a runner slot"
            logger.info(
                "batch %s: %s (%s, %d/%d requests done)", batch.id, state, batch.status, batch.done, batch.total
            )

    def submit(self, batch: Batch) -> None:
        """Runs a new batch if a slot is free; otherwise it waits, queued, for one."""
        self._admit()
        if batch.id not in self._jobs:
            logger.info(
                "batch %s: queued behind %d others, all %d runner slots taken (--max-active-batches)",
                batch.id,
                self.queued() - 1,
                self.settings.max_active_batches,
            )

    def slot_free(self) -> bool:
        return len(self._jobs) < self.settings.max_active_batches

    def queued(self) -> int:
        """How many unfinished batches wait for a runner slot."""
        return self.store.count_queued(self._jobs.keys())

    def cancel(self, batch_id: str) -> None:
        """Ends the batch `cancelled` (its status is already `cancelling`): at once if it is queued, else
        through its task, which aborts the requests in flight."""
        job = self._jobs.get(batch_id)
        if job is not None:
            self._stop(job, "cancel")
        else:
            self._end(batch_id, "cancelled")
            logger.info("batch %s: cancelled while queued", batch_id)

    async def shutdown(self) -> None:
        """Stops every task without ending its batch: the next server resumes them."""
        self._stopping = True
        tasks = [job.task for job in self._jobs.values() if job.task is not None]
        if self._ticker is not None:
            tasks.append(self._ticker)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks)

    def _admit(self) -> None:
        """Starts the next queued batches while slots are free."""
        if self._stopping:
            return
        free = self.settings.max_active_batches - len(self._jobs)
        if free > 0:
            for batch in self.store.next_queued(self._jobs.keys(), free):
                self._start(batch)

    def _start(self, batch: Batch) -> None:
        job = _Job(batch)
        self._jobs[batch.id] = job
        job.task = asyncio.create_task(self._run(job), name=f"batch {batch.id}")

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
            self._end(batch_id, "failed", errors=[self._failure(exc)])
        finally:
            del self._jobs[batch_id]
            self._admit()

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
        """Runs the input lines without a committed result, at most max_requests_in_flight at a time; when
        the engine stops, waits for it and runs what is left."""
        while True:
            job.batch = self._get(job.batch.id)  # the files' committed lengths, as of now
            try:
                with _ResultFiles(self.store, self.files, job.batch) as results:
                    requests = (self._request(job, endpoint, results, n, raw) for n, raw in self._pending(job.batch))
                    await run_bounded(requests, self.settings.max_requests_in_flight)
                return
            except _EngineStopped as exc:
                await self._wait_for_engine(job, str(exc))

    async def _wait_for_engine(self, job: _Job, why: str) -> None:
        job.engine_down = why
        logger.warning(
            "batch %s: the engine stopped serving (%s) with %d/%d requests done; the batch waits for it (checked "
            "every %g s), then runs the requests without a result, none of which was written",
            job.batch.id,
            why,
            job.progress.done,
            job.batch.total,
            self.settings.engine_wait_s,
        )
        while job.engine_down is not None:
            await asyncio.sleep(self.settings.engine_wait_s)
            try:
                await self.health()
                job.engine_down = None
            except Exception as exc:
                job.engine_down = str(exc)
        logger.info("batch %s: the engine is serving again; running the rest of the batch", job.batch.id)

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
        if (why := await engine_stopped(status, self.health)) is not None:
            raise _EngineStopped(why)
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

    def _failure(self, exc: Exception) -> dict:
        """The error a batch that failed with `exc` reports."""
        if disk_full(exc):
            message = (
                f"The batch failed: its results could not be written to {self.files.directory}: "
                f"{write_failure(exc)}. The results written before are in its output and error "
                "files."
            )
            return {"code": "insufficient_storage", "line": None, "message": message, "param": None}
        return {"code": "server_error", "line": None, "message": f"The batch failed: {exc}", "param": None}

    def _end(self, batch_id: str, status: str, errors: list | None = None) -> None:
        """The terminal status, with the output and error files registered at their committed lengths (a line a
        failed write tore is cut off; empty files are removed)."""
        batch = self._get(batch_id)
        for file_id, size in ((batch.output_file_id, batch.output_bytes), (batch.error_file_id, batch.error_bytes)):
            path = self.files.path(file_id)
            if size and path.exists() and path.stat().st_size > size:
                os.truncate(path, size)
        values: dict = {f"{status}_at": self.now()}
        if errors is not None:
            values["errors"] = errors
        with self.store.db.transaction():
            for file_id, size, kind in (
                (batch.output_file_id, batch.output_bytes, "output"),
                (batch.error_file_id, batch.error_bytes, "error"),
            ):
                if size and self.files.get(file_id) is None:
                    self.files.add(file_id, f"{batch_id}_{kind}.jsonl", "batch_output", size, batch.output_expires_s)
            self.store.update(batch_id, status, **values)
        for file_id, size in ((batch.output_file_id, batch.output_bytes), (batch.error_file_id, batch.error_bytes)):
            if not size:
                self.files.path(file_id).unlink(missing_ok=True)

    async def _tick(self) -> None:
        """Every progress_interval_s: the end of the batches past their window (queued ones too: a task of
        their own ends them at once, running nothing), and a progress line per running batch."""
        while True:
            await asyncio.sleep(self.settings.progress_interval_s)
            for batch in self.store.past_window(self.now()):
                job = self._jobs.get(batch.id)
                if job is None or job.stop is None:
                    where = "while queued " if job is None else ""
                    logger.info(
                        "batch %s: past its completion window %s(expires_at %d)", batch.id, where, batch.expires_at
                    )
                if job is None:
                    self._start(batch)
                elif job.stop is None:
                    self._stop(job, "expire")
            for job in self._jobs.values():
                if job.batch.status == "in_progress" and job.stop is None:
                    state = job.progress.line(job.batch.total)
                    if job.engine_down is not None:
                        state = f"{state}; waiting for the engine ({job.engine_down})"
                    logger.info("batch %s: %s", job.batch.id, state)


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
