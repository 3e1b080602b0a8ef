"""Continuous batching with chunked prefill and preemption by recompute, first come first served.

Each step has a token budget. Running requests go first (a decode costs one token, an unfinished
prefill its next chunk), then waiting requests are admitted while budget, sequence slots and KV
blocks last (a prefill chunk may end early, at a block boundary whose recurrent state is snapshotted for
later prefix hits). There is no prefill/decode phase: a request simply has tokens not yet computed. When
blocks run out the most recently admitted request is preempted: it gives its blocks back and is
recomputed later from its prompt plus the tokens it already produced, so its output is unchanged.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.protocol import FinishReason, SchedulerStats
from hybridserve.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledRequest:
    request: Request
    num_new_tokens: int

    @property
    def samples(self) -> bool:
        """Whether this step computes the request's last known token, so a new token is sampled."""
        return self.request.num_computed_tokens + self.num_new_tokens == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)


class Scheduler:
    def __init__(self, config: EngineConfig, kv: KVCacheManager, device_type: str) -> None:
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.token_budget(device_type)
        self.chunk_limit = config.long_prefill_token_threshold or self.max_num_batched_tokens
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0

    def add(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[ScheduledRequest] = []
        preempted = False
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.chunk_limit)
            n = self.kv.chunk_tokens(req, req.num_computed_tokens, n)
            while not self.kv.allocate(req, n):
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                scheduled.append(ScheduledRequest(req, n))
                budget -= n
                i += 1
        # Admitting new work right after a preemption would only thrash the cache.
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not preempted:
            req = self.waiting[0]
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = self.kv.chunk_tokens(req, num_cached, min(req.num_tokens - num_cached, budget, self.chunk_limit))
            if not self.kv.allocate(req, n, cached):
                break
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:  # first admission, not a resumption
                req.num_cached_tokens = num_cached
            req.move_to(RequestStatus.RUNNING)
            req.num_computed_tokens = num_cached
            self.running.append(req)
            scheduled.append(ScheduledRequest(req, n))
            budget -= n
        return SchedulerOutput(scheduled)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.move_to(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        self.waiting.appendleft(req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        """End a request in any state (abort, error) and give its blocks back."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if req.status is not RequestStatus.FINISHED:
            req.finish(reason, stop_reason)
        self.kv.free(req)
        del self.requests[req.request_id]

    def complete_step(self, output: SchedulerOutput) -> None:
        """Account for the tokens a step computed (sampled tokens are appended by the caller) and snapshot
        recurrent state that the step left on a block boundary."""
        for s in output.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
            self.kv.snapshot(s.request)

    def retire_finished(self) -> None:
        for req in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            self.running.remove(req)
            self.kv.free(req)
            del self.requests[req.request_id]

    def stats(self) -> SchedulerStats:
        snapshots = self.kv.snapshots
        return SchedulerStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            kv_cache_usage=self.kv.usage,
            prefix_cache_queries=self.kv.prefix_queries,
            prefix_cache_hits=self.kv.prefix_hits,
            num_preemptions=self.num_preemptions,
            num_state_snapshots=len(snapshots) if snapshots is not None else 0,
            state_snapshot_usage=len(snapshots) / snapshots.num_snapshots if snapshots is not None else 0.0,
            state_snapshot_hits=snapshots.num_restored if snapshots is not None else 0,
        )
