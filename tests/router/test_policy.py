"""Routing policies: round robin, least load, and the KV-aware cost with its herding guard and ties."""

from __future__ import annotations

from collections import Counter

import pytest

from hybridserve.router.policy import Candidate, Policy, Routing

BS = 16


def _pick(policy: Policy, candidates: list[Candidate], prompt_blocks: int = 10) -> str:
    return policy.pick(candidates, prompt_blocks).worker


def test_round_robin_cycles_in_worker_order() -> None:
    policy = Policy(Routing.ROUND_ROBIN, BS)
    workers = [Candidate("a", 500), Candidate("b", 0), Candidate("c", 0)]
    assert [_pick(policy, workers) for _ in range(4)] == ["a", "b", "c", "a"]


def test_least_load_takes_the_fewest_tokens() -> None:
    policy = Policy(Routing.LEAST_LOAD, BS)
    assert _pick(policy, [Candidate("a", 300), Candidate("b", 299), Candidate("c", 301)]) == "b"


def test_kv_aware_prefers_the_prefix_until_its_load_outweighs_it() -> None:
    policy = Policy(Routing.KV_AWARE, BS)  # a cached block is worth 4 blocks of load by default
    # 8 of 10 blocks cached on b: b saves 8 blocks of prefill, worth 32 blocks (32 * 16 tokens) of load.
    assert _pick(policy, [Candidate("a", 0), Candidate("b", 31 * BS, matched_blocks=8)]) == "b"
    assert _pick(policy, [Candidate("a", 0), Candidate("b", 33 * BS, matched_blocks=8)]) == "a"
    even = Policy(Routing.KV_AWARE, BS, prefix_weight=1.0)
    assert _pick(even, [Candidate("a", 0), Candidate("b", 9 * BS, matched_blocks=8)]) == "a"


def test_a_prefix_every_worker_holds_leaves_the_choice_to_load() -> None:
    """A shared system prompt matched everywhere must not herd: the less loaded worker wins."""
    policy = Policy(Routing.KV_AWARE, BS)
    assert _pick(policy, [Candidate("a", 40, 6), Candidate("b", 20, 6)]) == "b"


def test_ties_go_to_the_less_loaded_then_round_robin() -> None:
    policy = Policy(Routing.KV_AWARE, BS)
    # equal cost: a has 1 more matched block and 4 blocks more load
    assert _pick(policy, [Candidate("a", 4 * BS, 1), Candidate("b", 0, 0)]) == "b"
    even = [Candidate("a", 0), Candidate("b", 0)]
    assert {_pick(policy, even) for _ in range(2)} == {"a", "b"}


def test_a_temperature_spreads_near_equal_workers_reproducibly() -> None:
    def draws(seed: int) -> list[str]:
        policy = Policy(Routing.KV_AWARE, BS, temperature=0.5, seed=seed)
        return [_pick(policy, [Candidate("a", 0, 5), Candidate("b", 0, 4)]) for _ in range(200)]

    counts = Counter(draws(3))
    assert counts["a"] > counts["b"] > 30  # the cheaper one more often, the other still drawn
    assert draws(3) == draws(3)


def test_a_bad_temperature_is_refused() -> None:
    with pytest.raises(ValueError, match="routing temperature must be a finite number >= 0, got -1"):
        Policy(Routing.KV_AWARE, BS, temperature=-1)
