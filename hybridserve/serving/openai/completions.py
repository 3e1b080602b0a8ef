"""POST /v1/completions: one engine request per prompt (text, texts, token ids, or lists of them)."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass

from starlette.requests import Request
from starlette.responses import Response
from transformers import PreTrainedTokenizerBase

from hybridserve.engine.outputs import Logprob
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError, json_response
from hybridserve.serving.openai.generation import (
    GenerationRun,
    check_size,
    fit_to_context,
    prompt_logprobs_body,
    stream_frame,
)
from hybridserve.serving.openai.models import check_model
from hybridserve.serving.openai.priority import FCFS, engine_priority
from hybridserve.serving.openai.prompt import check_vocabulary, off_loop
from hybridserve.serving.openai.protocol import CompletionRequest
from hybridserve.serving.openai.sse import EventStreamResponse, cancel_on_disconnect, sse_event
from hybridserve.tokenizer.detokenizer import token_text


class CompletionService:
    def __init__(self, engine: ServingEngine, metrics: ServingMetrics, policy: str = FCFS) -> None:
        """`policy`: the server's --scheduling-policy."""
        self.engine = engine
        self.policy = policy
        self.metrics = metrics
        self.tokenizer = engine.tokenizer
        self.vocab_size = len(engine.tokenizer)

    def tokenize(self, prompt: str | list[str] | list[int] | list[list[int]]) -> list[list[int]]:
        texts = [prompt] if isinstance(prompt, str) else [p for p in prompt if isinstance(p, str)]
        for k, text in enumerate(texts):
            what = "prompt" if isinstance(prompt, str) or len(prompt) == 1 else f"prompt[{k}]"
            check_size(self.tokenizer, text, self.engine.max_model_len, what)
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
            check_vocabulary(ids, self.vocab_size, param, "prompt")
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
        priority = engine_priority(request, req.priority, self.policy)
        base = req.sampling_params(
            req.logprobs,
            req.max_tokens,
            {},
            self.vocab_size,
            self.engine.sampling_defaults,
            prompt_logprobs=req.num_prompt_logprobs(),
            prompt_only=True,
        )
        prompts = await off_loop(_size(req.prompt), self.tokenize, req.prompt)
        max_len = self.engine.max_model_len
        params = [fit_to_context(base, len(p), max_len, what="prompt", max_tokens_param="max_tokens") for p in prompts]
        echo = self.prompt_texts(req.prompt, prompts) if req.echo else None
        request_id = f"cmpl-{uuid.uuid4().hex}"
        run = GenerationRun(self.engine, self.metrics, request_id, prompts, params, arrival, priority)
        head = {
            "id": request_id,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.engine.model_name,
        }
        shape = ChoiceShape(
            self.tokenizer, prompts, run.n, echo, base.logprobs is not None, req.prompt_logprobs is not None
        )
        if req.stream:
            return EventStreamResponse(_stream(run, head, req.include_usage, shape))
        return await cancel_on_disconnect(request, _complete(run, head, shape))


def _size(prompt: str | list[str] | list[int] | list[list[int]]) -> int:
    """The characters or token ids `prompt` holds: the work of tokenizing and checking it."""
    if isinstance(prompt, str):
        return len(prompt)
    return sum(len(p) if isinstance(p, str | list) else 1 for p in prompt)


def completion_logprobs(entries: list[tuple[str, Logprob | None]], offset: int) -> tuple[dict, int]:
    """The legacy logprobs object for tokens given as (text, logprob), the first starting at text offset `offset`;
    a token without a logprob (the prompt's first) has null for its logprob and its alternatives."""
    tokens, token_logprobs, top_logprobs, text_offset = [], [], [], []
    for text, lp in entries:
        tokens.append(text)
        text_offset.append(offset)
        offset += len(text)
        if lp is None:
            token_logprobs.append(None)
            top_logprobs.append(None)
            continue
        logprob = max(lp.logprob, -9999.0)
        top = {t.token: max(t.logprob, -9999.0) for t in lp.top}
        top.setdefault(lp.token, logprob)
        token_logprobs.append(logprob)
        top_logprobs.append(top)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top_logprobs,
        "text_offset": text_offset,
    }
    return body, offset


@dataclass(frozen=True)
class ChoiceShape:
    """What a choice carries besides its text: the echoed prompt (`echo`: per prompt) first, logprobs (the
    prompt's too when echoed), vLLM's `prompt_logprobs`."""

    tokenizer: PreTrainedTokenizerBase
    prompts: list[list[int]]
    n: int
    echo: list[str] | None
    logprobs: bool
    prompt_logprobs: bool

    def echo_text(self, index: int) -> str:
        return self.echo[index // self.n] if self.echo is not None else ""

    def prompt_entries(
        self, index: int, prompt_logprobs: list[Logprob | None] | None
    ) -> list[tuple[str, Logprob | None]]:
        """The echoed prompt's tokens with their logprobs, for the legacy object (none without echo)."""
        if self.echo is None or not self.logprobs:
            return []
        if prompt_logprobs is None:
            raise APIError(500, "The engine sent no prompt logprobs for an echo with logprobs.", type=SERVER_ERROR)
        first = token_text(self.tokenizer, self.prompts[index // self.n][0])
        return [(first, None), *((lp.token, lp) for lp in prompt_logprobs[1:] if lp is not None)]

    def extras(self, prompt_logprobs: list[Logprob | None] | None) -> dict:
        if not self.prompt_logprobs:
            return {}
        if prompt_logprobs is None:
            raise APIError(500, "The engine sent no prompt logprobs.", type=SERVER_ERROR)
        return {"prompt_logprobs": prompt_logprobs_body(prompt_logprobs)}


def _entries(logprobs: list[Logprob]) -> list[tuple[str, Logprob | None]]:
    return [(lp.token, lp) for lp in logprobs]


async def _complete(run: GenerationRun, head: dict, shape: ChoiceShape) -> Response:
    choices = []
    for index, (out, logprobs) in enumerate(await run.collect(shape.logprobs)):
        prompt = run.prompt_logprobs[index]
        entries = shape.prompt_entries(index, prompt) + _entries(logprobs)
        choice = {
            "index": index,
            "text": shape.echo_text(index) + out.text,
            "logprobs": completion_logprobs(entries, 0)[0] if shape.logprobs else None,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        choices.append({**choice, **shape.extras(prompt)})
    return json_response({**head, "choices": choices, "usage": run.usage()})


async def _stream(run: GenerationRun, head: dict, include_usage: bool, shape: ChoiceShape) -> AsyncIterator[bytes]:
    """An echoed prompt (with its logprobs, and vLLM's prompt_logprobs) goes out when its choice's first update
    arrives, which carries them."""
    if include_usage:
        head = {**head, "usage": None}

    def chunk(index: int, text: str, logprobs: dict | None = None, finish_reason: str | None = None, **extra) -> bytes:
        choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish_reason}
        return sse_event({**head, "choices": [{**choice, **extra}]})

    async def choices() -> AsyncIterator[bytes]:
        offsets = [0] * run.num_choices
        started = [False] * run.num_choices
        async for index, out, finished in run.outputs():
            if not started[index]:
                started[index] = True
                entries = shape.prompt_entries(index, out.prompt_logprobs)
                extras = shape.extras(out.prompt_logprobs)
                if shape.echo is not None or extras:
                    logprobs, offsets[index] = completion_logprobs(entries, 0) if entries else (None, 0)
                    yield chunk(index, shape.echo_text(index), logprobs, **extras)
            if out.delta_text or out.delta_logprobs:
                logprobs = None
                if shape.logprobs and out.delta_logprobs:
                    logprobs, offsets[index] = completion_logprobs(_entries(out.delta_logprobs), offsets[index])
                yield chunk(index, out.delta_text, logprobs)
            if finished:
                yield chunk(index, "", None, out.finish_reason, stop_reason=out.stop_reason)

    async for event in stream_frame(choices(), run, head if include_usage else None):
        yield event
