"""/v1/responses: create (answer or stream), retrieve, delete, and list input items of stored Responses.

Prompts are rendered by the same chat-template path as Chat Completions; engine work runs in a
GenerationRun, so usage, metrics, engine failures and client disconnects behave as they do for chat.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hybridserve.engine.fanout import expand
from hybridserve.sampling_params import SamplingParams
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions.base import ServingExtension
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import APIError, json_response
from hybridserve.serving.openai.generation import GenerationRun
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.preamble import RESPONSES, Preamble
from hybridserve.serving.openai.priority import FCFS, engine_priority
from hybridserve.serving.openai.prompt import Prompt
from hybridserve.serving.openai.protocol import SamplingRequest, list_page
from hybridserve.serving.openai.responses.background import BackgroundRuns
from hybridserve.serving.openai.responses.events import ResponseRun
from hybridserve.serving.openai.responses.protocol import (
    ResponsesRequest,
    base_response,
    check_response_id,
    conversation_messages,
    new_id,
    response_not_found,
)
from hybridserve.serving.openai.responses.store import ResponseStore
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect
from hybridserve.serving.openai.tools import ToolRequest, output_parser
from hybridserve.serving.parsers import Parsers
from hybridserve.serving.postprocess import PooledResponseRun, PostprocessPool, ResponseJob

UNFINISHED = "The server stopped before this response finished."
logger = logging.getLogger(__name__)


class ResponsesService:
    def __init__(
        self,
        engine: ServingEngine,
        metrics: ServingMetrics,
        store: ResponseStore,
        parsers: Parsers,
        extension: ServingExtension,
        postprocess: PostprocessPool | None = None,
        policy: str = FCFS,
    ) -> None:
        """`policy`: the server's --scheduling-policy."""
        self.engine = engine
        self.policy = policy
        self.postprocess = postprocess
        self.metrics = metrics
        self.store = store
        self.parsers = parsers
        self.extension = extension
        self.preamble = Preamble(engine, extension)
        self.background = BackgroundRuns(store)
        for response_id in store.fail_unfinished(UNFINISHED):
            logger.warning("response %s was unfinished when the server last stopped: stored as failed", response_id)

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(self.engine, req.model)
        req.check_supported()
        priority = engine_priority(request, req.priority, self.policy)
        req = self.extension.apply_responses_extensions(req)
        tools = await self.preamble.tools(RESPONSES, req.tools, req.tool_choice, req.parallel_tool_calls)
        items = req.input_items(self.store.item)
        if not items:
            raise APIError(400, "input must contain at least one item.", param="input", code="invalid_value")
        conversation = self._history(req.previous_response_id) + items
        sampling = SamplingRequest(temperature=req.temperature, top_p=req.top_p, user=req.user)
        kwargs = req.chat_template_kwargs or {}

        async def render(params: SamplingParams) -> Prompt:
            return await self._prompt(
                req.instructions, conversation, len(items), tools, params.max_tokens, req.truncation, kwargs
            )

        prepared = await self.preamble.prepare(
            RESPONSES,
            tools,
            sampling,
            req.num_logprobs(),
            req.max_output_tokens,
            (req.text or {}).get("format"),
            kwargs,
            render,
        )
        prompt, params = prepared.prompt, prepared.params
        response_id = new_id("resp")
        base = base_response(req, response_id, self.engine.model_name, params)
        if req.return_token_ids:
            base["prompt_token_ids"] = prompt.ids
        if req.background:
            base["status"] = "queued"
        if req.store:  # from here on a retrieve finds it: in progress (queued), then as it ended
            self._store_new(base, items, conversation)
        run = GenerationRun(self.engine, self.metrics, response_id, [prompt.ids], [params], arrival, priority)

        def finish(response: dict[str, Any], pending: list[bytes]) -> dict[str, Any]:
            if req.return_token_ids:
                response["output_token_ids"] = run.token_ids[0]
            if not req.store:
                return response
            events = self.background.sent(response_id) + pending if req.background else None
            return self.store.finish(response, events)

        # Output ids are collected by the in-process run: return_token_ids stays off the post-processing pool.
        if self.postprocess is not None and not req.background and not req.return_token_ids:
            max_len, eos = self.engine.max_model_len, self.engine.eos_token_ids
            [child] = expand(response_id, prompt.ids, params, eos, max_len, priority)
            job = ResponseJob(child, base, self.parsers, prompt.text, tools, bool(req.stream))
            pooled = PooledResponseRun(self.engine, self.postprocess, self.metrics, arrival, job, finish)
            if req.stream:
                return EventStreamResponse(pooled.events(stream=True))
            return await cancel_on_disconnect(request, _complete(pooled))
        response = ResponseRun(run, base, output_parser(self.parsers, prompt.text, tools), finish, bool(req.background))
        if req.background:
            self.background.start(response)
            if req.stream:  # a disconnect only stops following: the run goes on
                return EventStreamResponse(self.background.events(response_id, -1))
            return json_response(base)
        if req.stream:
            return EventStreamResponse(response.events(stream=True))
        return await cancel_on_disconnect(request, _complete(response))

    def _store_new(self, base: dict[str, Any], items: list[dict[str, Any]], conversation: list[dict[str, Any]]) -> None:
        """Stores a response before it generates: if the store cannot take it (a full disk), the request
        fails now (507) rather than after the whole generation ran."""
        try:
            self.store.put(base, items, conversation)
        except sqlite3.Error as exc:
            logger.error("response %s could not be stored, so it does not run: %s", base["id"], exc)
            raise self.store.write_error(exc) from None

    def retrieve(self, response_id: str) -> dict[str, Any]:
        check_response_id(response_id, "response_id")
        response = self.store.get(response_id)
        if response is None:
            raise response_not_found(response_id)
        return response

    def replay(self, response_id: str, starting_after: int | None) -> Response:
        """`GET ?stream=true`: a background response's events after `starting_after`, live while it runs."""
        response = self.retrieve(response_id)
        if not response.get("background"):
            raise APIError(400, "Only responses created with background=true can be streamed again.", param="stream")
        after = -1 if starting_after is None else starting_after
        if after < -1:
            raise APIError(400, "starting_after must be at least 0.", param="starting_after", code="invalid_value")
        return EventStreamResponse(self.background.events(response_id, after))

    async def cancel(self, response_id: str) -> dict[str, Any]:
        response = self.retrieve(response_id)
        if not response.get("background"):
            raise APIError(400, "Only responses created with background=true can be cancelled.", param="response_id")
        if self.background.is_live(response_id):
            await self.background.cancel(response_id)
            return self.retrieve(response_id)
        if response["status"] != "cancelled":
            raise APIError(400, f"Cannot cancel a response with status '{response['status']}'.", param="response_id")
        return response

    def delete(self, response_id: str) -> dict[str, Any]:
        check_response_id(response_id, "response_id")
        if not self.store.delete(response_id):
            raise response_not_found(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    def input_items(self, response_id: str, limit: int, order: str, after: str | None) -> dict[str, Any]:
        check_response_id(response_id, "response_id")
        if not 1 <= limit <= 100:
            raise APIError(400, "limit must be between 1 and 100.", param="limit", code="invalid_value")
        if order not in ("asc", "desc"):
            raise APIError(400, "order must be 'asc' or 'desc'.", param="order", code="invalid_value")
        try:
            page = self.store.input_items(response_id, limit, order, after)
        except KeyError:
            raise APIError(404, f"No input item with id '{after}' in this response.", param="after") from None
        if page is None:
            raise response_not_found(response_id)
        data, has_more = page
        return list_page(data, has_more)

    async def _prompt(
        self,
        instructions: str | None,
        conversation: list[dict[str, Any]],
        num_input: int,
        tools: ToolRequest,
        max_tokens: int | None,
        truncation: str | None,
        template_kwargs: dict[str, Any],
    ) -> Prompt:
        """The prompt; with truncation "auto", the oldest turns are dropped (whole messages) until the
        prompt leaves room for `max_tokens` (or 1 token). Instructions, system/developer messages and the
        newest user input (from the last user message of this turn on) are never dropped. When even those do
        not fit, the full prompt is returned and fit_to_context answers the same 400 as "disabled"."""
        system = [] if instructions is None else [{"role": "system", "content": instructions}]
        messages = conversation_messages(conversation)
        num_input = len(conversation_messages(conversation[len(conversation) - num_input :]))

        async def render(kept: list[dict[str, Any]]) -> Prompt:
            history = self.extension.prepare_responses_history(system + kept)
            return await self.preamble.render(RESPONSES, history, tools, template_kwargs)

        prompt = await render(messages)
        room = self.engine.max_model_len - (max_tokens or 1)
        if truncation != "auto" or len(prompt.ids) <= room:
            return prompt
        users = [i for i, m in enumerate(messages) if m["role"] == "user" and i >= len(messages) - num_input]
        newest = users[-1] if users else len(messages) - 1
        droppable = [i for i in range(newest) if messages[i]["role"] not in ("system", "developer")]
        for n in range(1, len(droppable) + 1):
            dropped = set(droppable[:n])
            kept = await render([m for i, m in enumerate(messages) if i not in dropped])
            if len(kept.ids) <= room:
                return kept
        return prompt

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """Every earlier turn's items, input and output, in order (instructions are not carried over)."""
        if previous_response_id is None:
            return []
        check_response_id(previous_response_id, "previous_response_id")
        response = self.store.get(previous_response_id)
        conversation = self.store.conversation(previous_response_id)
        if response is None or conversation is None:
            raise response_not_found(previous_response_id, "previous_response_id")
        return [self.extension.replay_stored_turn(item) for item in [*conversation, *response["output"]]]


async def _complete(response: ResponseRun | PooledResponseRun) -> Response:
    async for _ in response.events(stream=False):
        pass
    assert response.final is not None
    return json_response(response.final)
