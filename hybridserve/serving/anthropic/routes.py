"""The Messages API's routes: every failure of theirs answered in Anthropic's error shape.

The routes stay out of the served OpenAPI document, which describes the OpenAI API and its error shape.
"""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.responses import Response

from hybridserve.serving.anthropic.errors import error_response
from hybridserve.serving.anthropic.messages import MessagesService
from hybridserve.serving.anthropic.protocol import CountTokensRequest, MessagesRequest
from hybridserve.serving.openai.body import parse_body
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError

logger = logging.getLogger(__name__)


def add_messages_routes(app: FastAPI, messages: MessagesService, max_body_bytes: int) -> None:
    @app.post("/v1/messages", include_in_schema=False)
    async def create_message(request: Request) -> Response:
        try:
            return await messages.create(await parse_body(request, MessagesRequest, max_body_bytes), request)
        except Exception as exc:
            return _failure(exc)

    @app.post("/v1/messages/count_tokens", include_in_schema=False)
    async def count_tokens(request: Request) -> Response:
        try:
            return await messages.count_tokens(await parse_body(request, CountTokensRequest, max_body_bytes))
        except Exception as exc:
            return _failure(exc)


def _failure(exc: Exception) -> Response:
    if not isinstance(exc, APIError):
        logger.exception("a Messages API request failed")
        exc = APIError(500, f"Internal server error: {exc}", type=SERVER_ERROR)
    return error_response(exc)
