"""Continuous batching with chunked prefill and preemption by recompute, by priority then first come first served.

Each step has a token budget. Running requests go first (a decode costs one token, an unfinished
prefill its next chunk), then waiting requests are admitted while budget, sequence slots and KV
blocks last (a prefill chunk may end early, at a block boundary whose recurrent state is snapshotted for
later prefix hits). There is no prefill/decode phase: a request simply has tokens not yet computed. When
blocks run out the most recently admitted request is preempted: it gives its blocks back and is
recomputed later from its prompt plus the tokens it already produced, so its output is unchanged.
Priorities order both queues: a request waits behind every waiting request of a lower priority value, and
the running list is kept in (priority, admission) order, so preemption takes the least urgent work first.

`schedule()` writes the step as a plain-data plan (plan.py) for the model runner, and `update(plan, sampled)`
applies what the runner sampled; in between the scheduler touches no tensor.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Mapping

from hybridserve.config import EngineConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.plan import NewRequest, ScheduledRequest, SchedulerOutput
from hybridserve.engine.protocol import EngineCoreOutput, FinishReason, SchedulerStats
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.sampler import SampleResult


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
        self._blocks_sent: dict[str, int] = {}  # per running request: how much of its block table the runner has
        self.finished_ids: list[str] = []  # ended since the last plan, after the runner had seen them

    def add(self, request: Request) -> None:
        """Queue a new request behind every waiting request of its priority or a lower value."""
        self.requests[request.request_id] = request
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > request.priority:
            i -= 1
        self.waiting.insert(i, request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        new: list[NewRequest] = []
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
                scheduled.append((req, n))
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
                new.append(NewRequest(req.request_id, req.prompt_token_ids, req.params, req.eos_token_ids))
            req.move_to(RequestStatus.RUNNING)
            req.num_computed_tokens = num_cached
            self._run(req)
            scheduled.append((req, n))
            budget -= n
        plan = [self._scheduled(req, n) for req, n in scheduled]
        ops = self.kv.take_ops()
        finished, self.finished_ids = self.finished_ids, []
        return SchedulerOutput(plan, new, finished, ops.zero, ops.restore, ops.save)

    def _scheduled(self, req: Request, n: int) -> ScheduledRequest:
        """The plan's entry for `n` tokens of `req`, whose blocks are allocated; books its snapshot."""
        start = req.num_computed_tokens
        sent = self._blocks_sent.get(req.request_id)
        self._blocks_sent[req.request_id] = self.kv.num_blocks(req.request_id)  # a diff only: not the whole table
        slot = self.kv.state_slot(req.request_id) if self.kv.states is not None else -1
        self.kv.plan_snapshot(req, start + n)
        return ScheduledRequest(
            req.request_id,
            start,
            req.token_ids_range(start, start + n),
            self.kv.block_ids(req.request_id, sent or 0),
            sent is None,
            start + n == req.num_tokens,
            slot,
        )

    def update(self, plan: SchedulerOutput, sampled: Mapping[str, SampleResult]) -> list[EngineCoreOutput]:
        """Apply an executed plan: its tokens are computed, its snapshots written; each request that sampled
        takes its token (a grammar that forbids it fails that request), stops where it should, and reports."""
        for s in plan.scheduled:
            self.requests[s.request_id].num_computed_tokens += s.num_tokens
        self.kv.commit_step()
        outputs = []
        for rid in plan.sampling_ids:
            req, result = self.requests[rid], sampled[rid]
            if req.max_output_tokens == 0:  # the prompt only (its logprobs): done at prefill, the token unused
                req.finish(FinishReason.LENGTH)
                outputs.append(req.output([], prompt_logprobs=result.prompt_logprobs))
                continue
            req.output_token_ids.append(result.token_id)
            if req.grammar is not None and not req.grammar.accept(result.token_id):  # the mask forbids this
                outputs.append(self.fail(req, f"grammar rejected sampled token {result.token_id}"))
                continue
            req.check_stop()
            logprobs = None if result.logprobs is None else [result.logprobs]
            outputs.append(req.output([result.token_id], logprobs, prompt_logprobs=result.prompt_logprobs))
        for req in [r for r in self.running if r.status is RequestStatus.FINISHED]:
            self.running.remove(req)
            self._release(req, seen=True)
        return outputs

    def _run(self, req: Request) -> None:
        """Admit into the running list after every running request of its priority or a lower value."""
        i = len(self.running)
        while i > 0 and self.running[i - 1].priority > req.priority:
            i -= 1
        self.running.insert(i, req)

    def _preempt(self, req: Request) -> None:
        """Back to the head of its priority among the waiting: it resumes before newer work of its kind."""
        self.kv.free(req)
        self._blocks_sent.pop(req.request_id, None)  # its blocks are gone: it resumes with a new table
        req.move_to(RequestStatus.PREEMPTED)
        req.num_computed_tokens = 0
        i = 0
        while i < len(self.waiting) and self.waiting[i].priority < req.priority:
            i += 1
        self.waiting.insert(i, req)
        self.num_preemptions += 1

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        """End a request in any state (abort, error) and give its blocks back."""
        seen = req.status is not RequestStatus.WAITING  # scheduled at least once: the runner holds its state
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.finish(reason, stop_reason)
        self._release(req, seen)

    def fail(self, req: Request, error: str) -> EngineCoreOutput:
        self.finish(req, FinishReason.ERROR)
        return req.output([], error=error)

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """After a plan failed to execute: end every request with an error. What the step wrote may be half
        done, so the prefix cache and the snapshots it was to save are forgotten."""
        self.kv.abandon_step()
        return [self.fail(req, error) for req in list(self.requests.values())]

    def _release(self, req: Request, seen: bool) -> None:
        self.kv.free(req)
        del self.requests[req.request_id]
        self._blocks_sent.pop(req.request_id, None)
        if seen:
            self.finished_ids.append(req.request_id)

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
