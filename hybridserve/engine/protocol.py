"""The only boundary between the frontend and an engine worker: typed msgspec messages.

The frontend renders and tokenizes; the engine receives token ids and returns token ids, logprobs and
finish reasons. Stop strings are a text concept and are applied by the frontend, which aborts the
engine request when one matches.
"""

from __future__ import annotations

import enum
import functools
import hashlib

import msgspec

from hybridserve.engine.cache.events import CachedSet, KVEventBatch
from hybridserve.engine.kv_transfer.messages import AddTransferPeer, KVTransfer, TransferEndpoint, TransferSource
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
    # Disaggregation: prefill here and hold the KV for a decode worker, or read it from the prefill worker.
    kv_transfer: KVTransfer | None = None


class TokenLogprobs(msgspec.Struct, frozen=True, array_like=True):
    """Logprob of the sampled token and the top-k alternatives (id, logprob), best first."""

    token_id: int
    logprob: float
    rank: int  # 1-based rank of the sampled token in the full distribution
    top: list[tuple[int, float]]


class EngineUnavailable(RuntimeError):
    """No engine worker can take the request now (they are down or refused); retrying later may succeed."""


class EngineCoreOutput(msgspec.Struct, frozen=True, array_like=True):
    request_id: str
    new_token_ids: list[int]
    new_logprobs: list[TokenLogprobs] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | None = None  # the stop token id that ended the request, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0
    error: str | None = None
    unavailable: bool = False  # with finish reason error: the worker serving it went down (retrying may succeed)
    # A RemoteDecode request after its first token: where its KV and state wait for the decode worker.
    kv_transfer: TransferSource | None = None
    # With the first output of a request that asked for them: prompt tokens 1..P-1 (token 0 has no logprob).
    prompt_logprobs: list[TokenLogprobs] | None = None


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
    kv_held: int = 0  # prefill worker: prefilled requests held for their decode worker
    kv_pulling: int = 0  # decode worker: requests whose KV and state are being read
    kv_pulls_done: int = 0  # decode worker: reads completed since start
    kv_pulls_failed: int = 0  # of which failed (peer gone, error, deadline)
    kv_leases_expired: int = 0  # prefill worker: held requests let go because no reader came within the lease
    kv_staged: int = 0  # requests whose KV this worker packed into (or scattered from) its staging arena
    kv_pulled_kv_bytes: int = 0  # bytes of KV blocks read since start
    kv_pulled_state_bytes: int = 0  # bytes of recurrent state read since start
    kv_pull_kv_seconds: float = 0.0  # the KV parts' read times, summed
    kv_pull_state_seconds: float = 0.0  # the state parts' read times, summed
    spec_decode_num_drafts: int = 0  # speculative decoding: steps in which a request verified a draft
    spec_decode_num_draft_tokens: int = 0  # draft tokens verified since start
    spec_decode_num_accepted_tokens: int = 0  # of which accepted


class EngineCoreOutputs(msgspec.Struct, frozen=True, array_like=True, tag=True):
    outputs: list[EngineCoreOutput]
    stats: SchedulerStats | None = None


class AbortRequests(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request_ids: list[str]


class AddRequest(msgspec.Struct, frozen=True, array_like=True, tag=True):
    request: EngineCoreRequest


class Hello(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A frontend's first message to a worker. A new `session` of the same `frontend` ends the old one's requests."""

    frontend: str
    session: str
    secret: str = ""
    protocol: str = ""  # the frontend's protocol_fingerprint()


class Ping(msgspec.Struct, frozen=True, array_like=True, tag=True):
    pass


class GetCachedSet(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Ask for the worker's whole prefix cache (answered with a `CachedSet`), after missing a KV event batch."""


class CheckIntegrity(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """Ask the worker to run every cache's integrity check now (answered with an `IntegrityReport`)."""


EngineInput = AddRequest | AbortRequests | Hello | Ping | GetCachedSet | AddTransferPeer | CheckIntegrity


class Pong(msgspec.Struct, frozen=True, array_like=True, tag=True):
    stats: SchedulerStats


class Refused(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """The worker will not serve this frontend (a wrong secret, a message before Hello)."""

    error: str


class WorkerStatus(msgspec.Struct, frozen=True):
    """One engine worker as the frontend sees it, for /health and /metrics."""

    name: str
    state: str  # up, connecting, down, refused
    error: str | None  # why it is down or refused
    stats: SchedulerStats
    policy: str = ""  # the routing policy that sends it requests
    load_tokens: int = 0  # tokens of the requests routed to it and not finished
    routed_hits: int = 0  # requests routed to it that matched cached blocks there
    routed_misses: int = 0
    matched_blocks: int = 0
    restarts: int = 0  # times a local worker's process was started again after it died
    role: str = "both"  # prefill, decode, or both


class EngineFacts(msgspec.Struct, frozen=True, array_like=True):
    """What the frontend needs to know about a loaded engine; a worker sends it with its ready message."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int


class WorkerIdentity(msgspec.Struct, frozen=True, array_like=True):
    """What a frontend checks before it trusts a worker: the model it loaded, by content, and how it runs it."""

    model: str  # the checkpoint's name (a directory's or a GGUF file's)
    weights: str  # fingerprint of the weight files
    tokenizer: str  # fingerprint of the tokenizer and chat-template files
    dtype: str
    recurrent_state: bool  # the model has linear-attention layers: prefix hits need state snapshots
    facts: EngineFacts

    def mismatch(self, other: WorkerIdentity) -> str | None:
        """The first field in which `other` differs from this identity, as 'name: theirs != ours'."""
        mine = {**msgspec.structs.asdict(self), **msgspec.structs.asdict(self.facts)}
        theirs = {**msgspec.structs.asdict(other), **msgspec.structs.asdict(other.facts)}
        for name in ("model", "weights", "tokenizer", "dtype", "block_size", "max_model_len", "vocab_size"):
            if mine[name] != theirs[name]:
                return f"{name} {theirs[name]!r} != {mine[name]!r}"
        return None


class Welcome(msgspec.Struct, frozen=True, array_like=True, tag=True):
    """A worker's answer to Hello: who it is, and where its KV-event PUB socket is bound (for tcp, a frontend
    connects to that port on the host it reached the worker at); a prefill or decode worker also says how to
    reach its KV-transfer side."""

    identity: WorkerIdentity
    events_address: str
    role: str = "both"  # prefill, decode, or both (aggregated)
    transfer: TransferEndpoint | None = None


class IntegrityReport(msgspec.Struct, frozen=True, array_like=True, tag=True):
    error: str | None  # None: every check passed
    stats: SchedulerStats


WorkerOutput = EngineCoreOutputs | Pong | Refused | Welcome | CachedSet | IntegrityReport


@functools.cache
def protocol_fingerprint() -> str:
    """A digest of every message's layout (names, types, order). Messages travel as arrays, so a frontend and a
    worker built from different code would misread each other's fields without an error; instead the worker
    refuses a Hello whose fingerprint differs from its own."""
    schema = msgspec.json.schema_components([EngineInput, WorkerOutput, KVEventBatch])
    return hashlib.sha256(msgspec.json.encode(schema)).hexdigest()[:16]
