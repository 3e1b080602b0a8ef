"""The step budget alone: what a request of a priority may take, and what it spends, with and without a
background share for batch work beside online work."""

from hybridserve.engine.step_budget import BACKGROUND_PRIORITY, StepBudget

BATCH = BACKGROUND_PRIORITY


def test_without_a_background_share_every_priority_takes_the_whole_step() -> None:
    budget = StepBudget(512, online=True, background=None)
    assert budget.limit(0) == budget.limit(BATCH) == budget.background_room == 512
    budget.spend(100, BATCH)
    budget.spend_background(12)
    assert (budget.tokens, budget.background) == (400, None)
    assert budget.limit(BATCH) == 400


def test_batch_work_shares_the_background_tokens_and_online_work_all() -> None:
    budget = StepBudget(512, online=True, background=32)
    assert (budget.limit(0), budget.limit(BATCH), budget.background_room) == (512, 32, 32)
    budget.spend(20, BATCH + 5)  # a batch request's chunk: out of both
    assert (budget.tokens, budget.background) == (492, 12)
    budget.spend(480, 0)  # an online request's: out of the step only
    assert (budget.tokens, budget.background) == (12, 12)
    assert budget.limit(BATCH) == 12
    budget.spend(5, 0)
    assert (budget.limit(0), budget.limit(BATCH), budget.background_room) == (7, 7, 7)
    budget.spend_background(7)
    assert (budget.tokens, budget.background, budget.limit(BATCH)) == (0, 5, 0)


def test_online_priorities_never_share_the_background_tokens() -> None:
    """A client's less urgent online request (priority policy) is ordered after the others, never throttled."""
    budget = StepBudget(512, online=True, background=32)
    assert budget.limit(BACKGROUND_PRIORITY - 1) == budget.limit(-5) == 512
    budget.spend(300, BACKGROUND_PRIORITY - 1)
    assert (budget.tokens, budget.background, budget.limit(BATCH)) == (212, 32, 32)


def test_alone_batch_work_takes_the_whole_step() -> None:
    budget = StepBudget(512, online=False, background=32)
    assert budget.limit(BATCH) == budget.background_room == 512
    budget.spend(500, BATCH)
    assert (budget.tokens, budget.background) == (12, 32)
