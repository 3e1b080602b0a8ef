"""What the frontend hands to API handlers and offline callers: text, ids and logprobs per sequence."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(frozen=True)
class TopLogprob:
    token_id: int
    token: str  # the token's text; a token that is part of a multi-byte character decodes lossily
    bytes: list[int]  # the token's exact UTF-8 bytes
    logprob: float


@dataclass(frozen=True)
class Logprob:
    """The sampled (or prompt) token and its top alternatives (best first)."""

    token_id: int
    token: str
    bytes: list[int]
    logprob: float
    top: list[TopLogprob]
    rank: int | None = None  # 1-based, in the whole distribution (ties count against the token)


@dataclass(frozen=True)
class CompletionOutput:
    """One update of one sequence (choice `index` of a request with n sequences)."""

    index: int
    delta_text: str  # text released by this update (stop strings never appear in it)
    delta_token_ids: list[int]
    delta_logprobs: list[Logprob] | None  # None unless logprobs were requested
    text: str  # all text released so far
    num_output_tokens: int  # tokens generated so far, stop-string tail included
    finish_reason: str | None = None  # "stop", "length", "abort", "error"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it
    error: str | None = None
    unavailable: bool = False  # with finish reason error: its worker went down; retrying may succeed
    # In the first update after the engine computed them (params.prompt_logprobs): one per prompt token, the
    # first None (nothing precedes it).
    prompt_logprobs: list[Logprob | None] | None = None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    num_prompt_tokens: int
    num_cached_tokens: int
    output: CompletionOutput
    finished: bool  # this sequence is done (the request is done when all n are)


@dataclass(frozen=True)
class Completion:
    """One finished sequence, whole."""

    index: int
    text: str
    token_ids: list[int]
    logprobs: list[Logprob] | None
    finish_reason: str | None
    stop_reason: int | str | None
    error: str | None


@dataclass
class FinalOutput:
    """A whole request's result, as the offline API returns it."""

    request_id: str
    prompt_token_ids: list[int]
    num_cached_tokens: int
    outputs: list[Completion] = field(default_factory=list)
    prompt_logprobs: list[Logprob | None] | None = None  # as in CompletionOutput, if asked for
