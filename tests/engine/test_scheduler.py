"""The scheduler driven by hand with scripted sampled tokens and no model: plans out, `update` in."""

from __future__ import annotations

import re
from collections.abc import Iterable

import pytest

from hybridserve.config import SchedulerConfig
from hybridserve.engine.cache.manager import KVCacheManager
from hybridserve.engine.protocol import EngineCoreRequest, FinishReason, SchedulerStats
from hybridserve.engine.request import Request, RequestStatus
from hybridserve.engine.sampler import SampleResult
from hybridserve.engine.scheduler import Scheduler
from hybridserve.engine.step_budget import BACKGROUND_PRIORITY
from hybridserve.sampling_params import InvalidParameter, SamplingParams

EOS = 0
BS = 4

BATCH = BACKGROUND_PRIORITY  # batch work, as the Batch API and run-batch ask for it


class Harness:
    """A scheduler, its cache and a fake model that samples scripted tokens (1000, 1001, ... by default)."""

    def __init__(
        self, num_blocks: int = 64, prefix: bool = True, max_model_len: int = 1024, states: int = 0, **config
    ) -> None:
        """`states`: a hybrid model's state slots, and as many snapshots."""
        self.kv = KVCacheManager(num_blocks, BS, prefix, num_state_slots=states, num_state_snapshots=states)
        self.sched = Scheduler(SchedulerConfig(**config), self.kv, "cpu")
        self.max_model_len = max_model_len
        self.scripts: dict[str, list[int]] = {}

    def add(self, rid: str, prompt: list[int], script: Iterable[int] = (), priority: int = 0, **params) -> Request:
        core = EngineCoreRequest(rid, prompt, SamplingParams(**params), [EOS], 0.0, priority)
        req = Request(core, self.max_model_len)
        self.scripts[rid] = list(script)
        self.sched.add(req)
        return req

    def step(self) -> list[tuple[str, int, bool]]:
        """One engine step; returns (request id, tokens scheduled, samples) per scheduled request."""
        plan = self.sched.schedule()
        self.check()
        sampled = {}
        for rid in plan.sampling_ids:
            script = self.scripts[rid]
            token = script.pop(0) if script else 1000 + len(self.sched.requests[rid].output_token_ids)
            sampled[rid] = SampleResult(token, None)
        self.outputs = self.sched.update(plan, sampled)
        self.check()
        return [(s.request_id, s.num_tokens, s.samples) for s in plan.scheduled]

    def check(self) -> None:
        self.kv.check_integrity()
        live = {r.request_id for r in self.sched.running}
        assert set(self.kv.req_blocks) == live
        assert not any(r.status is RequestStatus.FINISHED for r in self.sched.running)
        assert all(r.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED) for r in self.sched.waiting)
        assert set(self.sched.requests) == live | {r.request_id for r in self.sched.waiting}

    def waiting(self) -> list[str]:
        return [r.request_id for r in self.sched.waiting]

    def running(self) -> list[str]:
        return [r.request_id for r in self.sched.running]


def prompt(n: int, base: int = 100) -> list[int]:
    return list(range(base, base + n))


# admission and the token budget


def test_fcfs_admission_in_one_step() -> None:
    h = Harness()
    for rid in "abc":
        h.add(rid, prompt(5, base=ord(rid) * 10))
    assert h.step() == [("a", 5, True), ("b", 5, True), ("c", 5, True)]
    assert h.running() == ["a", "b", "c"]
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 1, True)]


def test_fcfs_head_of_line_blocks_smaller_requests_behind_it() -> None:
    h = Harness(num_blocks=4, prefix=False)
    h.add("a", prompt(8))  # 2 blocks
    h.add("b", prompt(12))  # 3 blocks: does not fit next to a
    h.add("c", prompt(2))  # 1 block would fit, but b is first in line
    assert h.step() == [("a", 8, True)]
    assert h.waiting() == ["b", "c"]
    assert h.kv.pool.num_free == 2


def test_default_budget_spreads_a_burst_of_prompts_over_steps_on_cpu() -> None:
    """512 tokens a step on CPU: of 20 fresh 40-token prompts the first 12 start (the 13th with its first
    32 tokens); the next step decodes those and goes on with the rest."""
    h = Harness(num_blocks=512, prefix=False)
    for i in range(20):
        h.add(f"r{i}", prompt(40, base=100 * i))
    first = h.step()
    assert [n for _, n, _ in first] == [40] * 12 + [32]
    second = h.step()
    assert [n for _, n, _ in second] == [1] * 12 + [8] + [40] * 7
    assert SchedulerConfig().token_budget("cuda") == 2048
    assert SchedulerConfig(max_num_batched_tokens=100).token_budget("cpu") == 100


def test_long_prompt_is_chunked_by_the_token_budget() -> None:
    h = Harness(max_num_batched_tokens=8)
    a = h.add("a", prompt(20), max_tokens=2)
    assert h.step() == [("a", 8, False)]
    assert (a.num_computed_tokens, a.output_token_ids) == (8, [])
    assert h.kv.block_ids("a") == [0, 1]
    assert h.step() == [("a", 8, False)]
    assert h.step() == [("a", 4, True)]
    assert (a.num_computed_tokens, a.output_token_ids) == (20, [1000])
    assert h.step() == [("a", 1, True)]
    assert a.status is RequestStatus.FINISHED
    assert not h.sched.has_work()


def test_long_prefill_threshold_caps_each_chunk() -> None:
    h = Harness(max_num_batched_tokens=16, long_prefill_token_threshold=5)
    h.add("a", prompt(12))
    h.add("b", prompt(7, base=500))
    assert h.step() == [("a", 5, False), ("b", 5, False)]
    assert h.step() == [("a", 5, False), ("b", 2, True)]
    assert h.step() == [("a", 2, True), ("b", 1, True)]
    assert h.step() == [("a", 1, True), ("b", 1, True)]


# a long prompt's share of the step: by default a quarter of the budget before the others have theirs


def test_a_short_request_is_admitted_while_a_long_prompt_is_chunked() -> None:
    h = Harness(max_num_batched_tokens=16)  # a share of 4 tokens
    h.add("long", prompt(100), max_tokens=2)
    assert h.step() == [("long", 16, False)]  # alone it still fills the step
    short = h.add("short", prompt(6, base=500), max_tokens=3)
    # long takes its share, short is admitted with its own, and what is left goes first to short, which needs
    # fewer tokens: it samples in the step it arrived for, and long fills the rest.
    assert h.step() == [("long", 10, False), ("short", 6, True)]
    assert short.output_token_ids == [1000]
    assert h.step() == [("long", 15, False), ("short", 1, True)]
    assert h.step() == [("long", 15, False), ("short", 1, True)]
    assert short.status is RequestStatus.FINISHED
    assert h.step() == [("long", 16, False)]
    assert h.step() == [("long", 16, False)]
    assert h.step() == [("long", 12, True)]


def test_a_burst_of_prompts_alike_in_length_is_prefilled_one_after_another() -> None:
    """No prompt of the burst is shorter than the one before it, so none takes a share beside it: the first
    samples in the first step, the next in the second, and so on (sharing every step, all three would sample
    in the fourth)."""
    h = Harness(max_num_batched_tokens=16)  # a share of 4 tokens
    for name in "abc":
        h.add(name, prompt(20, base=100 * ord(name)))
    assert h.step() == [("a", 16, False)]
    assert h.step() == [("a", 4, True), ("b", 12, False)]
    assert h.step() == [("a", 1, True), ("b", 8, True), ("c", 7, False)]
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 13, True)]


def test_a_lone_long_prompt_fills_the_budget_next_to_decodes() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add("a", prompt(3))
    h.step()
    h.add("long", prompt(40, base=200))
    assert h.step() == [("a", 1, True), ("long", 15, False)]
    assert h.step() == [("a", 1, True), ("long", 15, False)]
    assert h.step() == [("a", 1, True), ("long", 10, True)]


def test_what_the_shares_leave_goes_to_the_prefill_with_fewest_tokens_left() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add("a", prompt(30))
    h.add("b", prompt(20, base=200))
    h.add("c", prompt(9, base=300))
    assert h.step() == [("a", 4, False), ("b", 4, False), ("c", 8, False)]
    assert h.step() == [("a", 4, False), ("b", 11, False), ("c", 1, True)]


def test_a_waiting_batch_request_does_not_take_an_online_prefill_share() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add("online", prompt(40))
    assert h.step() == [("online", 16, False)]
    h.add("batch", prompt(4, base=200), priority=BATCH)
    assert h.step() == [("online", 16, False)]
    assert h.step() == [("online", 8, True), ("batch", 4, True)]


def test_batch_work_takes_at_most_its_step_share_while_online_work_is_there() -> None:
    h = Harness(max_num_batched_tokens=32, batch_step_tokens=8, long_prefill_share=1)
    h.add("batch", prompt(100), priority=BATCH)
    h.add("batch-2", prompt(10, base=300), priority=BATCH)
    assert h.step() == [("batch", 32, False)]  # alone, batch work has the whole budget
    h.add("online", prompt(6, base=200), max_tokens=2)
    assert h.step() == [("batch", 8, False), ("online", 6, True)]  # batch-2 waits: the share is spent
    assert h.step() == [("online", 1, True), ("batch", 8, False)]  # the leftover 23 tokens do not go to batch
    assert h.step() == [("batch", 32, False)]  # online is done
    assert h.step() == [("batch", 20, True), ("batch-2", 10, True)]


def test_a_less_urgent_online_request_is_ordered_after_the_others_but_never_held_to_the_batch_share() -> None:
    h = Harness(max_num_batched_tokens=32, batch_step_tokens=8, long_prefill_share=1)
    h.add("later", prompt(100), priority=5)  # a client's priority under --scheduling-policy priority
    h.add("urgent", prompt(6, base=200), priority=-1)
    assert h.waiting() == ["urgent", "later"]
    assert h.step() == [("urgent", 6, True), ("later", 26, False)]  # the rest of the step, not 8
    h.add("batch", prompt(10, base=300), priority=BATCH)
    assert h.step() == [("urgent", 1, True), ("later", 31, False)]  # batch work gets what online leaves: none


def test_without_a_batch_step_share_batch_work_fills_the_budget_beside_online_work() -> None:
    h = Harness(max_num_batched_tokens=32, batch_step_tokens=0, long_prefill_share=1)
    h.add("batch", prompt(100), priority=BATCH)
    assert h.step() == [("batch", 32, False)]
    h.add("online", prompt(6, base=200), max_tokens=2)
    # A running batch prefill takes all it can (share 1): the online request waits until it is done.
    assert h.step() == [("batch", 32, False)]
    assert h.step() == [("batch", 32, False)]
    assert h.step() == [("batch", 4, True), ("online", 6, True)]


def test_an_online_request_is_admitted_while_a_batch_prompt_is_chunked() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add("batch", prompt(40), priority=BATCH)
    assert h.step() == [("batch", 16, False)]
    h.add("online", prompt(6, base=200))
    assert h.step() == [("batch", 10, False), ("online", 6, True)]
    assert h.running() == ["online", "batch"]
    assert h.step() == [("online", 1, True), ("batch", 14, True)]


def test_a_running_batch_prefill_does_not_take_an_online_prefill_share() -> None:
    h = Harness(max_num_batched_tokens=16)
    h.add("batch", prompt(40), priority=BATCH)
    h.add("online", prompt(30, base=200))
    assert h.step() == [("online", 16, False)]
    assert h.running() == ["online"]
    assert h.step() == [("online", 14, True), ("batch", 2, False)]


def test_the_hand_back_ends_a_hybrid_chunk_at_its_snapshot_point() -> None:
    h = Harness(max_num_batched_tokens=16, states=4)
    h.add("long", prompt(40))  # snapshot point at 36, the last block boundary before its last token
    assert h.step() == [("long", 16, False)]
    h.add("short", prompt(6, base=500))  # snapshot point at 4
    assert h.step() == [("long", 12, False), ("short", 4, False)]
    assert h.step() == [("long", 8, False), ("short", 2, True)]  # budget left, but long stops at 36
    assert h.step() == [("long", 4, True), ("short", 1, True)]


def test_share_one_lets_a_running_prefill_take_the_whole_budget() -> None:
    h = Harness(max_num_batched_tokens=16, long_prefill_share=1.0)
    h.add("long", prompt(40))
    h.step()
    h.add("short", prompt(6, base=500))
    assert h.step() == [("long", 16, False)]
    assert h.step() == [("long", 8, True), ("short", 6, True)]


@pytest.mark.parametrize("share", [0.0, -0.5, 1.5, float("nan")])
def test_long_prefill_share_must_be_a_fraction(share: float) -> None:
    with pytest.raises(InvalidParameter, match=re.escape(f"long_prefill_share must be in (0, 1], got {share}")):
        SchedulerConfig(long_prefill_share=share)


def test_decodes_go_before_new_prefills_and_prefills_take_the_rest() -> None:
    h = Harness(max_num_batched_tokens=8)
    h.add("a", prompt(3))
    h.add("b", prompt(3, base=200))
    assert h.step() == [("a", 3, True), ("b", 3, True)]
    h.add("c", prompt(20, base=300))
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 6, False)]
    h.add("d", prompt(4, base=400))
    # c's unfinished prefill is running work too, but takes only its share (2 of 8) before d has its own;
    # what is left goes to d first, which has fewer tokens left: d samples at once.
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 2, False), ("d", 4, True)]
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 5, False), ("d", 1, True)]
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 5, False), ("d", 1, True)]
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 2, True), ("d", 1, True)]


def test_max_num_seqs_caps_running_requests() -> None:
    h = Harness(max_num_seqs=2)
    h.add("a", prompt(4), max_tokens=1)
    h.add("b", prompt(4, base=200), max_tokens=3)
    h.add("c", prompt(4, base=300))
    assert h.step() == [("a", 4, True), ("b", 4, True)]
    assert h.waiting() == ["c"]
    assert h.running() == ["b"]  # a finished at its prefill
    assert h.step() == [("b", 1, True), ("c", 4, True)]
    assert h.step() == [("b", 1, True), ("c", 1, True)]
    assert h.running() == ["c"]


# stopping


def test_max_tokens_one_finishes_at_the_prefill_step() -> None:
    h = Harness()
    a = h.add("a", prompt(6), max_tokens=1)
    assert h.step() == [("a", 6, True)]
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.LENGTH
    assert a.output_token_ids == [1000]
    assert h.running() == [] and h.waiting() == []
    assert "a" not in h.sched.requests
    assert h.kv.pool.num_free == h.kv.pool.num_blocks
    assert not h.sched.has_work()
    assert h.sched.schedule().scheduled == []


def test_context_limit_finishes_with_length() -> None:
    h = Harness(max_model_len=8)
    a = h.add("a", prompt(6))
    h.step()
    h.step()
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.LENGTH
    assert len(a.output_token_ids) == 2


def test_eos_stops() -> None:
    h = Harness()
    a = h.add("a", prompt(4), script=[7, EOS, 8])
    for _ in range(2):
        h.step()
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.STOP
    assert a.output_token_ids == [7, EOS]
    assert not h.sched.has_work()


def test_min_tokens_ignores_eos_until_reached() -> None:
    h = Harness()
    a = h.add("a", prompt(4), script=[EOS, 5, EOS, 6], min_tokens=3)
    h.step()
    h.step()
    assert (a.status, a.output_token_ids) == (RequestStatus.RUNNING, [EOS, 5])
    h.step()
    assert a.status is RequestStatus.FINISHED
    assert a.finish_reason is FinishReason.STOP
    assert a.output_token_ids == [EOS, 5, EOS]


def test_min_tokens_equal_to_the_eos_position_stops_there() -> None:
    h = Harness()
    a = h.add("a", prompt(4), script=[5, EOS], min_tokens=2)
    h.step()
    h.step()
    assert (a.finish_reason, a.output_token_ids) == (FinishReason.STOP, [5, EOS])


def test_ignore_eos_runs_to_max_tokens() -> None:
    h = Harness()
    a = h.add("a", prompt(4), script=[EOS, EOS, EOS], ignore_eos=True, max_tokens=3)
    for _ in range(3):
        h.step()
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == (FinishReason.LENGTH, None, [EOS] * 3)


def test_stop_token_ids() -> None:
    h = Harness()
    a = h.add("a", prompt(4), script=[5, 42, 7], stop_token_ids=(42, 43))
    h.step()
    h.step()
    assert a.status is RequestStatus.FINISHED
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == (FinishReason.STOP, 42, [5, 42])


def test_stop_token_ids_respect_min_tokens() -> None:
    h = Harness()
    a = h.add("a", prompt(4), script=[42, 42], stop_token_ids=(42,), min_tokens=2)
    h.step()
    assert a.status is RequestStatus.RUNNING
    h.step()
    assert (a.finish_reason, a.stop_reason, a.output_token_ids) == (FinishReason.STOP, 42, [42, 42])


# preemption


def test_preemption_recomputes_prompt_and_output() -> None:
    h = Harness(num_blocks=5, prefix=False, max_num_batched_tokens=16, long_prefill_token_threshold=4)
    a = h.add("a", prompt(7), max_tokens=4)
    b = h.add("b", prompt(9, base=200))
    assert h.step() == [("a", 4, False), ("b", 4, False)]
    assert h.step() == [("a", 3, True), ("b", 4, False)]
    assert h.step() == [("a", 1, True), ("b", 1, True)]
    assert h.kv.pool.num_free == 0
    assert b.output_token_ids == [1000]
    # a needs a third block: b, the most recent, gives its three back. Its first chunk would fit in the
    # two left over, but nothing is admitted in a step that preempted.
    assert h.step() == [("a", 1, True)]
    assert b.status is RequestStatus.PREEMPTED
    assert b.num_computed_tokens == 0
    assert b.output_token_ids == [1000]
    assert h.waiting() == ["b"] and h.running() == ["a"]
    assert "b" not in h.kv.req_blocks
    assert h.kv.pool.num_free == 2
    assert h.sched.num_preemptions == 1
    # b comes back and recomputes its 9 prompt tokens plus the token it already produced.
    assert b.num_tokens == 10
    assert h.step() == [("a", 1, True), ("b", 4, False)]
    assert a.status is RequestStatus.FINISHED
    assert b.status is RequestStatus.RUNNING
    assert h.step() == [("b", 4, False)]
    assert h.step() == [("b", 2, True)]
    assert b.output_token_ids == [1000, 1001]
    assert b.num_computed_tokens == 10
    assert h.sched.num_preemptions == 1


def test_the_most_recent_running_request_is_preempted() -> None:
    h = Harness(num_blocks=3, prefix=False)
    a = h.add("a", prompt(4))
    b = h.add("b", prompt(4, base=200))
    c = h.add("c", prompt(4, base=300))
    assert h.step() == [("a", 4, True), ("b", 4, True), ("c", 4, True)]
    assert h.kv.pool.num_free == 0
    # Every request now needs a second block: c goes first, then b; a runs alone.
    assert h.step() == [("a", 1, True)]
    assert (a.status, b.status, c.status) == (
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.PREEMPTED,
    )
    assert h.waiting() == ["b", "c"]  # in their original order, at the head of the queue
    assert h.sched.num_preemptions == 2
    assert h.kv.block_ids("a") == [0, 2]


def test_preempted_request_goes_before_older_waiting_ones() -> None:
    h = Harness(num_blocks=2, prefix=False, max_num_seqs=2)
    h.add("a", prompt(4))
    b = h.add("b", prompt(4, base=200))
    h.add("c", prompt(1, base=300))
    assert h.step() == [("a", 4, True), ("b", 4, True)]
    assert h.step() == [("a", 1, True)]
    assert b.status is RequestStatus.PREEMPTED
    assert h.waiting() == ["b", "c"]


# priorities: online work (0) ahead of batch work (BATCH, the engine's batch band)


def test_a_waiting_request_of_lower_priority_value_is_admitted_first() -> None:
    h = Harness(max_num_seqs=2)
    h.add("batch-0", prompt(4), priority=BATCH)
    h.add("batch-1", prompt(4, base=200), priority=BATCH)
    h.add("online", prompt(4, base=300))
    h.add("batch-2", prompt(4, base=400), priority=BATCH)
    assert h.waiting() == ["online", "batch-0", "batch-1", "batch-2"]
    assert h.step() == [("online", 4, True), ("batch-0", 4, True)]
    assert h.waiting() == ["batch-1", "batch-2"]


def test_batch_work_is_preempted_before_online_work() -> None:
    h = Harness(num_blocks=3, prefix=False)
    batch = h.add("batch", prompt(3), priority=BATCH)
    assert h.step() == [("batch", 3, True)]
    a = h.add("a", prompt(4, base=200))
    b = h.add("b", prompt(4, base=300))
    assert h.step() == [("batch", 1, True), ("a", 4, True), ("b", 4, True)]
    assert h.running() == ["a", "b", "batch"]  # by priority, then by admission
    assert h.kv.pool.num_free == 0
    # Each needs a second block now: the batch request gives its block to a, though the online ones were
    # admitted after it; then b, the most recent online request, preempts itself.
    assert h.step() == [("a", 1, True)]
    assert (a.status, b.status, batch.status) == (
        RequestStatus.RUNNING,
        RequestStatus.PREEMPTED,
        RequestStatus.PREEMPTED,
    )
    assert h.waiting() == ["b", "batch"]  # each at the head of its priority
    h.add("online-late", prompt(1, base=500))
    assert h.waiting() == ["b", "online-late", "batch"]


def test_request_preempting_itself() -> None:
    h = Harness(num_blocks=3, prefix=False)
    a = h.add("a", prompt(2))
    b = h.add("b", prompt(8, base=200))
    assert h.step() == [("a", 2, True), ("b", 8, True)]
    assert h.kv.pool.num_free == 0
    # a still fits its block; b needs a third one and is the last running: it preempts itself.
    assert h.step() == [("a", 1, True)]
    assert (a.status, b.status) == (RequestStatus.RUNNING, RequestStatus.PREEMPTED)
    assert h.waiting() == ["b"] and h.running() == ["a"]
    assert h.kv.pool.num_free == 2
    assert h.sched.num_preemptions == 1


def test_resumed_request_reuses_its_own_cached_blocks() -> None:
    h = Harness(num_blocks=5, max_num_batched_tokens=8, long_prefill_share=1.0)  # q's prompt whole, first
    q = h.add("q", prompt(7), max_tokens=3)
    r = h.add("r", prompt(13, base=200))
    assert h.step() == [("q", 7, True), ("r", 1, False)]
    assert h.step() == [("q", 1, True), ("r", 7, False)]
    assert h.step() == [("q", 1, True)]  # q took the last block; r, 2 short, preempted itself
    assert r.status is RequestStatus.PREEMPTED and r.output_token_ids == []
    assert q.status is RequestStatus.FINISHED
    assert h.step() == [("r", 5, True)]  # its first two blocks are still cached
    assert r.num_computed_tokens == 13
    assert h.kv.block_ids("r")[:2] == [2, 3]


def test_num_cached_tokens_is_the_hit_at_first_admission() -> None:
    """Same scenario as above: r got no prefix hit when first admitted, so its prompt had 0 cached
    tokens; recomputing after a preemption (it hits its own blocks) must not change that."""
    h = Harness(num_blocks=5, max_num_batched_tokens=8, long_prefill_share=1.0)
    h.add("q", prompt(7), max_tokens=3)
    r = h.add("r", prompt(13, base=200))
    h.step()
    assert r.num_cached_tokens == 0
    h.step()
    h.step()
    assert r.status is RequestStatus.PREEMPTED
    h.step()
    assert r.status is RequestStatus.RUNNING
    assert r.num_cached_tokens == 0


def test_num_cached_tokens_from_a_prefix_hit() -> None:
    h = Harness()
    a = h.add("a", prompt(9))
    b = h.add("b", prompt(9))  # same prompt, admitted in the same step: hits a's two full blocks
    assert h.step() == [("a", 9, True), ("b", 1, True)]
    assert (a.num_cached_tokens, b.num_cached_tokens) == (0, 8)
    assert h.kv.block_ids("b")[:2] == h.kv.block_ids("a")[:2]
    c = h.add("c", [*prompt(8), 1, 2, 3, 4, 5])
    assert h.step() == [("a", 1, True), ("b", 1, True), ("c", 5, True)]
    assert c.num_cached_tokens == 8
    assert h.sched.stats().prefix_cache_queries == 9 + 9 + 13
    assert h.sched.stats().prefix_cache_hits == 8 + 8


def test_preempted_request_that_had_output_keeps_its_num_cached_tokens() -> None:
    h = Harness(num_blocks=3)
    h.add("x", prompt(8), max_tokens=1)
    h.step()  # x's blocks stay cached after it finished
    a = h.add("a", [500], max_tokens=5)
    b = h.add("b", [*prompt(4), 7])  # hits x's first block
    assert h.step() == [("a", 1, True), ("b", 1, True)]
    assert b.num_cached_tokens == 4
    assert h.kv.pool.num_free == 0
    for _ in range(3):
        assert h.step() == [("a", 1, True), ("b", 1, True)]
    assert (a.num_tokens, b.num_tokens) == (5, 9)
    assert h.step() == [("a", 1, True)]  # a needs a second block: b is preempted
    assert b.status is RequestStatus.PREEMPTED
    assert len(b.output_token_ids) == 4
    assert b.num_cached_tokens == 4
    assert a.status is RequestStatus.FINISHED
    assert h.step() == [("b", 5, True)]  # back: its first block hits, 5 of 9 recomputed
    assert b.status is RequestStatus.RUNNING
    assert b.num_cached_tokens == 4


# finish / abort


def test_finish_a_waiting_request() -> None:
    h = Harness(max_num_seqs=1)
    h.add("a", prompt(4))
    b = h.add("b", prompt(4, base=200))
    h.step()
    h.sched.finish(b, FinishReason.ABORT)
    assert (b.status, b.finish_reason) == (RequestStatus.FINISHED, FinishReason.ABORT)
    assert h.waiting() == [] and "b" not in h.sched.requests
    h.check()


def test_finish_a_running_request_frees_its_blocks() -> None:
    h = Harness(num_blocks=8)
    a = h.add("a", prompt(9))
    h.add("b", prompt(4, base=200))
    h.step()
    assert h.kv.pool.num_free == 4
    h.sched.finish(a, FinishReason.ABORT)
    assert (a.status, a.finish_reason, a.stop_reason) == (RequestStatus.FINISHED, FinishReason.ABORT, None)
    assert h.running() == ["b"]
    assert "a" not in h.sched.requests and "a" not in h.kv.req_blocks
    assert h.kv.pool.num_free == 7
    h.check()
    assert h.step() == [("b", 1, True)]


def test_finish_a_preempted_request() -> None:
    h = Harness(num_blocks=2, prefix=False)
    h.add("a", prompt(4))
    b = h.add("b", prompt(4, base=200))
    h.step()
    h.step()
    assert b.status is RequestStatus.PREEMPTED
    h.sched.finish(b, FinishReason.ERROR)
    assert (b.status, b.finish_reason) == (RequestStatus.FINISHED, FinishReason.ERROR)
    assert h.waiting() == [] and "b" not in h.sched.requests
    h.check()


def test_a_request_that_finishes_in_a_step_reports_once_and_is_gone() -> None:
    """update() ends it within the step, so an abort that races its last token finds nothing to end."""
    h = Harness()
    a = h.add("a", prompt(4), max_tokens=1)
    h.step()
    assert (a.status, a.finish_reason) == (RequestStatus.FINISHED, FinishReason.LENGTH)
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in h.outputs] == [("a", [1000], "length")]
    assert h.running() == [] and "a" not in h.sched.requests
    assert h.kv.pool.num_free == h.kv.pool.num_blocks
    assert h.sched.schedule().finished_ids == ["a"]  # the runner is told to forget it
    h.check()


def test_finish_with_a_stop_reason() -> None:
    h = Harness()
    a = h.add("a", prompt(4))
    h.sched.finish(a, FinishReason.STOP, 17)
    assert (a.finish_reason, a.stop_reason) == (FinishReason.STOP, 17)


# the request state machine


def test_illegal_transitions_raise() -> None:
    h = Harness()
    a = h.add("a", prompt(4))
    with pytest.raises(RuntimeError, match="illegal transition WAITING -> PREEMPTED"):
        a.move_to(RequestStatus.PREEMPTED)
    with pytest.raises(RuntimeError, match="illegal transition WAITING -> WAITING"):
        a.move_to(RequestStatus.WAITING)
    a.move_to(RequestStatus.RUNNING)
    with pytest.raises(RuntimeError, match="illegal transition RUNNING -> WAITING"):
        a.move_to(RequestStatus.WAITING)
    with pytest.raises(RuntimeError, match="illegal transition RUNNING -> RUNNING"):
        a.move_to(RequestStatus.RUNNING)
    a.move_to(RequestStatus.PREEMPTED)
    with pytest.raises(RuntimeError, match="illegal transition PREEMPTED -> WAITING"):
        a.move_to(RequestStatus.WAITING)
    a.move_to(RequestStatus.RUNNING)
    a.finish(FinishReason.STOP)
    for status in RequestStatus:
        with pytest.raises(RuntimeError, match=f"request a: illegal transition FINISHED -> {status.name}"):
            a.move_to(status)
    with pytest.raises(RuntimeError):
        a.finish(FinishReason.ABORT)
    assert a.finish_reason is FinishReason.STOP


# stats


def test_stats() -> None:
    h = Harness(num_blocks=4, max_num_seqs=2)
    assert h.sched.stats() == SchedulerStats()
    h.add("a", prompt(5))
    h.add("b", prompt(5))
    h.add("c", prompt(1, base=300))
    h.step()
    s = h.sched.stats()
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (2, 1, 0)
    assert s.kv_cache_usage == pytest.approx(3 / 4)  # a: 2 blocks, b: shares a's first, 1 more
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10, 4)
    for _ in range(3):
        assert h.step() == [("a", 1, True), ("b", 1, True)]
    assert h.step() == [("a", 1, True)]  # a takes the last block; b needs a third one: preempted
    s = h.sched.stats()
    assert (s.num_running, s.num_waiting, s.num_preemptions) == (1, 2, 1)
    assert h.waiting() == ["b", "c"]
    assert s.kv_cache_usage == pytest.approx(3 / 4)
    assert (s.prefix_cache_queries, s.prefix_cache_hits) == (10, 4)
