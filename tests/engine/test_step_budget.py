"""The step budget alone: what a request of a priority may take, and what it spends, with and without a
background share for work less urgent than the most urgent present."""

from hybridserve.engine.step_budget import StepBudget


def test_without_a_background_share_every_priority_takes_the_whole_step() -> None:
    budget = StepBudget(512, urgent=0, background=None)
    assert budget.limit(0) == budget.limit(1) == budget.background_room == 512
    budget.spend(100, 1)
    budget.spend_background(12)
    assert (budget.tokens, budget.background) == (400, None)
    assert budget.limit(1) == 400


def test_less_urgent_work_shares_the_background_tokens_and_the_urgent_one_all() -> None:
    budget = StepBudget(512, urgent=0, background=32)
    assert (budget.limit(0), budget.limit(1), budget.background_room) == (512, 32, 32)
    budget.spend(20, 1)  # a batch request's chunk: out of both
    assert (budget.tokens, budget.background) == (492, 12)
    budget.spend(480, 0)  # an online request's: out of the step only
    assert (budget.tokens, budget.background) == (12, 12)
    assert budget.limit(1) == 12
    budget.spend(5, 0)
    assert (budget.limit(0), budget.limit(1), budget.background_room) == (7, 7, 7)
    budget.spend_background(7)
    assert (budget.tokens, budget.background, budget.limit(1)) == (0, 5, 0)


def test_alone_the_less_urgent_work_is_the_most_urgent_present() -> None:
    budget = StepBudget(512, urgent=1, background=32)
    assert budget.limit(1) == 512
    budget.spend(500, 1)
    assert (budget.tokens, budget.background) == (12, 32)
