"""POST /v1/completions: one engine request per prompt (text, texts, token ids, or lists of them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

from starlette.requests import Request
from starlette.responses import Response

from hybridserve.engine.outputs import Logprob
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import APIError, json_response
from hybridserve.serving.openai.generation import GenerationRun, fit_to_context, request_priority, stream_frame
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.prompt import off_loop
from hybridserve.serving.openai.protocol import CompletionRequest
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect, sse_event


class CompletionService:
    def __init__(self, engine: ServingEngine, metrics: ServingMetrics) -> None:
        self.engine = engine
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(engine.tokenizer)

    def tokenize(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        if isinstance(prompt, str):
            prompts = [self.tokenizer.encode(prompt)]
        elif not prompt:
            raise APIError(400, "prompt must not be empty.", param="prompt")
        elif isinstance(prompt[0], str):
            prompts = self.tokenizer(prompt)["input_ids"]
        elif isinstance(prompt[0], int):
            prompts = [prompt]
        else:
            prompts = prompt
        for k, ids in enumerate(prompts):
            param = "prompt" if len(prompts) == 1 else f"prompt[{k}]"
            if not ids:
                raise APIError(400, f"{param} must not be empty.", param="prompt")
            for token_id in ids:
                if not 0 <= token_id < self.vocab_size:
                    raise APIError(
                        400,
                        f"{param} contains token id {token_id}, outside the vocabulary [0, {self.vocab_size}).",
                        param="prompt",
                        code="invalid_value",
                    )
        return prompts

    def prompt_texts(self, prompt: str | list, prompts: list[list[int]]) -> list[str]:
        if isinstance(prompt, str):
            return [prompt]
        if isinstance(prompt[0], str):
            return prompt
        return [self.tokenizer.decode(p) for p in prompts]

    async def create(self, req: CompletionRequest, request: Request) -> Response:
        arrival = time.monotonic()
        check_model(self.engine, req.model)
        req.check_stream_options()
        req.check_supported()
        base = req.sampling_params(req.logprobs, req.max_tokens, {}, self.vocab_size, self.engine.sampling_defaults)
        prompts = await off_loop(_size(req.prompt), self.tokenize, req.prompt)
        max_len = self.engine.max_model_len
        params = [fit_to_context(base, len(p), max_len, what="prompt", max_tokens_param="max_tokens") for p in prompts]
        echo = self.prompt_texts(req.prompt, prompts) if req.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        run = GenerationRun(self.engine, self.metrics, request_id, prompts, params, arrival, request_priority(request))
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.engine.model_name,
        }
        want_logprobs = base.logprobs is not None
        if req.stream:
            return EventStreamResponse(_stream(run, head, req.include_usage, want_logprobs, echo))
        return await cancel_on_disconnect(request, _complete(run, head, want_logprobs, echo))


def _size(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """The characters or token ids `prompt` holds: the work of tokenizing and checking it."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)


def completion_logprobs(logprobs: list[Logprob], offset: int) -> tuple[dict, int]:
    """The legacy logprobs object for `logprobs`, whose first token starts at text offset `offset`."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for lp in logprobs:
        logprob = max(lp.logprob, -9999.0)
        top = {t.token: max(t.logprob, -9999.0) for t in lp.top}
        top.setdefault(lp.token, logprob)
        tokens.append(lp.token)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
        text_offset.append(offset)
        offset += len(lp.token)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
    return body, offset


def _echo_text(echo: list[str] | None, index: int, n: int) -> str:
    return echo[index // n] if echo is not None else ""


async def _complete(run: GenerationRun, head: dict, want_logprobs: bool, echo: list[str] | None) -> Response:
    choices = [
        {
            "index": index,
            "text": _echo_text(echo, index, run.n) + out.text,
            "logprobs": completion_logprobs(logprobs, 0)[0] if want_logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        for index, (out, logprobs) in enumerate(await run.collect(want_logprobs))
    ]
    return json_response({**head, "choices": choices, "usage": run.usage()})


async def _stream(
    run: GenerationRun, head: dict, include_usage: bool, want_logprobs: bool, echo: list[str] | None
) -> AsyncIterator[bytes]:
    if include_usage:
        head = {**head, "usage": None}

    def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None, **extra) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_event({**head, "choices": [{**choice, **extra}]})

    async def choices() -> AsyncIterator[bytes]:
        if echo is not None:
            for index in range(run.num_choices):
                yield chunk(index, _echo_text(echo, index, run.n))
        offsets = [0] * run.num_choices
        async for index, out, finished in run.outputs():
            if out.delta_text or out.delta_logprobs:
                logprobs = None
                if want_logprobs and out.delta_logprobs:
                    logprobs, offsets[index] = completion_logprobs(out.delta_logprobs, offsets[index])
                yield chunk(index, out.delta_text, logprobs)
            if finished:
                yield chunk(index, "", None, out.finish_reason, stop_reason=out.stop_reason)

    async for event in stream_frame(choices(), run, head if include_usage else None):
        yield event
