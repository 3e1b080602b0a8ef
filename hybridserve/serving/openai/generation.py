"""One API request's engine work: an engine request per prompt, their merged outputs, usage and metrics.

Shared by the chat and completions endpoints. Engine failures surface as APIError (a 400 for input
the engine rejects, a 500 for an engine error or an abort the client did not cause), so both
endpoints report them in the same shape.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

from hybridserve.engine.outputs import CompletionOutput, Logprob, RequestOutput
from hybridserve.engine.protocol import EngineUnavailable
from hybridserve.sampling_params import InvalidParameter, SamplingParams
from hybridserve.serving.engine import ServingEngine
from hybridserve.serving.metrics import ServingMetrics
from hybridserve.serving.openai.errors import SERVER_ERROR, APIError, invalid_parameter
from hybridserve.serving.openai.prompt import too_long
from hybridserve.serving.openai.sse import SSE_DONE, aclose, sse_event

logger = logging.getLogger(__name__)


def check_size(tokenizer: Any, text: str, max_model_len: int, what: str, rendered: bool = False) -> None:
    """A 400 (context_length_exceeded) when `text`'s bytes alone prove it too long for the context: refused by
    its size, before seconds of tokenizing it (prompt.too_long)."""
    if (floor := too_long(tokenizer, text, max_model_len)) is None:
        return
    tokens, size, most = floor
    size_text = f"{size} bytes once rendered" if rendered else f"{size} bytes"
    raise APIError(
        400,
        f"This model's maximum context length is {max_model_len} tokens. However, your {what} is {size_text}, at "
        f"least {tokens} tokens (no token spans more than {most} bytes), which leaves no room for the completion. "
        f"Please reduce the length of the {what}.",
        param=what,
        code="context_length_exceeded",
    )


def fit_to_context(
    params: SamplingParams,
    prompt_len: int,
    max_model_len: int,
    *,
    what: str,
    max_tokens_param: str,
    renames: dict[str, str] | None = None,
) -> SamplingParams:
    """`params` with a completion budget that fits: max_tokens as asked, or all the room the prompt leaves."""
    limit = f"This model's maximum context length is {max_model_len} tokens."
    requested = params.max_tokens
    if requested is not None:
        if prompt_len + requested > max_model_len:
            raise APIError(
                400,
                f"{limit} However, you requested {prompt_len + requested} tokens ({prompt_len} in the "
                f"{what}, {requested} in the completion). Please reduce the length of the {what} or "
                "completion.",
                param=what if prompt_len >= max_model_len else max_tokens_param,
                code="context_length_exceeded",
            )
        return params
    if prompt_len >= max_model_len:
        raise APIError(
            400,
            f"{limit} However, your {what} resulted in {prompt_len} tokens, which leaves no room for the "
            f"completion. Please reduce the length of the {what}.",
            param=what,
            code="context_length_exceeded",
        )
    try:
        return dataclasses.replace(params, max_tokens=max_model_len - prompt_len)
    except InvalidParameter as exc:  # e.g. min_tokens above the room left
        raise invalid_parameter(exc, renames) from None


def usage_body(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


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


def prompt_logprobs_body(prompt_logprobs: list[Logprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (the first: null) the token and its top alternatives by id,
    each with its logprob, rank and text."""
    body: list[dict | None] = []
    for lp in prompt_logprobs:
        if lp is None:
            body.append(None)
            continue
        entry = {str(lp.token_id): {"logprob": max(lp.logprob, -9999.0), "rank": lp.rank, "decoded_token": lp.token}}
        for rank, top in enumerate(lp.top, start=1):
            entry.setdefault(
                str(top.token_id), {"logprob": max(top.logprob, -9999.0), "rank": rank, "decoded_token": top.token}
            )
        body.append(entry)
    return body


class RunAccounting:
    """The metrics and usage counts of one API request's choices, fed each output as it arrives.

    Choice `k * n + i` is sequence i of prompt k. Shared by GenerationRun and the post-processing path,
    which sees only counts."""

    def __init__(self, metrics: ServingMetrics, arrival: float, prompt_lens: list[int], n: int) -> None:
        self.metrics = metrics
        self.arrival = arrival
        self.prompt_lens = prompt_lens
        self.n = n
        self.output_tokens = [0] * (len(prompt_lens) * n)
        self.cached_tokens = [0] * len(prompt_lens)
        self.finished = [False] * (len(prompt_lens) * n)
        self._admitted = [False] * len(prompt_lens)
        self._unfinished = [n] * len(prompt_lens)
        self._last_token_at = [0.0] * (len(prompt_lens) * n)

    def usage(self) -> dict:
        return usage_body(sum(self.prompt_lens), sum(self.output_tokens), sum(self.cached_tokens))

    def observe(
        self, k: int, index: int, new_tokens: int, output_tokens: int, cached: int, finish_reason: str | None
    ) -> None:
        """Prompt k's choice `index` produced `new_tokens` (finishing with `finish_reason`, if set)."""
        m, now = self.metrics, time.monotonic()
        if not self._admitted[k]:
            self._admitted[k] = True
            m.prompt_tokens.inc(self.prompt_lens[k])
            m.ttft.observe(now - self.arrival)
        if new_tokens:
            m.generation_tokens.inc(new_tokens)
            if self._last_token_at[index]:
                m.itl.observe(now - self._last_token_at[index])
            self._last_token_at[index] = now
        self.output_tokens[index] = output_tokens
        self.cached_tokens[k] = max(self.cached_tokens[k], cached)
        if finish_reason is not None and finish_reason not in ("error", "abort"):
            self.finished[index] = True
            m.outcomes[finish_reason].inc()
            self._unfinished[k] -= 1
            if not self._unfinished[k]:
                m.e2e.observe(now - self.arrival)

    def close(self, outcome: str | None) -> None:
        """Counts every choice that did not finish as `outcome` (None: not counted, it never started)."""
        if outcome is not None:
            for done in self.finished:
                if not done:
                    self.metrics.outcomes[outcome].inc()


class GenerationRun:
    """Runs `prompts` (each with its SamplingParams) and yields `(choice_index, output, finished)`.

    Choice `k * n + i` is sequence i of prompt k. Closing or cancelling `outputs()` aborts every
    engine request still running.
    """

    def __init__(
        self,
        engine: ServingEngine,
        metrics: ServingMetrics,
        request_id: str,
        prompts: list[list[int]],
        params: list[SamplingParams],
        arrival: float,
        priority: int = 0,
    ) -> None:
        self.engine = engine
        self.request_id = request_id
        self.priority = priority
        self.prompts = prompts
        self.params = params
        self.n = params[0].n
        self.num_choices = len(prompts) * self.n
        self.accounting = RunAccounting(metrics, arrival, list(map(len, prompts)), self.n)
        self.token_ids: list[list[int]] = [[] for _ in range(self.num_choices)]  # each choice's output so far
        # each choice's prompt logprobs, once they arrived (params.prompt_logprobs)
        self.prompt_logprobs: list[list[Logprob | None] | None] = [None] * self.num_choices

    def usage(self) -> dict:
        return self.accounting.usage()

    async def collect(self, want_logprobs: bool) -> list[tuple[CompletionOutput, list[Logprob]]]:
        """Runs to the end: each choice's final output and, if wanted, all its logprobs."""
        final: list[CompletionOutput | None] = [None] * self.num_choices
        logprobs: list[list[Logprob]] = [[] for _ in range(self.num_choices)]
        async for index, out, _ in self.outputs():
            final[index] = out
            if want_logprobs and out.delta_logprobs:
                logprobs[index].extend(out.delta_logprobs)
        if any(out is None or out.finish_reason is None for out in final):
            raise APIError(500, "The engine ended the request before every choice finished.", type=SERVER_ERROR)
        return list(zip(final, logprobs, strict=True))

    def _engine_request_id(self, k: int) -> str:
        return self.request_id if len(self.prompts) == 1 else f"{self.request_id}-{k}"

    async def outputs(self) -> AsyncIterator[tuple[int, CompletionOutput, bool]]:
        streams = [
            self.engine.generate(p, sp, self._engine_request_id(k), self.priority)
            for k, (p, sp) in enumerate(zip(self.prompts, self.params, strict=True))
        ]
        merged = _merge(streams)
        acct = self.accounting
        outcome: str | None = "abort"  # what unfinished sequences count as if we leave early
        try:
            async for k, ro in merged:
                out = ro.output
                index = k * self.n + out.index
                reason = out.finish_reason if ro.finished else None
                acct.observe(k, index, len(out.delta_token_ids), out.num_output_tokens, ro.num_cached_tokens, reason)
                self.token_ids[index].extend(out.delta_token_ids)
                if out.prompt_logprobs is not None:
                    self.prompt_logprobs[index] = out.prompt_logprobs
                if out.finish_reason in ("error", "abort"):
                    raise engine_failure(out.finish_reason, out.error, out.unavailable)
                yield index, out, ro.finished
        except APIError:
            outcome = "error"
            raise
        except EngineUnavailable as exc:
            outcome = "error"
            raise unavailable_error(str(exc)) from None
        except ValueError as exc:  # the engine rejected the input before doing any work
            outcome = None
            raise APIError(400, str(exc), param=getattr(exc, "param", None)) from None
        except Exception as exc:
            outcome = "error"
            logger.exception("request %s failed in the engine", self.request_id)
            raise APIError(500, f"The engine failed to serve the request: {exc}", type=SERVER_ERROR) from exc
        finally:
            await merged.aclose()
            for stream in streams:
                await aclose(stream)
            acct.close(outcome)


def engine_failure(finish_reason: str, error: str | None, unavailable: bool = False) -> APIError:
    """The error a client sees for an engine output that ended with "error" or "abort"; 503 when the worker
    serving it went down (another may serve a retry)."""
    if unavailable:
        return unavailable_error(error or "The engine worker serving the request went down.")
    if finish_reason == "error":
        return APIError(500, error or "The engine failed to serve the request.", type=SERVER_ERROR)
    return APIError(500, "The engine aborted the request before it finished.", type=SERVER_ERROR)


def unavailable_error(message: str) -> APIError:
    return APIError(503, message, type=SERVER_ERROR, code="engine_unavailable")


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """Interleaves a batch's engine streams as outputs arrive; one stream passes straight through."""
    if len(streams) == 1:
        async for item in streams[0]:
            yield 0, item
        return
    queue: asyncio.Queue[tuple[int, RequestOutput | None, BaseException | None]] = asyncio.Queue()

    async def pump(k: int, stream: AsyncIterator[RequestOutput]) -> None:
        try:
            async for item in stream:
                queue.put_nowait((k, item, None))
            queue.put_nowait((k, None, None))
        except Exception as exc:
            queue.put_nowait((k, None, exc))

    tasks = [asyncio.create_task(pump(k, s)) for k, s in enumerate(streams)]
    try:
        live = len(tasks)
        while live:
            k, item, exc = await queue.get()
            if exc is not None:
                raise exc
            if item is None:
                live -= 1
            else:
                yield k, item
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def stream_frame(
    choices: AsyncIterator[bytes], run: GenerationRun, usage_head: dict | None
) -> AsyncIterator[bytes]:
    """What every streamed completion shares around its choice chunks: an engine failure becomes an error
    event, a usage chunk follows when one was asked for (`usage_head`), and [DONE] ends the stream."""
    try:
        async for event in choices:
            yield event
    except APIError as exc:
        yield sse_event(exc.body())
        yield SSE_DONE
        return
    if usage_head is not None:
        yield sse_event({**usage_head, "choices": [], "usage": run.usage()})
    yield SSE_DONE
