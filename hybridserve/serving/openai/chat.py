"""POST /v1/chat/completions: render messages with the chat template, generate, answer or stream.

Each choice's text goes through its parser: reasoning becomes `reasoning_content`, tool calls become
`tool_calls` (finish_reason "tool_calls"), the rest is `content`; streamed, in that order as they come.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Iterator
from typing import Any

from starlette.requests import Request
from starlette.responses import Response

from hybridserve.sampling_params import SamplingParams
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.extensions.base import ServingExtension
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError, json_response
from hybridserve.serving.openai.generation import (
    GenerationRun,
    logprobs_content,
    prompt_logprobs_body,
    stream_frame,
)
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.preamble import Preamble, chat_dialect
from hybridserve.serving.openai.priority import FCFS, engine_priority
from hybridserve.serving.openai.prompt import Prompt
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect, sse_event
from hybridserve.serving.openai.tools import output_parser
from hybridserve.serving.parsers import Parsers, Piece, Reasoning, StreamParser, Text, ToolCall
from hybridserve.serving.parsers.base import merged


class ChatService:
    def __init__(
        self,
        engine: ServingEngine,
        metrics: ServingMetrics,
        parsers: Parsers,
        extension: ServingExtension,
        policy: str = FCFS,
    ) -> None:
        """`policy`: the server's --scheduling-policy."""
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self.parsers = parsers
        self.extension = extension
        self.preamble = Preamble(engine, extension)

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(self.engine, req.model)
        req.check_stream_options()
        priority = engine_priority(request, req.priority, self.policy)
        req = self.extension.apply_chat_extensions(req)
        dialect = chat_dialect(req.max_tokens_param)
        tools = await self.preamble.tools(dialect, req.tools, req.tool_choice, req.parallel_tool_calls)

        async def render(_: SamplingParams) -> Prompt:
            return await self.preamble.render(dialect, req.template_messages(), tools, req.chat_template_kwargs)

        kwargs = req.chat_template_kwargs or {}
        prepared = await self.preamble.prepare(
            dialect, tools, req, req.num_logprobs(), req.requested_max_tokens, req.response_format, kwargs, render
        )
        prompt, params = prepared.prompt, prepared.params
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = GenerationRun(self.engine, self.metrics, request_id, [prompt.ids], [params], arrival, priority)
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.engine.model_name,
        }
        parsers = [output_parser(self.parsers, prompt.text, tools) for _ in range(run.num_choices)]
        want_logprobs = params.logprobs is not None
        ids = prompt.ids if req.return_token_ids else None
        want_prompt = req.prompt_logprobs is not None
        if req.stream:
            return EventStreamResponse(_stream(run, head, parsers, req.include_usage, want_logprobs, ids, want_prompt))
        return await cancel_on_disconnect(request, _complete(run, head, parsers, want_logprobs, ids, want_prompt))


def _finish_reason(reason: str | None, calls: int) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def _tool_call(call: ToolCall, index: int | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {} if index is None else {"index": index}
    function = {"name": call.name, "arguments": call.arguments}
    return {**body, "id": f"call_{uuid.uuid4().hex}", "type": "function", "function": function}


def _prompt_logprobs(run: GenerationRun, index: int) -> dict:
    """vLLM's top-level `prompt_logprobs` field, from choice `index`'s (every choice has the same)."""
    prompt = run.prompt_logprobs[index]
    if prompt is None:
        raise APIError(500, "The engine sent no prompt logprobs.", type=SERVER_ERROR)
    return {"prompt_logprobs": prompt_logprobs_body(prompt)}


async def _complete(
    run: GenerationRun,
    head: dict,
    parsers: list[StreamParser],
    want_logprobs: bool,
    prompt_ids: list[int] | None,
    want_prompt_logprobs: bool,
) -> Response:
    """`prompt_ids` (return_token_ids): reported with each choice's output ids."""
    choices = []
    for index, (out, logprobs) in enumerate(await run.collect(want_logprobs)):
        parser = parsers[index]
        pieces = merged(parser.feed(out.text) + parser.finish())
        text = "".join(p.text for p in pieces if isinstance(p, Text))
        reasoning = "".join(p.text for p in pieces if isinstance(p, Reasoning))
        calls = [_tool_call(p) for p in pieces if isinstance(p, ToolCall)]
        message: dict[str, Any] = {"role": "assistant", "content": text or (None if calls else ""), "refusal": None}
        if calls:
            message["tool_calls"] = calls
        if reasoning:
            message["reasoning_content"] = reasoning
        choices.append(
            {
                "index": index,
                "message": message,
                "logprobs": {"content": logprobs_content(logprobs), "refusal": None} if want_logprobs else None,
                "finish_reason": _finish_reason(out.finish_reason, len(calls)),
                "stop_reason": out.stop_reason,
            }
        )
        if prompt_ids is not None:
            choices[-1]["token_ids"] = run.token_ids[index]
    body = {**head, "object": "chat.completion", "choices": choices, "usage": run.usage()}
    if prompt_ids is not None:
        body["prompt_token_ids"] = prompt_ids
    if want_prompt_logprobs:
        body.update(_prompt_logprobs(run, 0))
    return json_response(body)


def _delta(piece: Piece, call_index: int) -> dict[str, Any]:
    """A streamed chunk's delta for one parsed piece of output (a tool call: the choice's `call_index`-th)."""
    if isinstance(piece, Text):
        return {"content": piece.text}
    if isinstance(piece, Reasoning):
        return {"reasoning_content": piece.text}
    return {"tool_calls": [_tool_call(piece, call_index)]}


async def _stream(
    run: GenerationRun,
    head: dict,
    parsers: list[StreamParser],
    include_usage: bool,
    want_logprobs: bool,
    prompt_ids: list[int] | None,
    want_prompt_logprobs: bool,
) -> AsyncIterator[bytes]:
    """`prompt_ids` (return_token_ids): sent in each choice's first chunk, its output ids in its last; vLLM's
    `prompt_logprobs` (top-level) in each choice's last chunk."""
    if include_usage:
        head = {**head, "usage": None}
    calls = [0] * run.num_choices

    def chunk(
        index: int,
        delta: dict,
        logprobs: dict | None = None,
        finish_reason: str | None = None,
        top: dict | None = None,
        **extra,
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_event({**head, "choices": [{**choice, **extra}], **(top or {})})

    def piece_chunks(index: int, pieces: list[Piece], logprobs: dict | None) -> Iterator[bytes]:
        for piece in pieces:
            yield chunk(index, _delta(piece, calls[index]), logprobs)
            if isinstance(piece, ToolCall):
                calls[index] += 1
            logprobs = None
        if logprobs is not None:  # tokens whose text is held back still report their logprobs
            yield chunk(index, {"content": ""}, logprobs)

    async def choices() -> AsyncIterator[bytes]:
        for index in range(run.num_choices):
            ids = {} if prompt_ids is None else {"prompt_token_ids": prompt_ids}
            yield chunk(index, {"role": "assistant", "content": ""}, **ids)
        async for index, out, finished in run.outputs():
            logprobs = None
            if want_logprobs and out.delta_logprobs:
                logprobs = {"content": logprobs_content(out.delta_logprobs), "refusal": None}
            pieces = parsers[index].feed(out.delta_text)
            if finished:
                pieces = merged(pieces + parsers[index].finish())
            for frame in piece_chunks(index, pieces, logprobs):
                yield frame
            if finished:
                reason = _finish_reason(out.finish_reason, calls[index])
                ids = {} if prompt_ids is None else {"token_ids": run.token_ids[index]}
                top = _prompt_logprobs(run, index) if want_prompt_logprobs else None
                yield chunk(index, {}, None, reason, top, stop_reason=out.stop_reason, **ids)

    async for event in stream_frame(choices(), run, head if include_usage else None):
        yield event
