"""The HTTP frontend: `build_app(engine, api_key)` wires the OpenAI endpoints, Anthropic's Messages API, vLLM's
/tokenize and /detokenize, health, version, metrics."""

from __future__ import annotations

import contextlib
import hmac
import importlib.metadata
from collections.abc import AsyncIterator
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.types import ASGIApp, Receive, Scope, Send

from hybridserve.rendering.chat_template import template_supports_tools
from hybridserve.serving.anthropic.errors import error_response as anthropic_error
from hybridserve.serving.anthropic.messages import MessagesService
from hybridserve.serving.anthropic.routes import add_messages_routes
from hybridserve.serving.anthropic.signature import ThinkingSigner
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions import ServingExtension, extension_for
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.protocol import CreateBatchRequest
from hybridserve.serving.openai.batches.routes import add_files_and_batches
from hybridserve.serving.openai.batches.runner import BatchSettings
from hybridserve.serving.openai.body import DEFAULT_MAX_BODY_BYTES, parse_body
from hybridserve.serving.openai.endpoints import GenerationServices
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError, install_error_handlers, json_response
from hybridserve.serving.openai.models import ModelsService
from hybridserve.serving.openai.openapi import KEYED_PATHS, errors, json_body, publish
from hybridserve.serving.openai.priority import FCFS
from hybridserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from hybridserve.serving.openai.responses.protocol import ResponsesRequest
from hybridserve.serving.openai.responses.service import ResponsesService
from hybridserve.serving.openai.responses.store import ResponseStore, Retention
from hybridserve.serving.openai.tokenize import DetokenizeRequest, TokenizeRequest, TokenizeService, add_tokenize_routes
from hybridserve.serving.parsers import Parsers
from hybridserve.serving.postprocess import PostprocessPool
from hybridserve.serving.storage import Database, DataDir

THINKING_SECRET_FILE = "thinking-signature.key"


def version() -> str:
    try:
        return importlib.metadata.version("hybridserve")
    except importlib.metadata.PackageNotFoundError:  # running from a source tree that is not installed
        return "unknown"


def build_app(
    engine: ServingEngine,
    api_key: str | None,
    data_dir: str | Path | DataDir | None = None,
    retention: Retention | None = None,
    parsers: Parsers | None = None,
    postprocess: PostprocessPool | None = None,
    extension: ServingExtension | None = None,
    batch_settings: BatchSettings | None = None,
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
    scheduling_policy: str = FCFS,
) -> FastAPI:
    """An app serving `engine` (e.g. an AsyncLLM); with `api_key`, every /v1 route (and /tokenize, /detokenize)
    requires that key (a Bearer token, or Anthropic's `x-api-key` header).

    Stored state (the response store) lives in one SQLite file under `data_dir`, beside the secret that signs the
    Messages API's thinking blocks; None keeps both in memory.
    The app holds `data_dir` (a path, or a DataDir the caller already holds) from here until it shuts down;
    DataDirInUse if another server holds it.
    `retention` bounds the stored responses by count and age (default: Retention()). `parsers` reads
    reasoning and tool calls out of the output (default: what the model's chat template shows).
    `postprocess` (owned by the caller) takes the Responses API's text and event work off the event loop.
    `extension` handles model-specific requests (default: the one registered for the engine's model_type).
    `batch_settings` bounds the Files and Batch APIs (default: BatchSettings()); file bytes live under `data_dir`.
    `max_body_bytes` bounds a JSON request body (a 413 past it); file uploads have `batch_settings`' own limit.
    `scheduling_policy` (--scheduling-policy): "priority" honours clients' `priority` field, "fcfs" refuses it.
    """
    metrics = ServingMetrics(engine.model_name, engine.workers)
    held = data_dir if isinstance(data_dir, DataDir) or data_dir is None else DataDir(data_dir)
    db = Database(":memory:" if held is None else held.database_path)
    store = ResponseStore(db, retention)
    if extension is None:
        extension = extension_for(engine.model_type)
    if parsers is None:
        parsers = default_parsers(engine.tokenizer, extension)
    services = GenerationServices.build(engine, metrics, store, parsers, extension, postprocess, scheduling_policy)
    chat, completions, responses = services.chat, services.completions, services.responses
    models = ModelsService(engine)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine.start()  # the engine's output reader and the router's heartbeats
        files_and_batches.start()  # resumes the batches a previous server left unfinished
        yield
        await files_and_batches.stop()  # batches stay resumable
        await responses.background.shutdown()  # what still runs is stored as cancelled
        db.close()  # flushes the WAL into the database file
        if held is not None:
            held.close()

    app = FastAPI(title="hybridserve", version=version(), lifespan=lifespan)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.response_store = store
    install_error_handlers(app)
    if api_key:
        app.add_middleware(APIKeyMiddleware, api_key=api_key)

    _add_service_routes(app, engine, metrics, models)

    generation_errors = errors(400, 404, 413, 503)

    @app.post(
        "/v1/chat/completions",
        openapi_extra=json_body(ChatCompletionRequest, streams=True),
        responses=generation_errors,
    )
    async def create_chat_completion(request: Request) -> Response:
        return await chat.create(await parse_body(request, ChatCompletionRequest, max_body_bytes), request)

    @app.post("/v1/completions", openapi_extra=json_body(CompletionRequest, streams=True), responses=generation_errors)
    async def create_completion(request: Request) -> Response:
        return await completions.create(await parse_body(request, CompletionRequest, max_body_bytes), request)

    _add_responses_routes(app, responses, max_body_bytes)
    add_tokenize_routes(app, TokenizeService(engine, extension), max_body_bytes)
    signer = ThinkingSigner() if held is None else ThinkingSigner.stored(held.path / THINKING_SECRET_FILE)
    app.state.messages = MessagesService(engine, metrics, parsers, extension, signer, scheduling_policy)
    add_messages_routes(app, app.state.messages, max_body_bytes)

    files_and_batches = add_files_and_batches(
        app,
        db,
        None if held is None else held.path,
        services.batch_endpoints(),
        metrics,
        batch_settings or BatchSettings(),
        max_body_bytes,
        engine.check_health,
    )
    bodies = [ChatCompletionRequest, CompletionRequest, ResponsesRequest, CreateBatchRequest]
    publish(app, [*bodies, TokenizeRequest, DetokenizeRequest])
    return app


def _add_service_routes(app: FastAPI, engine: ServingEngine, metrics: ServingMetrics, models: ModelsService) -> None:
    """/health, /version, /metrics and /v1/models."""

    @app.get("/health", responses=errors(503))
    async def health() -> Response:
        try:
            await engine.check_health()
        except Exception as exc:
            raise APIError(
                503, f"The engine is not healthy: {exc}", type=SERVER_ERROR, code="engine_unhealthy"
            ) from exc
        workers = [{"name": w.name, "role": w.role, "state": w.state, "error": w.error} for w in engine.workers()]
        return json_response({"status": "ok", "workers": workers})

    @app.get("/version")
    async def get_version() -> Response:
        return json_response({"version": version()})

    @app.get("/metrics")
    async def get_metrics() -> Response:
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response(models.list())

    @app.get("/v1/models/{model:path}", responses=errors(404))
    async def retrieve_model(model: str) -> Response:
        return json_response(models.retrieve(model))


def _add_responses_routes(app: FastAPI, responses: ResponsesService, max_body_bytes: int) -> None:
    """/v1/responses: create, retrieve (or replay a background one's events), cancel, delete, input items."""

    @app.post(
        "/v1/responses",
        openapi_extra=json_body(ResponsesRequest, streams=True),
        responses=errors(400, 404, 413, 503, 507),
    )
    async def create_response(request: Request) -> Response:
        return await responses.create(await parse_body(request, ResponsesRequest, max_body_bytes), request)

    @app.get("/v1/responses/{response_id}", responses=errors(400, 404))
    async def retrieve_response(response_id: str, stream: bool = False, starting_after: int | None = None):
        if stream:
            return responses.replay(response_id, starting_after)
        return json_response(responses.retrieve(response_id))

    @app.post("/v1/responses/{response_id}/cancel", responses=errors(400, 404))
    async def cancel_response(response_id: str) -> Response:
        return json_response(await responses.cancel(response_id))

    @app.delete("/v1/responses/{response_id}", responses=errors(400, 404))
    async def delete_response(response_id: str) -> Response:
        return json_response(responses.delete(response_id))

    @app.get("/v1/responses/{response_id}/input_items", responses=errors(400, 404))
    async def list_input_items(response_id: str, limit: int = 20, order: str = "desc", after: str | None = None):
        return json_response(responses.input_items(response_id, limit, order, after))


def default_parsers(
    tokenizer, extension: ServingExtension, reasoning: str | None = "auto", tool: str | None = "auto"
) -> Parsers:
    """The parsers for this model (its extension's, else its chat template's), unless `reasoning` / `tool`
    name one (or "none")."""
    if extension.parsers is not None:
        reasoning = extension.parsers[0] if reasoning == "auto" else reasoning
        tool = extension.parsers[1] if tool == "auto" else tool
    template = tokenizer.chat_template
    return Parsers.choose(template, template_supports_tools(template), reasoning, tool)


class APIKeyMiddleware:
    """Rejects requests to KEYED_PATHS (/v1, /tokenize, /detokenize) without `Authorization: Bearer <api_key>` or
    (Anthropic's) `x-api-key: <api_key>`; health and metrics stay open. The Messages API's routes answer in
    Anthropic's error shape."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.bearer = f"Bearer {api_key}".encode()
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"].startswith(KEYED_PATHS):
            headers = dict(scope["headers"])
            bearer, key = headers.get(b"authorization"), headers.get(b"x-api-key")
            anthropic = scope["path"].startswith("/v1/messages")
            if bearer is None and key is None:
                form = "x-api-key: <key>" if anthropic else "Authorization: Bearer <key>"
                error = APIError(401, f"Missing API key: send it as '{form}'.", code="invalid_api_key")
            elif not (
                (bearer is not None and hmac.compare_digest(bearer, self.bearer))
                or (key is not None and hmac.compare_digest(key, self.key))
            ):
                error = APIError(401, "Incorrect API key provided.", code="invalid_api_key")
            else:
                error = None
            if error is not None:
                challenge = {"www-authenticate": "Bearer"}
                response = anthropic_error(error, challenge) if anthropic else error.response(challenge)
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)
