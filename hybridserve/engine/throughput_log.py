"""A periodic log line of what the engine is doing, as long-running servers owe their operators."""

from __future__ import annotations

import logging
import time

from hybridserve.engine.protocol import SchedulerStats

logger = logging.getLogger("hybridserve.engine")


class ThroughputLog:
    def __init__(self, interval_s: float = 10.0) -> None:
        self.interval_s = interval_s
        self._since = time.monotonic()
        self._computed = 0
        self._generated = 0
        self._steps = 0
        self._busy_s = 0.0
        self._drafted = self._accepted = self._drafts = 0  # speculative decoding's counts at the last line

    def record(self, computed_tokens: int, generated_tokens: int, step_s: float) -> None:
        self._computed += computed_tokens
        self._generated += generated_tokens
        self._steps += 1
        self._busy_s += step_s

    def maybe_log(self, stats: SchedulerStats) -> None:
        now = time.monotonic()
        elapsed = now - self._since
        if elapsed < self.interval_s or not self._steps:
            return
        logger.info(
            "engine: %.1f generated tok/s, %.1f computed tok/s, %d steps (%.1f ms avg, busy %.0f%%), running %d, "
            "waiting %d, KV cache %.1f%%, prefix hits %d/%d tokens, state snapshot hits %d, preemptions %d",
            self._generated / elapsed,
            self._computed / elapsed,
            self._steps,
            1000 * self._busy_s / self._steps,
            100 * self._busy_s / elapsed,
            stats.num_running,
            stats.num_waiting,
            100 * stats.kv_cache_usage,
            stats.prefix_cache_hits,
            stats.prefix_cache_queries,
            stats.state_snapshot_hits,
            stats.num_preemptions,
        )
        drafted = stats.spec_decode_num_draft_tokens - self._drafted
        if drafted:
            drafts = stats.spec_decode_num_drafts - self._drafts
            accepted = stats.spec_decode_num_accepted_tokens - self._accepted
            logger.info(
                "speculative decoding: acceptance %.1f%% (%d of %d draft tokens), %.2f tokens per verification "
                "(%d verifications)",
                100 * accepted / drafted,
                accepted,
                drafted,
                1 + accepted / drafts,
                drafts,
            )
        self._drafts = stats.spec_decode_num_drafts
        self._drafted = stats.spec_decode_num_draft_tokens
        self._accepted = stats.spec_decode_num_accepted_tokens
        self._since = now
        self._computed = self._generated = self._steps = 0
        self._busy_s = 0.0
