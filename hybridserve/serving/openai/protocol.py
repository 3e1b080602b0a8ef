"""Request models for Chat Completions and Completions, and their mapping to SamplingParams.

Responses are plain dicts built where they are sent (see chat.py, completions.py): the streaming path
encodes one small dict per chunk, and tests check the shapes against OpenAI's published schemas.
Unknown request fields are ignored, as OpenAI clients send extras. Known fields take JSON's own types
(strict): `"stream": "yes"` is no boolean, `"temperature": false` no number, `"n": "2"` no integer; and
numbers must be finite (`Infinity`, `NaN` and overflowing literals such as `1e999` are refused).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from hybridserve.sampling_params import (
    MAX_LOGPROBS,
    MAX_N,
    MAX_TEMPERATURE,
    InvalidParameter,
    SamplingDefaults,
    SamplingParams,
)
from hybridserve.serving.openai.errors import APIError, invalid_parameter
from hybridserve.serving.openai.priority import PRIORITY_LIMIT


class RequestModel(BaseModel):
    """A request body's model (or a part of one): strict JSON types, finite numbers."""

    model_config = ConfigDict(strict=True, allow_inf_nan=False)


def ranged(default: Any = None, **bounds: float) -> Any:
    """A field whose published schema states the range SamplingParams checks (`minimum`, `exclusiveMinimum`,
    `maximum`); the check itself stays SamplingParams' (or the service's), whose error names the field and the value."""
    return Field(default, json_schema_extra=bounds)


LOGPROBS_RANGE = {"minimum": 0, "maximum": MAX_LOGPROBS}


class StreamOptions(RequestModel):
    include_usage: bool | None = False


class SamplingRequest(RequestModel):
    """Fields shared by both endpoints: OpenAI's, then vLLM's extras."""

    model: str | None = None
    max_tokens: int | None = ranged(minimum=1)
    temperature: float | None = ranged(minimum=0, maximum=MAX_TEMPERATURE)
    top_p: float | None = ranged(exclusiveMinimum=0, maximum=1)
    n: int | None = ranged(1, minimum=1, maximum=MAX_N)
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = ranged(minimum=-(2**63), maximum=2**63 - 1)
    presence_penalty: float | None = ranged(minimum=-2, maximum=2)
    frequency_penalty: float | None = ranged(minimum=-2, maximum=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    top_k: int | None = ranged(minimum=-1)
    min_p: float | None = ranged(minimum=0, maximum=1)
    repetition_penalty: float | None = ranged(exclusiveMinimum=0)
    min_tokens: int | None = ranged(minimum=0)
    ignore_eos: bool | None = None
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    prompt_logprobs: int | None = ranged(**LOGPROBS_RANGE)  # vLLM's: each prompt token's logprob and top k
    priority: int | None = ranged(minimum=-PRIORITY_LIMIT, maximum=PRIORITY_LIMIT)  # vLLM's; see openai/priority.py

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise APIError(400, "stream_options is only allowed when stream is true.", param="stream_options")

    def sampling_params(
        self,
        logprobs: int | None,
        max_tokens: int | None,
        renames: dict[str, str],
        vocab_size: int,
        defaults: SamplingDefaults,
        prompt_logprobs: int | None = None,
        prompt_only: bool = False,
    ) -> SamplingParams:
        """Validated SamplingParams, `defaults` where the request leaves a field out; an out-of-range value is a
        400 naming the request's field. `prompt_only`: max_tokens may be 0 (the prompt's logprobs, no output)."""
        try:
            if max_tokens is not None and not prompt_only and max_tokens < 1:
                raise InvalidParameter("max_tokens", f"max_tokens must be at least 1, got {max_tokens}")
            return SamplingParams(
                n=_default(self.n, 1),
                temperature=_default(self.temperature, defaults.temperature),
                top_p=_default(self.top_p, defaults.top_p),
                top_k=_default(self.top_k, defaults.top_k),
                min_p=_default(self.min_p, defaults.min_p),
                seed=self.seed,
                presence_penalty=_default(self.presence_penalty, 0.0),
                frequency_penalty=_default(self.frequency_penalty, 0.0),
                repetition_penalty=_default(self.repetition_penalty, defaults.repetition_penalty),
                logit_bias=_logit_bias(self.logit_bias, vocab_size),
                logprobs=logprobs,
                prompt_logprobs=prompt_logprobs,
                max_tokens=max_tokens,
                min_tokens=_default(self.min_tokens, 0),
                stop=_stop(self.stop),
                stop_token_ids=_token_ids("stop_token_ids", self.stop_token_ids or (), vocab_size),
                include_stop_str_in_output=bool(self.include_stop_str_in_output),
                ignore_eos=bool(self.ignore_eos),
                skip_special_tokens=_default(self.skip_special_tokens, True),
            )
        except InvalidParameter as exc:
            raise invalid_parameter(exc, renames) from None


class ContentPart(RequestModel):
    model_config = ConfigDict(extra="allow")
    type: str
    text: str | None = None


class ChatMessage(RequestModel):
    model_config = ConfigDict(extra="allow")  # tool_calls, tool_call_id, ... reach the template as given
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = ranged(minimum=1)
    logprobs: bool | None = False
    top_logprobs: int | None = ranged(**LOGPROBS_RANGE)
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    thinking: bool | dict[str, Any] | None = None
    return_token_ids: bool | None = None  # the prompt ids the engine received and each choice's output ids

    @property
    def max_tokens_param(self) -> str:
        return "max_completion_tokens" if self.max_completion_tokens is not None else "max_tokens"

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def num_logprobs(self) -> int | None:
        if not self.logprobs:
            if self.top_logprobs is not None:
                raise APIError(400, "top_logprobs requires logprobs to be true.", param="top_logprobs")
            return None
        return _default(self.top_logprobs, 0)

    def template_messages(self) -> list[dict[str, Any]]:
        """Messages as the chat template expects them: content as one string (empty beside tool calls)."""
        if not self.messages:
            raise APIError(400, "messages must contain at least one message.", param="messages")
        out = []
        for i, message in enumerate(self.messages):
            item: dict[str, Any] = dict(message.model_extra or {})
            item["role"] = message.role
            item["content"] = _text(message.content, f"messages[{i}].content")
            if message.name is not None:
                item["name"] = message.name
            out.append(item)
        return out


class CompletionRequest(SamplingRequest):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = ranged(minimum=0)  # 0: the prompt only (with echo and logprobs: scoring it)
    echo: bool | None = False
    logprobs: int | None = ranged(**LOGPROBS_RANGE)
    suffix: str | None = None
    best_of: int | None = None

    def check_supported(self) -> None:
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server.", param="suffix")
        if self.best_of is not None and self.best_of != _default(self.n, 1):
            raise APIError(400, "best_of is not supported by this server (it must equal n).", param="best_of")

    def num_prompt_logprobs(self) -> int | None:
        """Alternatives per prompt token to compute: echo with logprobs (OpenAI's legacy way to score a prompt)
        reports the prompt's tokens as it reports the output's; vLLM's prompt_logprobs adds its own field."""
        wanted = [k for k in (self.logprobs if self.echo else None, self.prompt_logprobs) if k is not None]
        return max(wanted) if wanted else None


def list_page(data: list[dict[str, Any]], has_more: bool) -> dict[str, Any]:
    """One page of a list endpoint (files, batches, input items), in OpenAI's cursor form."""
    return {
        "object": "list",
        "data": data,
        "first_id": data[0]["id"] if data else None,
        "last_id": data[-1]["id"] if data else None,
        "has_more": has_more,
    }


def _default(value, default):
    return default if value is None else value


def _stop(stop: str | list[str] | None) -> tuple[str, ...]:
    if stop is None:
        return ()
    return (stop,) if isinstance(stop, str) else tuple(stop)


def _token_ids(param: str, ids, vocab_size: int) -> tuple[int, ...]:
    for token_id in ids:
        if not 0 <= token_id < vocab_size:
            raise InvalidParameter(param, f"{param} contains token id {token_id}, outside [0, {vocab_size})")
    return tuple(ids)


def _logit_bias(bias: dict[str, float] | None, vocab_size: int) -> dict[int, float]:
    if not bias:
        return {}
    out = {}
    for key, value in bias.items():
        try:
            token_id = int(key)
        except ValueError:
            raise InvalidParameter("logit_bias", f"logit_bias keys must be token ids, got {key!r}") from None
        _token_ids("logit_bias", (token_id,), vocab_size)
        out[token_id] = value
    return out


def _text(content: str | list[ContentPart] | None, param: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(
                400, f"Only text content parts are supported, got type {part.type!r}.", param=f"{param}[{j}]"
            )
        if part.text is None:
            raise APIError(400, "A text content part needs a 'text' field.", param=f"{param}[{j}].text")
        texts.append(part.text)
    return "\n".join(texts)
