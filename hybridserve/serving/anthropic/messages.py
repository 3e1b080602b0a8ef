"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API on the chat endpoint's path.

A request is converted once (convert.py) into the chat request, then served by the steps /v1/chat/completions
takes: the model's extension rules, the shared preamble (tools, sampling, structured output, rendering), one
GenerationRun (metrics and usage as every endpoint counts them) and the model's output parser, whose pieces
become content blocks (blocks.py). Anthropic requires `max_tokens`; one larger than the context leaves is
clamped to what it leaves rather than refused (clients such as Claude Code ask for a fixed large budget).
"""

from __future__ import annotations

import dataclasses
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hybridserve.engine.outputs import CompletionOutput
from hybridserve.sampling_params import SamplingParams
from hybridserve.serving.anthropic.blocks import BlockWriter
from hybridserve.serving.anthropic.convert import chat_request
from hybridserve.serving.anthropic.errors import error_event, sse
from hybridserve.serving.anthropic.protocol import CountTokensRequest, MessagesRequest
from hybridserve.serving.anthropic.signature import ThinkingSigner
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions.base import ServingExtension
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError, json_response
from hybridserve.serving.openai.generation import GenerationRun
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.preamble import Dialect, Preamble
from hybridserve.serving.openai.priority import FCFS, engine_priority
from hybridserve.serving.openai.prompt import Prompt
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect
from hybridserve.serving.openai.tools import ToolRequest, output_parser
from hybridserve.serving.parsers import Parsers, StreamParser

MESSAGES = Dialect("messages", "max_tokens", {}, "output_config.format", nested=True)
# chat's spelling of a tool's fields (in error messages) → the Messages API's
_TOOL_FIELDS = ((".function.parameters", ".input_schema"), (".function.name", ".name"), (".function", ""))


class MessagesService:
    def __init__(
        self,
        engine: ServingEngine,
        metrics: ServingMetrics,
        parsers: Parsers,
        extension: ServingExtension,
        signer: ThinkingSigner | None = None,
        policy: str = FCFS,
    ) -> None:
        """`policy`: the server's --scheduling-policy."""
        self.policy = policy
        self.engine = engine
        self.metrics = metrics
        self.parsers = parsers
        self.extension = extension
        self.signer = ThinkingSigner() if signer is None else signer
        self.preamble = Preamble(engine, extension)

    async def count_tokens(self, req: CountTokensRequest) -> Response:
        chat, tools = await self._chat(req)
        prompt = await self._render(chat, tools)
        return json_response({"input_tokens": len(prompt.ids)})

    async def create(self, req: MessagesRequest, request: Request) -> Response:
        arrival = time.monotonic()
        if req.max_tokens < 1:
            raise APIError(400, f"max_tokens: must be at least 1, got {req.max_tokens}.", param="max_tokens")
        chat, tools = await self._chat(req)
        priority = engine_priority(request, req.priority, self.policy)

        async def render(_: SamplingParams) -> Prompt:
            return await self._render(chat, tools)

        kwargs = chat.chat_template_kwargs or {}
        # no budget asked of the preamble: it fits one to the room the prompt leaves, clamped below to max_tokens
        prepared = await self.preamble.prepare(MESSAGES, tools, chat, None, None, chat.response_format, kwargs, render)
        params = dataclasses.replace(prepared.params, max_tokens=min(prepared.params.max_tokens, req.max_tokens))
        message_id = f"msg_{uuid.uuid4().hex}"
        prompt = prepared.prompt
        run = GenerationRun(self.engine, self.metrics, message_id, [prompt.ids], [params], arrival, priority)
        answer = _Answer(message_id, self.engine.model_name, run, output_parser(self.parsers, prompt.text, tools))
        writer = BlockWriter(self.signer, bool(req.stream))
        stops = tuple(req.stop_sequences or ())
        if req.stream:
            return EventStreamResponse(answer.stream(writer, stops))
        return await cancel_on_disconnect(request, answer.complete(writer, stops))

    async def _chat(self, req: CountTokensRequest) -> tuple[ChatCompletionRequest, ToolRequest]:
        check_model(self.engine, req.model)
        chat = self.extension.apply_chat_extensions(chat_request(req, self.signer))
        try:
            tools = await self.preamble.tools(MESSAGES, chat.tools, chat.tool_choice, chat.parallel_tool_calls)
        except APIError as exc:
            raise _tool_fields(exc) from None
        return chat, tools

    async def _render(self, chat: ChatCompletionRequest, tools: ToolRequest) -> Prompt:
        return await self.preamble.render(MESSAGES, chat.template_messages(), tools, chat.chat_template_kwargs)


def _tool_fields(exc: APIError) -> APIError:
    """A tool error as chat spells the tool (`tools[0].function.parameters`) respelled as the request did."""
    message, param = exc.message, exc.param
    for chat, ours in _TOOL_FIELDS:
        message = message.replace(chat, ours)
        param = param.replace(chat, ours) if param else param
    return APIError(exc.status, message, type=exc.type, param=param, code=exc.code)


def stop_reason(out: CompletionOutput, calls: int, stops: tuple[str, ...]) -> tuple[str, str | None]:
    """Anthropic's `stop_reason` and `stop_sequence` for a finished output that made `calls` tool calls."""
    if out.finish_reason == "length":
        return "max_tokens", None
    if calls:
        return "tool_use", None
    if isinstance(out.stop_reason, str) and out.stop_reason in stops:
        return "stop_sequence", out.stop_reason
    return "end_turn", None


class _Answer:
    """One request's message: its head, the run and the parser, answered whole or as a stream."""

    def __init__(self, message_id: str, model: str, run: GenerationRun, parser: StreamParser) -> None:
        self.message_id = message_id
        self.model = model
        self.run = run
        self.parser = parser

    def usage(self) -> dict[str, int]:
        """Anthropic counts the cached part of the prompt apart from input_tokens."""
        usage = self.run.usage()
        cached = usage["prompt_tokens_details"]["cached_tokens"]
        return {
            "input_tokens": usage["prompt_tokens"] - cached,
            "cache_creation_input_tokens": 0,
            "cache_read_input_tokens": cached,
            "output_tokens": usage["completion_tokens"],
        }

    def message(self, content: list[dict[str, Any]], reason: str | None, sequence: str | None, usage: dict) -> dict:
        return {
            "id": self.message_id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": reason,
            "stop_sequence": sequence,
            "usage": usage,
        }

    async def complete(self, writer: BlockWriter, stops: tuple[str, ...]) -> Response:
        [(out, _)] = await self.run.collect(want_logprobs=False)
        writer.add(self.parser.feed(out.text) + self.parser.finish())
        writer.close()
        reason, sequence = stop_reason(out, writer.calls, stops)
        return json_response(self.message(writer.blocks, reason, sequence, self.usage()))

    async def stream(self, writer: BlockWriter, stops: tuple[str, ...]) -> AsyncIterator[bytes]:
        prompt_len = len(self.run.prompts[0])
        usage = {"input_tokens": prompt_len, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
        start = self.message([], None, None, {**usage, "output_tokens": 0})
        yield sse("message_start", {"type": "message_start", "message": start})
        reason: str | None = None
        sequence: str | None = None
        try:
            async for _, out, finished in self.run.outputs():
                pieces = self.parser.feed(out.delta_text)
                if finished:
                    pieces += self.parser.finish()
                for event in writer.add(pieces):
                    yield event
                if finished:
                    for event in writer.close():
                        yield event
                    reason, sequence = stop_reason(out, writer.calls, stops)
            if reason is None:
                raise APIError(500, "The engine ended the request before it finished.", type=SERVER_ERROR)
        except APIError as exc:
            yield error_event(exc)
            return
        delta = {"stop_reason": reason, "stop_sequence": sequence}
        yield sse("message_delta", {"type": "message_delta", "delta": delta, "usage": self.usage()})
        yield sse("message_stop", {"type": "message_stop"})
