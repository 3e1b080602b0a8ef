"""/v1/files: upload (multipart, streamed to disk; optional `expires_after`), list, retrieve, content, delete,
and the sweep that deletes expired files."""

from __future__ import annotations

import asyncio
import logging
import sqlite3
from collections.abc import Callable
from typing import Any

from starlette.requests import Request
from starlette.responses import FileResponse

from hybridserve.serving.openai.errors import SERVER_ERROR, APIError
from hybridserve.serving.openai.files.expiry import form_expiry
from hybridserve.serving.openai.files.store import FileStore, StoredFile, new_file_id
from hybridserve.serving.openai.files.upload import receive_upload
from hybridserve.serving.openai.protocol import list_page
from hybridserve.serving.storage import disk_full, write_failure

logger = logging.getLogger(__name__)
PURPOSES = ("batch", "user_data")


def file_not_found(file_id: str, param: str = "file_id") -> APIError:
    return APIError(404, f"No such File object: {file_id}", param=param, code="not_found")


class FilesService:
    """`in_use(file_id)` names the unfinished batch reading that file, if any (it may not be deleted)."""

    def __init__(self, store: FileStore, max_upload_bytes: int, in_use: Callable[[str], str | None]) -> None:
        self.store = store
        self.max_upload_bytes = max_upload_bytes
        self.in_use = in_use

    async def upload(self, request: Request) -> dict[str, Any]:
        """Stores the form's file; a full disk is a 507 (the partial file removed), as it is for stored responses."""
        file_id = new_file_id()
        try:
            return await self._upload(request, file_id)
        except (OSError, sqlite3.Error) as exc:
            if not disk_full(exc):
                raise
            logger.warning("upload %s refused: %s", file_id, exc)
            raise APIError(
                507, f"The file could not be stored in {self.store.directory}: {write_failure(exc)}.", type=SERVER_ERROR
            ) from None

    async def _upload(self, request: Request, file_id: str) -> dict[str, Any]:
        partial = self.store.partial_path(file_id)
        try:
            form = await receive_upload(
                request.headers.get("content-type"), request.stream(), partial, self.max_upload_bytes
            )
            if form.filename is None:
                raise APIError(
                    400, "Missing required parameter: 'file'.", param="file", code="missing_required_parameter"
                )
            purpose = form.fields.get("purpose")
            if purpose is None:
                raise APIError(
                    400, "Missing required parameter: 'purpose'.", param="purpose", code="missing_required_parameter"
                )
            if purpose not in PURPOSES:
                raise APIError(
                    400,
                    f"Invalid value for 'purpose': '{purpose}'. This server accepts {', '.join(PURPOSES)}.",
                    param="purpose",
                    code="invalid_value",
                )
            expiry = form_expiry(form.fields)
            seconds = None if expiry is None else expiry.seconds
            return self.store.commit_upload(file_id, form.filename, purpose, seconds).body()
        finally:
            partial.unlink(missing_ok=True)

    def list(self, purpose: str | None, limit: int, order: str, after: str | None) -> dict[str, Any]:
        if not 1 <= limit <= 10_000:
            raise APIError(400, f"limit must be between 1 and 10000, got {limit}.", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise APIError(400, f"order must be 'asc' or 'desc', got '{order}'.", param="order", code="invalid_value")
        try:
            files, has_more = self.store.list(purpose, limit, order, after)
        except KeyError:
            raise file_not_found(after or "", "after") from None
        data = [f.body() for f in files]
        return list_page(data, has_more)

    def get(self, file_id: str, param: str = "file_id") -> StoredFile:
        stored = self.store.get(file_id)
        if stored is None:
            raise file_not_found(file_id, param)
        return stored

    def retrieve(self, file_id: str) -> dict[str, Any]:
        return self.get(file_id).body()

    def content(self, file_id: str) -> FileResponse:
        stored = self.get(file_id)
        return FileResponse(self.store.path(file_id), media_type="application/octet-stream", filename=stored.filename)

    def delete(self, file_id: str) -> dict[str, Any]:
        self.get(file_id)
        batch_id = self.in_use(file_id)
        if batch_id is not None:
            raise APIError(
                409,
                f"File '{file_id}' is the input of batch '{batch_id}', which has not finished: cancel the batch "
                "or wait for it to end before deleting the file.",
                param="file_id",
                code="file_in_use",
            )
        if not self.store.delete(file_id):
            raise file_not_found(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    async def sweep(self, interval_s: float) -> None:
        """Every `interval_s`, deletes the files past their `expires_at` (those no unfinished batch reads)."""
        while True:
            await asyncio.sleep(interval_s)
            if deleted := self.store.delete_expired(self.in_use):
                logger.info("deleted %d expired files: %s", len(deleted), ", ".join(deleted))
