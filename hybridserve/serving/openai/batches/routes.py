"""The Files and Batch APIs' routes, stores and runner, wired onto an app by one call."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
from collections.abc import Awaitable, Callable
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.protocol import BatchEndpoint, CreateBatchRequest
from hybridserve.serving.openai.batches.runner import BatchRunner, BatchSettings
from hybridserve.serving.openai.batches.service import BatchesService
from hybridserve.serving.openai.batches.store import BatchStore
from hybridserve.serving.openai.body import parse_body
from hybridserve.serving.openai.errors import json_response
from hybridserve.serving.openai.files.expiry import MAX_EXPIRY_S, MIN_EXPIRY_S
from hybridserve.serving.openai.files.service import PURPOSES, FilesService
from hybridserve.serving.openai.files.store import FileStore
from hybridserve.serving.openai.openapi import errors, json_body, multipart_body
from hybridserve.serving.storage import Database


class FilesAndBatches:
    """The running part: `start()` resumes unfinished batches and starts the expired-file sweep, `stop()`
    stops their tasks (batches resume on the next start) and removes a temporary file directory."""

    def __init__(self, runner: BatchRunner, files: FilesService, temporary: Path | None) -> None:
        self.runner = runner
        self.files = files
        self.temporary = temporary
        self._sweep: asyncio.Task[None] | None = None

    def start(self) -> None:
        self.runner.resume()
        interval = self.runner.settings.file_sweep_interval_s
        self._sweep = asyncio.create_task(self.files.sweep(interval), name="expired file sweep")

    async def stop(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            await asyncio.wait([self._sweep])
        await self.runner.shutdown()
        if self.temporary is not None:
            shutil.rmtree(self.temporary, ignore_errors=True)


def add_files_and_batches(
    app: FastAPI,
    db: Database,
    data_dir: str | Path | None,
    endpoints: dict[str, BatchEndpoint],
    metrics: ServingMetrics,
    settings: BatchSettings,
    max_body_bytes: int,
    engine_health: Callable[[], Awaitable[None]],
) -> FilesAndBatches:
    """Registers /v1/files and /v1/batches. File bytes live under `data_dir`/files (None: a temporary
    directory, removed at shutdown, for an app whose database is in memory too). A file upload is bounded by
    `settings.max_upload_bytes`, a batch creation's JSON body by `max_body_bytes`. `engine_health` (the
    engine's check_health) tells the runner whether the engine stopped."""
    temporary = None if data_dir is not None else Path(tempfile.mkdtemp(prefix="hybridserve-files-"))
    directory = Path(data_dir) / "files" if data_dir is not None else temporary
    file_store = FileStore(db, directory, settings.clock)
    batch_store = BatchStore(db)
    metrics.watch_batches(batch_store.status_counts)
    runner = BatchRunner(batch_store, file_store, endpoints, metrics, settings, engine_health)
    files = FilesService(file_store, settings.max_upload_bytes, batch_store.reading)
    batches = BatchesService(batch_store, files, runner, endpoints, settings)

    upload = multipart_body(
        {
            "file": {"type": "string", "format": "binary"},
            "purpose": {"type": "string", "enum": list(PURPOSES)},
            "expires_after[anchor]": {"type": "string", "enum": ["created_at"]},
            "expires_after[seconds]": {"type": "integer", "minimum": MIN_EXPIRY_S, "maximum": MAX_EXPIRY_S},
        },
        ["file", "purpose"],
    )

    @app.post("/v1/files", openapi_extra=upload, responses=errors(400, 413, 507))
    async def upload_file(request: Request) -> Response:
        return json_response(await files.upload(request))

    @app.get("/v1/files", responses=errors(400, 404))
    async def list_files(
        purpose: str | None = None, limit: int = 10_000, order: str = "desc", after: str | None = None
    ):
        return json_response(files.list(purpose, limit, order, after))

    @app.get("/v1/files/{file_id}", responses=errors(404))
    async def retrieve_file(file_id: str) -> Response:
        return json_response(files.retrieve(file_id))

    @app.get("/v1/files/{file_id}/content", responses=errors(404))
    async def file_content(file_id: str) -> Response:
        return files.content(file_id)

    @app.delete("/v1/files/{file_id}", responses=errors(404, 409))
    async def delete_file(file_id: str) -> Response:
        return json_response(files.delete(file_id))

    @app.post("/v1/batches", openapi_extra=json_body(CreateBatchRequest), responses=errors(400, 404, 413, 429, 507))
    async def create_batch(request: Request) -> Response:
        return json_response(batches.create(await parse_body(request, CreateBatchRequest, max_body_bytes)))

    @app.get("/v1/batches", responses=errors(400, 404))
    async def list_batches(limit: int = 20, after: str | None = None) -> Response:
        return json_response(batches.list(limit, after))

    @app.get("/v1/batches/{batch_id}", responses=errors(404))
    async def retrieve_batch(batch_id: str) -> Response:
        return json_response(batches.retrieve(batch_id))

    @app.post("/v1/batches/{batch_id}/cancel", responses=errors(404, 409))
    async def cancel_batch(batch_id: str) -> Response:
        return json_response(batches.cancel(batch_id))

    return FilesAndBatches(runner, files, temporary)
