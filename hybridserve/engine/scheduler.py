"""Continuous batching with chunked prefill and preemption by recompute, by priority then first come first served.

Each step has a token budget. Running requests go first (a decode costs one token, an unfinished
prefill its next chunk), then waiting requests are admitted while budget, sequence slots and KV
blocks last (a prefill chunk may end early, at a block boundary whose recurrent state is snapshotted for
later prefix hits). A prefill chunk first takes at most its share of the budget (`long_prefill_share`), so
new requests are admitted and short prompts finish while a long one is chunked; the budget the others leave
then goes back to the chunks the share cut short, fewest tokens left first, so a lone long prompt still fills
the step. A share never lets work pass more urgent work: before a request of a higher priority value gets
budget, the more urgent chunks get theirs back. There is no prefill/decode phase: a request simply has
tokens not yet computed. When blocks run out the most recently admitted request is preempted: it gives its
blocks back and is recomputed later from its prompt plus the tokens it already produced, so its output is
unchanged.
Priorities order both queues: a request waits behind every waiting request of a lower priority value, and
the running list is kept in (priority, admission) order, so preemption takes the least urgent work first.
While online work runs or waits, batch work (priorities from step_budget.BACKGROUND_PRIORITY up) shares at most
`batch_step_tokens` of a step: an online request's steps, and the step it waits for, stay short.

`schedule()` writes the step as a plain-data plan (plan.py) for the model runner, and `update(plan, sampled)`
applies what the runner sampled; in between the scheduler touches no tensor.

Disaggregation adds two states, kept by the KV connector's scheduler half (kv_transfer/connector_scheduler.py). A
prefill worker's RemoteDecode request, once it sampled its first token, is HELD: out of the running list, its
blocks and state slot kept for the decode worker to read, until released. A decode worker's RemotePrefill request
is admitted into PULLING (blocks for its prompt and a state slot, no step budget) when the connector has room for
its read, which the plan orders; once the worker half reports it landed, it runs like any other request, starting
with the first token the prefill worker sampled (`transfer_update`).

Speculative decoding (`--speculative-config`): a decoding request also takes the tokens its proposer drafts
(drafting.py) after its last known token, within the step's budget, its output limit and the draft length the
step's cost allows it (`drafting.draft_lengths`), so the runner scores them in the same step; a draft never costs a
preemption (the request then decodes without one). Update keeps
the tokens the sampler accepted and moves the request's computed tokens back past the rejected ones: their KV
slots are overwritten later, and no block holding them becomes findable (blocks are findable only up to the
known tokens). The proposer keeps what it knows of a request until the request is released (finished, aborted
or failed); a preempted one keeps it, its tokens being the same when it resumes.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field

from hybridserve.config import SchedulerConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.drafting import NgramProposer, Proposer, draft_lengths
from hybridserve.engine.kv_transfer.connector_scheduler import ConnectorScheduler
from hybridserve.engine.kv_transfer.messages import TransferEvents, TransferSource
from hybridserve.engine.plan import NewRequest, ScheduledRequest, SchedulerOutput
from hybridserve.engine.protocol import EngineCoreOutput, FinishReason, SchedulerStats, TokenLogprobs
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.sampler import SampleResult
from hybridserve.engine.step_budget import BACKGROUND_PRIORITY, StepBudget
from hybridserve.engine.suffix_drafting import SuffixProposer


@dataclass
class _Step:
    """The plan being written: its budget, the requests and token counts scheduled so far (`capped`: the entries
    that took the prefill share and may take more), drafts by request, and the requests the runner meets."""

    budget: StepBudget
    new: list[NewRequest]
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    capped: list[int] = field(default_factory=list)
    drafts: dict[str, list[int]] = field(default_factory=dict)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        device_type: str,
        weight_read_tokens: float = math.inf,
        connector: ConnectorScheduler | None = None,
    ) -> None:
        """`weight_read_tokens`: speculative decoding's cost of a step's weight read in tokens (roofline.py): the
        config's, else the engine's measurement (EngineCore decides); unbounded, a request drafts all its
        proposer offers. `connector`: the KV connector's scheduler half, on a worker that takes part in
        disaggregation."""
        self.max_num_seqs = config.max_num_seqs
        self.max_num_batched_tokens = config.token_budget(device_type)
        self.chunk_limit = config.long_prefill_token_threshold or self.max_num_batched_tokens
        self.prefill_share = max(1, int(self.max_num_batched_tokens * config.long_prefill_share))
        self.batch_step_tokens = config.batch_step_tokens or None  # None: batch work shares the whole budget
        self.kv = kv
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        self._blocks_sent: dict[str, int] = {}  # per running request: how much of its block table the runner has
        self.finished_ids: list[str] = []  # ended since the last plan, after the runner had seen them
        self.connector = connector
        self._introduced: list[NewRequest] = []  # landed since the last plan: the runner meets them next
        spec = config.speculative_config
        self.proposer: Proposer | None = None
        if spec is not None:
            self.proposer = SuffixProposer(spec) if spec.method == "suffix" else NgramProposer(spec)
        self.weight_read_tokens = weight_read_tokens
        self.num_drafts = 0  # steps in which a request verified a draft
        self.num_draft_tokens = 0  # draft tokens verified
        self.num_accepted_tokens = 0  # of which accepted

    def add(self, request: Request) -> None:
        """Queue a new request behind every waiting request of its priority or a lower value."""
        self.requests[request.request_id] = request
        i = len(self.waiting)
        while i > 0 and self.waiting[i - 1].priority > request.priority:
            i -= 1
        self.waiting.insert(i, request)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._num_pulling)

    @property
    def _num_pulling(self) -> int:
        return len(self.connector.pulling) if self.connector is not None else 0

    def schedule(self) -> SchedulerOutput:
        # Batch work beside online work shares a smaller budget, so the steps that online requests wait for and run
        # in stay short.
        online = any(r.priority < BACKGROUND_PRIORITY for r in (*self.running, *self.waiting))
        step = _Step(StepBudget(self.max_num_batched_tokens, online, self.batch_step_tokens), self._introduced)
        self._introduced = []
        preempted = self._schedule_running(step)
        # Admitting new work right after a preemption would only thrash the cache. A first pass admits only
        # prompts shorter than every prefill as urgent in the plan: they start beside it, each with its share.
        # The chunks the share cut short then take what is left, and only then does a second pass admit the
        # rest in turn, each taking all it can: a burst of prompts alike in length is prefilled one after
        # another, each first token sooner, not all of them a share a step, finishing late together.
        for shorter_only in (True, False):
            if not preempted:
                self._admit_waiting(step, shorter_only)
            # Leftover budget goes back to the chunks cut short, online ones first (the more urgent first), batch ones
            # within what is left of their share.
            budget = step.budget
            budget.tokens = self._top_up(step.scheduled, step.capped, budget.tokens, BACKGROUND_PRIORITY)
            room = budget.background_room
            budget.spend_background(room - self._top_up(step.scheduled, step.capped, room))
        plan = [self._scheduled(req, n, step.drafts.get(req.request_id)) for req, n in step.scheduled]
        ops = self.kv.take_ops()
        finished, self.finished_ids = self.finished_ids, []
        transfer = self.connector.take_orders() if self.connector is not None else None
        return SchedulerOutput(plan, step.new, finished, ops.zero, ops.restore, ops.save, transfer or None)

    def _schedule_running(self, step: _Step) -> bool:
        """The running requests' next tokens (a decode, with its draft, or a prefill chunk), most urgent first;
        preempts the least urgent where blocks run out. Returns whether it preempted."""
        lengths = {} if self.proposer is None else self._draft_lengths(self.proposer)
        budget, preempted, i = step.budget, False, 0
        while i < len(self.running):
            req = self.running[i]
            budget.tokens = self._top_up(step.scheduled, step.capped, budget.tokens, req.priority)
            if not budget.tokens:
                break
            if not (limit := budget.limit(req.priority)):
                i += 1  # less urgent work, over its share this step
                continue
            n = self._chunk(req, req.num_computed_tokens, min(limit, self.prefill_share))
            length = lengths.get(req.request_id, 0)
            draft = [] if self.proposer is None or not length else self._draft(self.proposer, req, limit, length)
            while not self.kv.allocate(req, n + len(draft)):
                if draft:  # no proposal is worth a preemption
                    draft = []
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            else:
                if draft:
                    step.drafts[req.request_id] = draft
                    n += len(draft)
                elif n == self.prefill_share:
                    step.capped.append(len(step.scheduled))
                step.scheduled.append((req, n))
                budget.spend(n, req.priority)
                i += 1
        return preempted

    def _admit_waiting(self, step: _Step, shorter_only: bool) -> None:
        """Waiting requests in queue order while budget, sequence slots and blocks last; with `shorter_only`, only
        while each is shorter than every prefill in the plan, and each within the prefill share."""
        budget = step.budget
        while self.waiting and len(self.running) + self._num_pulling < self.max_num_seqs:
            req = self.waiting[0]
            budget.tokens = self._top_up(step.scheduled, step.capped, budget.tokens, req.priority)
            if not budget.tokens:
                break
            if req.pull_from is not None and req.status is RequestStatus.WAITING:
                if not self._admit_pull(req):
                    break
                continue
            if not (limit := budget.limit(req.priority)):
                break  # the queue is in priority order: the rest is as little urgent
            if shorter_only and not _shortest(req, step.scheduled):
                break
            cached = self.kv.find_cached_prefix(req)
            num_cached = len(cached) * self.kv.block_size
            n = self._chunk(req, num_cached, min(limit, self.prefill_share) if shorter_only else limit)
            if not self.kv.allocate(req, n, cached):
                break
            self.waiting.popleft()
            if req.status is RequestStatus.WAITING:  # first admission, not a resumption
                req.num_cached_tokens = num_cached
                step.new.append(self._introduce(req))
            req.move_to(RequestStatus.RUNNING)
            req.num_computed_tokens = num_cached
            self._run(req)
            if shorter_only and n == self.prefill_share:
                step.capped.append(len(step.scheduled))
            step.scheduled.append((req, n))
            budget.spend(n, req.priority)

    def _introduce(self, req: Request) -> NewRequest:
        return NewRequest(
            req.request_id, req.prompt_token_ids, req.params, req.eos_token_ids, list(req.output_token_ids)
        )

    def _admit_pull(self, req: Request) -> bool:
        """Blocks for the prompt and a state slot, to be filled by the read this plan orders."""
        source, connector = req.pull_from, self.connector
        assert source is not None and connector is not None
        if not connector.has_room(req) or not self.kv.allocate(req, source.num_tokens, pulled=True):
            return False
        self.waiting.popleft()
        req.num_cached_tokens = source.num_cached_tokens
        req.move_to(RequestStatus.PULLING)
        rid = req.request_id
        slot = self.kv.state_slot(rid) if source.state_slot >= 0 else -1
        connector.pull(req, self.kv.block_ids(rid)[: len(source.block_ids)], slot)
        return True

    def transfer_update(self, events: TransferEvents) -> list[EngineCoreOutput]:
        """Apply what the connector's worker half reported: reads that landed run, failed ones fail or are
        prefilled here, stuck ones end for their clients, freed ones give their blocks back; held requests whose
        readers are done (or whose leases ran out) are let go, and readers still queued keep their leases."""
        connector = self.connector
        assert connector is not None
        outputs: list[EngineCoreOutput] = []
        for rid in events.landed:
            self._landed(connector.landed(rid))
        for rid, why in events.failed:
            req, error = connector.failed(rid, why)
            if error is None:
                self._prefill_locally(req)
            else:
                outputs.append(self.fail(req, error))
        outputs += [connector.stuck(rid, why) for rid, why in events.stuck]
        for rid in events.freed:
            self.finish(connector.pulling[rid], FinishReason.ABORT)  # its client heard already
        for rid in connector.to_release(events.heard):
            self.release_held(rid)
        connector.keep_waiting(self.waiting)
        return outputs

    def _landed(self, req: Request) -> None:
        """Its prompt's KV and state arrived: it runs from the first token on, and its blocks are findable."""
        req.num_computed_tokens = len(req.prompt_token_ids)
        self.kv.make_findable(req, req.num_computed_tokens)
        req.move_to(RequestStatus.RUNNING)
        self._introduced.append(self._introduce(req))
        self._run(req)

    def _prefill_locally(self, req: Request) -> None:
        """Its read failed and the policy is to recompute: it gives the blocks back and queues as a local
        prefill of its prompt and first token (first among its priority, it has waited already)."""
        assert self.connector is not None
        self.connector.forget(req.request_id)
        self.kv.free(req)
        req.pull_from = None
        req.move_to(RequestStatus.WAITING)
        self._requeue_first(req)

    def release_held(self, request_id: str) -> bool:
        """The decode worker read it (or gave up, or its lease ran out): its blocks and slot go back."""
        req = self.connector.release(request_id) if self.connector is not None else None
        if req is None:
            return False
        req.finish(FinishReason.STOP)
        self._release(req, seen=False)  # the runner forgot it when it was held
        return True

    def _hold(self, req: Request) -> TransferSource:
        """After its first token: out of the running list, its blocks and state slot kept for the reader."""
        assert self.connector is not None
        req.move_to(RequestStatus.HELD)
        self._blocks_sent.pop(req.request_id, None)
        self.finished_ids.append(req.request_id)
        slot = self.kv.state_slot(req.request_id) if self.kv.states is not None else -1
        prompt = len(req.prompt_token_ids)
        return self.connector.hold(req, self.kv.block_ids(req.request_id)[: -(-prompt // self.kv.block_size)], slot)

    def _may_draft(self, req: Request) -> bool:
        """Whether `req` decodes this step and may draft: not while it prefills, nor under a grammar (the mask
        would have to advance over the draft), nor where its step ends at a block boundary of a hybrid model
        (the recurrent state is snapshotted there: no draft past it)."""
        if req.num_computed_tokens != req.num_tokens - 1 or not req.output_token_ids or req.grammar is not None:
            return False
        return self.kv.snapshots is None or req.num_tokens % self.kv.block_size != 0

    def _draft_lengths(self, proposer: Proposer) -> dict[str, int]:
        """How many tokens each request that may draft may propose this step (drafting.draft_lengths)."""
        decoding = [r for r in self.running if self._may_draft(r)]
        judged = [(r.draft_accepted, r.draft_rejections) for r in decoding]
        counts = draft_lengths(judged, proposer.num_speculative_tokens, self.weight_read_tokens)
        return {req.request_id: n for req, n in zip(decoding, counts, strict=True) if n}

    def _draft(self, proposer: Proposer, req: Request, budget: int, length: int) -> list[int]:
        """The tokens proposed after a decoding request's last one: at most `length`, what the step's `budget`
        leaves after that token and one fewer than the request may still produce (the token sampled after an
        accepted draft is one more)."""
        room = min(length, budget - 1, req.max_output_tokens - len(req.output_token_ids) - 1)
        return proposer.propose(req.request_id, req.prompt_token_ids, req.output_token_ids, room)

    def _chunk(self, req: Request, start: int, budget: int) -> int:
        """The next chunk of `req` from `start` within `budget`: at most long_prefill_token_threshold tokens,
        ended at its next snapshot point."""
        return self.kv.chunk_tokens(req, start, min(req.num_tokens - start, budget, self.chunk_limit))

    def _top_up(
        self, scheduled: list[tuple[Request, int]], capped: list[int], budget: int, below: int | None = None
    ) -> int:
        """Hand `budget` to the chunks that took the prefill share (those of a priority value under `below`, or
        all), the request with the fewest tokens left first; returns what is left. The share lets others in,
        never ahead of more urgent work, and what they leave is not lost."""

        def rank(j: int) -> tuple[int, int]:
            req = scheduled[j][0]
            return req.priority, req.num_tokens - req.num_computed_tokens

        for j in sorted(capped, key=rank):
            req, n = scheduled[j]
            if not budget or (below is not None and req.priority >= below):
                break
            capped.remove(j)
            more = self._chunk(req, req.num_computed_tokens, n + budget)
            if more > n and self.kv.allocate(req, more):
                scheduled[j] = (req, more)
                budget -= more - n
        return budget

    def _scheduled(self, req: Request, n: int, draft: list[int] | None) -> ScheduledRequest:
        """The plan's entry for `n` tokens of `req` (its `draft` the last of them), whose blocks are allocated;
        books its snapshot."""
        start = req.num_computed_tokens
        sent = self._blocks_sent.get(req.request_id)
        self._blocks_sent[req.request_id] = self.kv.num_blocks(req.request_id)  # a diff only: not the whole table
        slot = self.kv.state_slot(req.request_id) if self.kv.states is not None else -1
        known = start + n - len(draft or ())
        self.kv.plan_snapshot(req, known)
        token_ids = req.token_ids_range(start, known)
        if draft:
            token_ids += draft
        return ScheduledRequest(
            req.request_id,
            start,
            token_ids,
            self.kv.block_ids(req.request_id, sent or 0),
            sent is None,
            known == req.num_tokens,
            slot,
            len(draft or ()),
        )

    def update(self, plan: SchedulerOutput, sampled: Mapping[str, SampleResult]) -> list[EngineCoreOutput]:
        """Apply an executed plan: its tokens are computed, its snapshots written; each request that sampled
        takes its token (a grammar that forbids it fails that request), stops where it should, and reports."""
        for s in plan.scheduled:
            self.requests[s.request_id].num_computed_tokens += s.num_tokens
        if self.proposer is not None:
            self._settle_drafts(plan, sampled)
        self.kv.commit_step()
        outputs = []
        for rid in plan.sampling_ids:
            req, result = self.requests[rid], sampled[rid]
            if req.max_output_tokens == 0:  # the prompt only (its logprobs): done at prefill, the token unused
                req.finish(FinishReason.LENGTH)
                outputs.append(req.output([], prompt_logprobs=result.prompt_logprobs))
                continue
            new_ids: list[int] = []
            logprobs: list[TokenLogprobs] | None = None if result.logprobs is None else []
            stopped = rejected = False
            for token in (*result.accepted, result):  # a stop ends the run there: later tokens are dropped
                req.output_token_ids.append(token.token_id)
                if rejected := req.grammar is not None and not req.grammar.accept(token.token_id):
                    break  # the mask forbids this
                new_ids.append(token.token_id)
                if logprobs is not None and token.logprobs is not None:
                    logprobs.append(token.logprobs)
                if stopped := req.check_stop():
                    break
            if rejected:
                outputs.append(self.fail(req, f"grammar rejected sampled token {req.output_token_ids[-1]}"))
                continue
            prompt_logprobs = result.prompt_logprobs
            if not stopped and req.remote_decode and len(req.output_token_ids) == 1:
                source = self._hold(req)
                outputs.append(req.output(new_ids, logprobs, kv_transfer=source, prompt_logprobs=prompt_logprobs))
                continue
            outputs.append(req.output(new_ids, logprobs, prompt_logprobs=prompt_logprobs))
        for req in [r for r in self.running if r.status in (RequestStatus.FINISHED, RequestStatus.HELD)]:
            self.running.remove(req)
            if req.status is RequestStatus.FINISHED:
                self._release(req, seen=True)
        return outputs

    def _settle_drafts(self, plan: SchedulerOutput, sampled: Mapping[str, SampleResult]) -> None:
        """Speculative decoding: a request's rejected draft tokens are not computed after all (their KV slots
        are overwritten later); counts what was drafted and accepted."""
        for s in plan.scheduled:
            if s.num_draft:
                accepted = len(sampled[s.request_id].accepted)
                req = self.requests[s.request_id]
                req.num_computed_tokens -= s.num_draft - accepted
                req.draft_accepted += accepted
                req.draft_rejections += accepted < s.num_draft
                self.num_drafts += 1
                self.num_draft_tokens += s.num_draft
                self.num_accepted_tokens += accepted

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
        self._requeue_first(req)
        self.num_preemptions += 1

    def _requeue_first(self, req: Request) -> None:
        """Back into the waiting queue at the head of its priority: it has waited already."""
        i = 0
        while i < len(self.waiting) and self.waiting[i].priority < req.priority:
            i += 1
        self.waiting.insert(i, req)

    def finish(self, req: Request, reason: FinishReason, stop_reason: int | None = None) -> None:
        """End a request in any state (abort, error) and give its blocks back."""
        if req.status is RequestStatus.HELD:
            self.release_held(req.request_id)
            return
        # Scheduled at least once: the runner holds its state (a pulled request's is met once it lands).
        seen = req.status not in (RequestStatus.WAITING, RequestStatus.PULLING)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        if self.connector is not None:
            self.connector.forget(req.request_id)
        req.finish(reason, stop_reason)
        self._release(req, seen)

    def fail(self, req: Request, error: str) -> EngineCoreOutput:
        self.finish(req, FinishReason.ERROR)
        return req.output([], error=error)

    def fail_all(self, error: str) -> list[EngineCoreOutput]:
        """After a plan failed to execute: end every request with an error. What the step wrote may be half
        done, so the prefix cache and the snapshots it was to save are forgotten."""
        self.kv.abandon_step()
        # Held and pulling requests took no part in the step: their blocks were written before or are being read.
        spared = (RequestStatus.HELD, RequestStatus.PULLING)
        return [self.fail(req, error) for req in list(self.requests.values()) if req.status not in spared]

    def _release(self, req: Request, seen: bool) -> None:
        self.kv.free(req)
        if self.proposer is not None:  # what it produced, unless the engine failed it, may be drafted from
            failed = req.finish_reason is FinishReason.ERROR
            self.proposer.finish(req.request_id, () if failed else req.output_token_ids)
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
            kv_held=len(self.connector.held) if self.connector is not None else 0,
            kv_pulling=self._num_pulling,
            spec_decode_num_drafts=self.num_drafts,
            spec_decode_num_draft_tokens=self.num_draft_tokens,
            spec_decode_num_accepted_tokens=self.num_accepted_tokens,
        )


def _shortest(req: Request, scheduled: list[tuple[Request, int]]) -> bool:
    """Whether waiting `req` has fewer tokens to prefill than every prefill as urgent already in the plan (its
    prefix hits not yet looked up: it may have fewer still)."""
    left = req.num_tokens - req.num_computed_tokens
    for other, _ in scheduled:
        other_left = other.num_tokens - other.num_computed_tokens  # 1: a decode, not a prefill
        if other.priority <= req.priority and 1 < other_left <= left:
            return False
    return True
