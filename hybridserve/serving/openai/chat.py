"""POST /v1/chat/completions: render messages with the chat template, generate, answer or stream."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import jinja2
from starlette.requests import Request
from starlette.responses import Response

from hybridserve.engine.outputs import Logprob
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import APIError, json_response
from hybridserve.serving.openai.generation import GenerationRun, fit_to_context, stream_frame
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.protocol import ChatCompletionRequest
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect, sse_event


def render_messages(
    tokenizer, messages: list[dict[str, Any]], template_kwargs: dict[str, Any] | None = None, param: str = "messages"
) -> list[int]:
    """Prompt token ids: `messages` through the tokenizer's chat template, ending with the assistant's turn."""
    kwargs = {"add_generation_prompt": True, **(template_kwargs or {}), "tokenize": False}
    try:
        text = tokenizer.apply_chat_template(messages, **kwargs)
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise APIError(400, f"The chat template could not render these messages: {exc}", param=param) from None
    return tokenizer.encode(text, add_special_tokens=False)


class ChatService:
    def __init__(self, engine, metrics: ServingMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(engine.tokenizer)

    def render(self, req: ChatCompletionRequest) -> list[int]:
        return render_messages(self.tokenizer, req.template_messages(), req.chat_template_kwargs)

    async def create(self, req: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(self.engine, req.model)
        req.check_stream_options()
        max_param = req.max_tokens_param
        renames = {"max_tokens": max_param, "logprobs": "top_logprobs"}
        params = req.sampling_params(req.num_logprobs(), req.requested_max_tokens, renames, self.vocab_size)
        prompt = self.render(req)
        params = fit_to_context(
            params,
            len(prompt),
            self.engine.max_model_len,
            what="messages",
            max_tokens_param=max_param,
            renames=renames,
        )
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        run = GenerationRun(self.engine, self.metrics, request_id, [prompt], [params], arrival)
        head = {
            "id": request_id,
            "object": "chat.completion.chunk",
            "created": int(time.time()),
            "model": self.engine.model_name,
        }
        if req.stream:
            return EventStreamResponse(_stream(run, head, req.include_usage, params.logprobs is not None))
        return await cancel_on_disconnect(request, _complete(run, head, params.logprobs is not None))


def logprobs_content(logprobs: list[Logprob]) -> list[dict]:
    return [
        {
            "token": lp.token,
            "logprob": max(lp.logprob, -9999.0),
            "bytes": lp.bytes,
            "top_logprobs": [{"token": t.token, "logprob": max(t.logprob, -9999.0), "bytes": t.bytes} for t in lp.top],
        }
        for lp in logprobs
    ]


async def _complete(run: GenerationRun, head: dict, want_logprobs: bool) -> Response:
    choices = [
        {
            "index": index,
            "message": {"role": "assistant", "content": out.text, "refusal": None},
            "logprobs": {"content": logprobs_content(logprobs), "refusal": None} if want_logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        for index, (out, logprobs) in enumerate(await run.collect(want_logprobs))
    ]
    return json_response({**head, "object": "chat.completion", "choices": choices, "usage": run.usage()})


async def _stream(run: GenerationRun, head: dict, include_usage: bool, want_logprobs: bool) -> AsyncIterator[bytes]:
    if include_usage:
        head = {**head, "usage": None}

    def chunk(
        index: int, delta: dict, logprobs: dict | None = None, finish_reason: str | None = None, **extra
    ) -> bytes:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_event({**head, "choices": [{**choice, **extra}]})

    async def choices() -> AsyncIterator[bytes]:
        for index in range(run.num_choices):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for index, out, finished in run.outputs():
            if out.delta_text or out.delta_logprobs:
                logprobs = None
                if want_logprobs and out.delta_logprobs:
                    logprobs = {"content": logprobs_content(out.delta_logprobs), "refusal": None}
                yield chunk(index, {"content": out.delta_text}, logprobs)
            if finished:
                yield chunk(index, {}, None, out.finish_reason, stop_reason=out.stop_reason)

    async for event in stream_frame(choices(), run, head if include_usage else None):
        yield event
