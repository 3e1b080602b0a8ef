"""An engine request and its explicit state machine."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

from hybridserve.engine.kv_transfer.messages import RemoteDecode, RemotePrefill, TransferSource
from hybridserve.engine.protocol import EngineCoreOutput, EngineCoreRequest, FinishReason, TokenLogprobs
from hybridserve.sampling_params import SamplingParams

if TYPE_CHECKING:
    from hybridserve.engine.structured_output import SequenceGrammar


class RequestStatus(enum.Enum):
    WAITING = enum.auto()  # queued, holds no blocks
    RUNNING = enum.auto()  # scheduled; holds blocks
    PREEMPTED = enum.auto()  # blocks taken back; waits to be recomputed from scratch
    PULLING = enum.auto()  # decode worker: holds blocks and a state slot being filled from its prefill worker
    HELD = enum.auto()  # prefill worker: prefilled, its blocks and state kept for the decode worker to read
    FINISHED = enum.auto()


# Legal transitions; anything else is a scheduler bug and raises.
_TRANSITIONS = {
    RequestStatus.WAITING: {RequestStatus.RUNNING, RequestStatus.PULLING, RequestStatus.FINISHED},
    RequestStatus.RUNNING: {RequestStatus.PREEMPTED, RequestStatus.HELD, RequestStatus.FINISHED},
    RequestStatus.PREEMPTED: {RequestStatus.RUNNING, RequestStatus.FINISHED},
    # A read that failed under the recompute policy: the request starts again as a local prefill.
    RequestStatus.PULLING: {RequestStatus.RUNNING, RequestStatus.WAITING, RequestStatus.FINISHED},
    RequestStatus.HELD: {RequestStatus.FINISHED},
    RequestStatus.FINISHED: set(),
}


class Request:
    def __init__(self, core: EngineCoreRequest, max_model_len: int) -> None:
        self.request_id = core.request_id
        self.prompt_token_ids = core.prompt_token_ids
        self.params: SamplingParams = core.sampling_params
        self.eos_token_ids = [] if self.params.ignore_eos else list(core.eos_token_ids)
        self.arrival_time = core.arrival_time
        self.priority = core.priority
        self.output_token_ids: list[int] = []
        # Disaggregation: hold the KV for a decode worker after the first token (remote_decode), or read it
        # from the prefill worker (pull_from) and go on after the first token it sampled.
        self.remote_decode = isinstance(core.kv_transfer, RemoteDecode)
        self.pull_from: TransferSource | None = None
        if isinstance(core.kv_transfer, RemotePrefill):
            self.pull_from = core.kv_transfer.source
            self.output_token_ids.append(core.kv_transfer.first_token)
        # Tokens whose KV is in the cache (prompt and output alike).
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0  # prompt tokens served by the prefix cache at first scheduling
        self.status = RequestStatus.WAITING
        self.finish_reason: FinishReason | None = None
        self.stop_reason: int | None = None
        # Speculative decoding: its draft tokens judged so far, accepted and rejected (a verification rejects
        # at most one; the tokens after it are not judged).
        self.draft_accepted = 0
        self.draft_rejections = 0
        # Set once the grammar of params.structured_output is compiled, before the request is scheduled.
        self.grammar: SequenceGrammar | None = None
        budget = max_model_len - len(self.prompt_token_ids)
        self.max_output_tokens = budget if self.params.max_tokens is None else min(self.params.max_tokens, budget)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def all_token_ids(self) -> list[int]:
        return self.prompt_token_ids + self.output_token_ids

    def token_ids_range(self, start: int, end: int) -> list[int]:
        n_prompt = len(self.prompt_token_ids)
        if end <= n_prompt:
            return self.prompt_token_ids[start:end]
        if start >= n_prompt:
            return self.output_token_ids[start - n_prompt : end - n_prompt]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - n_prompt]

    def move_to(self, status: RequestStatus) -> None:
        if status not in _TRANSITIONS[self.status]:
            raise RuntimeError(f"request {self.request_id}: illegal transition {self.status.name} -> {status.name}")
        self.status = status

    def finish(self, reason: FinishReason, stop_reason: int | None = None) -> None:
        self.move_to(RequestStatus.FINISHED)
        self.finish_reason = reason
        self.stop_reason = stop_reason

    def check_stop(self) -> bool:
        """After a token was appended: finish the request if it hit a stop condition."""
        last = self.output_token_ids[-1]
        n_out = len(self.output_token_ids)
        if n_out >= self.params.min_tokens:
            if last in self.params.stop_token_ids:
                self.finish(FinishReason.STOP, last)
                return True
            if last in self.eos_token_ids:
                self.finish(FinishReason.STOP)
                return True
        if self.grammar is not None and self.grammar.terminated:  # its EOS, even with ignore_eos
            self.finish(FinishReason.STOP)
            return True
        if n_out >= self.max_output_tokens:
            self.finish(FinishReason.LENGTH)
            return True
        return False

    def output(
        self,
        new_ids: list[int],
        logprobs: list[TokenLogprobs] | None = None,
        error: str | None = None,
        kv_transfer: TransferSource | None = None,
        prompt_logprobs: list[TokenLogprobs] | None = None,
    ) -> EngineCoreOutput:
        """What the frontend hears of this request after a step: new tokens, and how it ended if it did."""
        return EngineCoreOutput(
            request_id=self.request_id,
            new_token_ids=new_ids,
            new_logprobs=logprobs,
            finish_reason=self.finish_reason,
            stop_reason=self.stop_reason,
            num_prompt_tokens=len(self.prompt_token_ids),
            num_cached_tokens=self.num_cached_tokens,
            error=error,
            kv_transfer=kv_transfer,
            prompt_logprobs=prompt_logprobs,
        )
