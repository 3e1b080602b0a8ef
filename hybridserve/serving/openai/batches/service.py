"""/v1/batches: create, retrieve, list, cancel. The runner does the work; this checks and records requests."""

from __future__ import annotations

from typing import Any

from hybridserve.serving.openai.batches.protocol import COMPLETION_WINDOWS, TERMINAL, BatchEndpoint, CreateBatchRequest
from hybridserve.serving.openai.batches.runner import BatchRunner, BatchSettings
from hybridserve.serving.openai.batches.store import BatchStore
from hybridserve.serving.openai.errors import APIError
from hybridserve.serving.openai.files.service import FilesService
from hybridserve.serving.openai.protocol import list_page


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No batch with id '{batch_id}'.", param="batch_id", code="not_found")


class BatchesService:
    def __init__(
        self,
        store: BatchStore,
        files: FilesService,
        runner: BatchRunner,
        endpoints: dict[str, BatchEndpoint],
        settings: BatchSettings,
    ) -> None:
        self.store = store
        self.files = files
        self.runner = runner
        self.endpoints = endpoints
        self.settings = settings

    def create(self, req: CreateBatchRequest) -> dict[str, Any]:
        req.check(self.endpoints)
        stored = self.files.get(req.input_file_id, "input_file_id")
        if stored.purpose != "batch":
            raise APIError(
                400,
                f"File '{req.input_file_id}' has purpose '{stored.purpose}'; a batch input needs purpose 'batch'.",
                param="input_file_id",
                code="invalid_value",
            )
        if not self.runner.slot_free() and (queued := self.runner.queued()) >= self.settings.max_queued_batches:
            raise APIError(
                429,
                f"This server already has {queued} batches queued for a runner slot, its limit "
                f"(--max-queued-batches {self.settings.max_queued_batches}), and runs "
                f"{self.settings.max_active_batches} at once (--max-active-batches): wait for one to finish or "
                "cancel one.",
                code="too_many_batches",
            )
        window_s = COMPLETION_WINDOWS[req.completion_window]
        expires_s = None if req.output_expires_after is None else req.output_expires_after.seconds
        batch = self.store.create(
            req.endpoint, req.input_file_id, req.completion_window, req.metadata, self.runner.now(), window_s, expires_s
        )
        self.runner.submit(batch)
        return batch.body()

    def retrieve(self, batch_id: str) -> dict[str, Any]:
        batch = self.store.get(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return batch.body()

    def list(self, limit: int, after: str | None) -> dict[str, Any]:
        if not 1 <= limit <= 100:
            raise APIError(400, f"limit must be between 1 and 100, got {limit}.", param="limit", code="invalid_value")
        try:
            batches, has_more = self.store.list(limit, after)
        except KeyError:
            raise APIError(404, f"No batch with id '{after}'.", param="after", code="not_found") from None
        data = [batch.body() for batch in batches]
        return list_page(data, has_more)

    def cancel(self, batch_id: str) -> dict[str, Any]:
        """`cancelling` at once; the runner aborts what is in flight and ends the batch `cancelled` (a queued
        batch at once)."""
        batch = self.store.get(batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        if batch.status in TERMINAL:
            raise APIError(
                409, f"Cannot cancel a batch with status '{batch.status}'.", param="batch_id", code="invalid_state"
            )
        if batch.status != "cancelling":
            self.store.update(batch_id, "cancelling", cancelling_at=self.runner.now())
            self.runner.cancel(batch_id)
        return self.retrieve(batch_id)
