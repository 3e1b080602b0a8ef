"""The generation endpoints' services for one engine: the HTTP routes, the online batch runner and
`hybridserve run-batch` all call these same objects, so a batch line is answered as its route answers."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel

from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions import ServingExtension
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.batches.protocol import BatchEndpoint
from hybridserve.serving.openai.chat import ChatService
from hybridserve.serving.openai.completions import CompletionService
from hybridserve.serving.openai.priority import FCFS
from hybridserve.serving.openai.protocol import ChatCompletionRequest, CompletionRequest
from hybridserve.serving.openai.responses.protocol import ResponsesRequest
from hybridserve.serving.openai.responses.service import ResponsesService
from hybridserve.serving.openai.responses.store import ResponseStore
from hybridserve.serving.parsers import Parsers
from hybridserve.serving.postprocess import PostprocessPool

# What a batch line's url may name, and the request model its body must fit.
BATCH_MODELS: dict[str, type[BaseModel]] = {
    "/v1/chat/completions": ChatCompletionRequest,
    "/v1/completions": CompletionRequest,
    "/v1/responses": ResponsesRequest,
}


@dataclass(frozen=True)
class GenerationServices:
    chat: ChatService
    completions: CompletionService
    responses: ResponsesService

    @classmethod
    def build(
        cls,
        engine: ServingEngine,
        metrics: ServingMetrics,
        store: ResponseStore,
        parsers: Parsers,
        extension: ServingExtension,
        postprocess: PostprocessPool | None = None,
        policy: str = FCFS,
    ) -> GenerationServices:
        """`policy`: the server's --scheduling-policy."""
        return cls(
            ChatService(engine, metrics, parsers, extension, policy),
            CompletionService(engine, metrics, policy),
            ResponsesService(engine, metrics, store, parsers, extension, postprocess, policy),
        )

    def batch_endpoints(self) -> dict[str, BatchEndpoint]:
        """Each of BATCH_MODELS with its service's `create`."""
        creates = {
            "/v1/chat/completions": self.chat.create,
            "/v1/completions": self.completions.create,
            "/v1/responses": self.responses.create,
        }
        return {url: BatchEndpoint(model, creates[url]) for url, model in BATCH_MODELS.items()}
