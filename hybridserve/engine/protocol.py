"""The only boundary between the frontend and an engine worker: typed msgspec messages.

The frontend renders and tokenizes; the engine receives token ids and returns token ids, logprobs and
finish reasons. Stop strings are a text concept and are applied by the frontend, which aborts the
engine request when one matches.
"""

from __future__ import annotations

import enum

import msgspec

from hybridserve.sampling_params import SamplingParams


class FinishReason(enum.StrEnum):
    STOP = "stop"  # EOS, a stop token id, or (frontend) a stop string
    LENGTH = "length"  # max_tokens or the context limit
    ABORT = "abort"  # client went away or asked to cancel
    ERROR = "error"  # the engine could not serve this request


class EngineCoreRequest(msgspec.Struct, frozen=True):
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: list[int]
    arrival_time: float
    # Lower is served first: a request is admitted after every waiting request of a lower value and preempted
    # before any running one of a lower value. Online traffic is 0; batch jobs yield to it with a higher value.
    priority: int = 0


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprob of the sampled token and the top-k alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the full distribution
    top: list[tuple[int, float]]


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None


class SchedulerStats(msgspec.Struct, frozen=True, array_like=True):
    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks in use
    prefix_cache_queries: int = 0  # prompt tokens looked up since start
    prefix_cache_hits: int = 0  # of which served from cache
    num_preemptions: int = 0
    num_state_snapshots: int = 0  # recurrent-state snapshots held (hybrid models)
    state_snapshot_usage: float = 0.0  # fraction of snapshot slots holding one
    state_snapshot_hits: int = 0  # admissions whose recurrent state was restored from a snapshot


class EngineCoreOutputs(msgspec.Struct, frozen=True, array_like=True, tag=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


class AbortRequests(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request_ids: list[str]


class AddRequest(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request: EngineCoreRequest


class Shutdown(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


EngineInput = AddRequest | AbortRequests | Shutdown


class EngineFacts(msgspec.Struct, frozen=True, array_like=True):
    """What the frontend needs to know about a loaded engine; a worker sends it with its ready message."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
