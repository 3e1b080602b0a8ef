"""/v1/responses: create (answer or stream), retrieve, delete, and list input items of stored Responses.

Prompts are rendered by the same chat-template path as Chat Completions; engine work runs in a
GenerationRun, so usage, metrics, engine failures and client disconnects behave as they do for chat.
"""

from __future__ import annotations

import time
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.chat import render_messages
from hybridserve.serving.openai.errors import APIError, json_response
from hybridserve.serving.openai.generation import GenerationRun, fit_to_context
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.protocol import SamplingRequest
from hybridserve.serving.openai.responses.events import response_events
from hybridserve.serving.openai.responses.protocol import (
    ResponsesRequest,
    base_response,
    check_response_id,
    finished_response,
    item_message,
    new_id,
    output_text,
    response_not_found,
)
from hybridserve.serving.openai.responses.store import ResponseStore
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect

RENAMES = {"max_tokens": "max_output_tokens"}


class ResponsesService:
    def __init__(self, engine, metrics: ServingMetrics, store: ResponseStore) -> None:
        self.engine = engine
        self.metrics = metrics
        self.store = store
        self.vocab_size = len(engine.tokenizer)

    async def create(self, req: ResponsesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(self.engine, req.model)
        req.check_supported()
        items = req.input_items()
        if not items:
            raise APIError(400, "input must contain at least one item.", param="input", code="invalid_value")
        messages = self._history(req.previous_response_id) + [item_message(item) for item in items]
        instructions = [] if req.instructions is None else [{"role": "system", "content": req.instructions}]
        sampling = SamplingRequest(temperature=req.temperature, top_p=req.top_p, user=req.user)
        params = sampling.sampling_params(None, req.max_output_tokens, RENAMES, self.vocab_size)
        prompt = self._prompt(instructions, messages, len(items), params.max_tokens, req.truncation)
        params = fit_to_context(
            params,
            len(prompt),
            self.engine.max_model_len,
            what="input",
            max_tokens_param="max_output_tokens",
            renames=RENAMES,
        )
        response_id, item_id = new_id("resp"), new_id("msg")
        run = GenerationRun(self.engine, self.metrics, response_id, [prompt], [params], arrival)
        base = base_response(req, response_id, self.engine.model_name)

        def finish(response: dict[str, Any]) -> None:
            if req.store:
                self.store.put(response, items, messages)

        if req.stream:
            return EventStreamResponse(response_events(run, base, item_id, finish))
        return await cancel_on_disconnect(request, _complete(run, base, item_id, finish))

    def retrieve(self, response_id: str) -> dict[str, Any]:
        check_response_id(response_id, "response_id")
        response = self.store.get(response_id)
        if response is None:
            raise response_not_found(response_id)
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
        return {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }

    def _prompt(
        self,
        instructions: list[dict[str, Any]],
        messages: list[dict[str, Any]],
        num_input: int,
        max_tokens: int | None,
        truncation: str | None,
    ) -> list[int]:
        """The prompt ids; with truncation "auto", the oldest turns are dropped (whole messages) until the
        prompt leaves room for `max_tokens` (or 1 token). Instructions, system/developer messages and the
        newest user input (from the last user message of this turn on) are never dropped. When even those do
        not fit, the full prompt is returned and fit_to_context answers the same 400 as "disabled"."""

        def render(kept: list[dict[str, Any]]) -> list[int]:
            return render_messages(self.engine.tokenizer, instructions + kept, param="input")

        prompt = render(messages)
        room = self.engine.max_model_len - (max_tokens or 1)
        if truncation != "auto" or len(prompt) <= room:
            return prompt
        users = [i for i, m in enumerate(messages) if m["role"] == "user" and i >= len(messages) - num_input]
        newest = users[-1] if users else len(messages) - 1
        droppable = [i for i in range(newest) if messages[i]["role"] not in ("system", "developer")]
        for n in range(1, len(droppable) + 1):
            dropped = set(droppable[:n])
            kept = render([m for i, m in enumerate(messages) if i not in dropped])
            if len(kept) <= room:
                return kept
        return prompt

    def _history(self, previous_response_id: str | None) -> list[dict[str, Any]]:
        """Every earlier turn's messages and assistant output, in order (instructions are not carried over)."""
        if previous_response_id is None:
            return []
        check_response_id(previous_response_id, "previous_response_id")
        response = self.store.get(previous_response_id)
        messages = self.store.prompt_messages(previous_response_id)
        if response is None or messages is None:
            raise response_not_found(previous_response_id, "previous_response_id")
        return [*messages, {"role": "assistant", "content": output_text(response)}]


async def _complete(run: GenerationRun, base: dict[str, Any], item_id: str, finish) -> Response:
    [(out, _)] = await run.collect(want_logprobs=False)
    response = finished_response(base, item_id, out.text, out.finish_reason, run.usage())
    finish(response)
    return json_response(response)
