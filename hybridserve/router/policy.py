"""Routing policies: which worker takes a new request (and every choice of it).

Each policy sees the candidates (workers that are up), each with its load and, for the KV-aware policy, how
many leading blocks of the prompt it holds. Load is counted by the router itself, in the tokens its requests
hold in the worker's KV cache (prompt plus output so far, until each finishes), the moment a request is routed,
not when a worker reports it, so a burst of requests does not all land on the worker that looked idle a moment
ago. (Counting only the prompt tokens a worker must compute looked fairer, but then requests whose prompts a
worker holds cost it almost nothing, and sixteen of them went to one worker while the other idled.)

KV-aware cost, lowest wins: `w * (prompt_blocks - matched_blocks) + load_tokens / block_size`, in KV blocks: the
blocks this worker would have to prefill, weighted, plus the blocks its running requests hold. A prefix every
worker holds (a shared system prompt) cancels out and load decides, so it cannot make one worker win everything;
a prefix only one worker holds wins while that worker's extra load is below w times the prefill it saves. w
(`--routing-prefix-weight`, default 4) is above 1 because a miss costs more than its prefill: the blocks it
fills evict other prefixes, and with w = 1 conversations drifted between workers and both ended up holding
every tenant's prompt (docs/benchmarks.md). Ties go to the less loaded worker, then round robin. With a
temperature above zero, a worker is drawn from the softmax of the costs divided by the largest one (so the
temperature does not depend on prompt length).
docs/deployment.md compares this with the peers' cost functions.
"""

from __future__ import annotations

import enum
import math
import random
from dataclasses import dataclass


class Routing(enum.StrEnum):
    ROUND_ROBIN = "round_robin"
    LEAST_LOAD = "least_load"
    KV_AWARE = "kv_aware"


@dataclass(frozen=True)
class Candidate:
    worker: str
    load_tokens: int
    matched_blocks: int = 0


class Policy:
    """Picks among candidates given in a fixed order (the deployment's worker order)."""

    def __init__(
        self, routing: Routing, block_size: int, temperature: float = 0.0, seed: int = 0, prefix_weight: float = 4.0
    ) -> None:
        if temperature < 0 or not math.isfinite(temperature):
            raise ValueError(f"routing temperature must be a finite number >= 0, got {temperature}")
        self.routing = routing
        self.block_size = block_size
        self.temperature = temperature
        self.prefix_weight = prefix_weight
        self._next = 0  # round-robin position, also the tie-breaker
        self._random = random.Random(seed)

    def pick(self, candidates: list[Candidate], prompt_blocks: int) -> Candidate:
        if not candidates:
            raise ValueError("no worker to route to")
        if self.routing is Routing.ROUND_ROBIN:
            return self._round_robin(candidates)
        if self.routing is Routing.LEAST_LOAD:
            costs = [float(c.load_tokens) for c in candidates]
        else:
            w = self.prefix_weight
            costs = [w * (prompt_blocks - c.matched_blocks) + c.load_tokens / self.block_size for c in candidates]
        if self.temperature > 0 and len(candidates) > 1:
            return self._sample(candidates, costs)
        best = min(costs)
        tied = [c for c, cost in zip(candidates, costs, strict=True) if cost == best]
        least = min(c.load_tokens for c in tied)
        return self._round_robin([c for c in tied if c.load_tokens == least])

    def _round_robin(self, candidates: list[Candidate]) -> Candidate:
        chosen = candidates[self._next % len(candidates)]
        self._next += 1
        return chosen

    def _sample(self, candidates: list[Candidate], costs: list[float]) -> Candidate:
        scale = max(costs) or 1.0
        weights = [math.exp(-(cost / scale) / self.temperature) for cost in costs]
        return self._random.choices(candidates, weights)[0]
