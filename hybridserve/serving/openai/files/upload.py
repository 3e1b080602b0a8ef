"""A multipart/form-data upload streamed to disk: the `file` part goes straight into a file as it arrives
(never whole in memory, never through a temporary copy), other fields are kept if small."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from python_multipart import MultipartParser
from python_multipart.exceptions import MultipartParseError
from python_multipart.multipart import parse_options_header

from hybridserve.serving.openai.errors import APIError

MAX_FIELD_BYTES = 1024


@dataclass
class Upload:
    """What the form held: its small fields, and the file part's name and size (its bytes are on disk)."""

    fields: dict[str, str] = field(default_factory=dict)
    filename: str | None = None
    size: int = 0


def too_large(filename: str | None, limit: int) -> APIError:
    return APIError(
        413,
        f"File '{filename}' is larger than this server's upload limit of {limit} bytes (--max-upload-bytes).",
        param="file",
        code="file_too_large",
    )


async def receive_upload(
    content_type: str | None, body: AsyncIterator[bytes], destination: Path, max_bytes: int
) -> Upload:
    """Parses the form in `body`, writing its `file` part to `destination`; an APIError (400, or 413 past
    `max_bytes` file bytes) stops reading at once, leaving `destination` for the caller to remove."""
    kind, options = parse_options_header(content_type or "")
    boundary = options.get(b"boundary")
    if kind != b"multipart/form-data" or not boundary:
        raise APIError(400, f"Expected a multipart/form-data body, got content type '{content_type}'.")
    upload = Upload()
    with destination.open("wb") as out:
        parser = _FormParser(upload, out, max_bytes)
        multipart = MultipartParser(boundary, parser.callbacks())
        try:
            async for chunk in body:
                multipart.write(chunk)
                if parser.error is not None:
                    raise parser.error
            multipart.finalize()
        except MultipartParseError as exc:
            raise APIError(400, f"The multipart body is malformed: {exc}.") from None
        if parser.error is not None:
            raise parser.error
        if not parser.ended:
            raise APIError(400, "The multipart body ended before its closing boundary.")
    return upload


class _FormParser:
    """python-multipart callbacks: header lines, then data, per part."""

    def __init__(self, upload: Upload, out: BinaryIO, max_bytes: int) -> None:
        self.upload = upload
        self.out = out
        self.max_bytes = max_bytes
        self.error: APIError | None = None
        self.ended = False
        self._header_name = b""
        self._header_value = b""
        self._disposition = b""
        self._field: bytearray | None = None  # a small field's bytes; None while in the file part
        self._name = ""

    def callbacks(self) -> dict:
        return {
            "on_part_begin": self._part_begin,
            "on_header_field": lambda data, start, end: self._add("_header_name", data[start:end]),
            "on_header_value": lambda data, start, end: self._add("_header_value", data[start:end]),
            "on_header_end": self._header_end,
            "on_headers_finished": self._headers_finished,
            "on_part_data": self._data,
            "on_part_end": self._part_end,
            "on_end": self._end,
        }

    def _add(self, attribute: str, data: bytes) -> None:
        setattr(self, attribute, getattr(self, attribute) + data)

    def _part_begin(self) -> None:
        self._disposition = b""
        self._header_name = self._header_value = b""

    def _header_end(self) -> None:
        if self._header_name.lower() == b"content-disposition":
            self._disposition = self._header_value
        self._header_name = self._header_value = b""

    def _headers_finished(self) -> None:
        _, options = parse_options_header(self._disposition)
        self._name = options.get(b"name", b"").decode("utf-8", "replace")
        if self._name == "file":
            if self.upload.filename is not None:
                self._fail(APIError(400, "The form has more than one 'file' part.", param="file"))
            self.upload.filename = options.get(b"filename", b"file").decode("utf-8", "replace")
            self._field = None
        else:
            self._field = bytearray()

    def _data(self, data: bytes, start: int, end: int) -> None:
        if self.error is not None:
            return
        if self._field is None:
            self.upload.size += end - start
            if self.upload.size > self.max_bytes:
                self._fail(too_large(self.upload.filename, self.max_bytes))
                return
            self.out.write(data[start:end])
            return
        self._field += data[start:end]
        if len(self._field) > MAX_FIELD_BYTES:
            self._fail(
                APIError(400, f"Form field '{self._name}' is longer than {MAX_FIELD_BYTES} bytes.", param=self._name)
            )

    def _part_end(self) -> None:
        if self._field is not None and self.error is None:
            self.upload.fields[self._name] = self._field.decode("utf-8", "replace")

    def _end(self) -> None:
        self.ended = True

    def _fail(self, error: APIError) -> None:
        if self.error is None:
            self.error = error
