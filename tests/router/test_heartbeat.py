"""Liveness is the transport's, not the engine loop's: a local worker inside one prefill step far longer than
`worker_timeout` stays up (ZeroMQ's I/O thread answers the heartbeats while the step runs) and its request
completes; only a silence past `worker_step_timeout` counts as a hung engine, failing exactly its requests with
a clear error. (A killed or stopped worker going down after `worker_timeout` is tested in test_workers.py.)"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from pathlib import Path

from hybridserve.config import DeploymentConfig, EngineConfig
from hybridserve.engine.async_llm import AsyncLLM
from hybridserve.router.deploy import build_engine
from hybridserve.router.link import WorkerState
from hybridserve.router.router import HEARTBEAT_S
from hybridserve.sampling_params import SamplingParams

# One thread and one step for the whole prompt: a step of seconds against a heartbeat deadline of one. 3,000 tokens
# take ~6 s on an AMX host (1,000 took 1.97 s there, under the 2 s the test needs) and longer on every slower one.
PROMPT_TOKENS = 3000
ENGINE = {"dtype": "float32", "num_threads": 1, "max_num_batched_tokens": 4096, "kv_cache_memory_bytes": 256 * 1024**2}
DEPLOYMENT = DeploymentConfig(num_workers=1, worker_timeout=1.0)
PARAMS = SamplingParams(max_tokens=2, temperature=0.0)


async def _generate(engine: AsyncLLM, prompt: list[int], rid: str) -> tuple[list[int], str | None, float]:
    """Token ids, error, and the longest gap between two outputs (the longest step, at least)."""
    ids: list[int] = []
    start = last = time.monotonic()
    gap = 0.0
    async for update in engine.generate(prompt, PARAMS, rid):
        now = time.monotonic()
        gap, last = max(gap, now - last), now
        ids += update.output.delta_token_ids
        if update.finished:
            return ids, update.output.error, max(gap, last - start)
    raise AssertionError("the stream ended without a finish")


def test_a_step_longer_than_the_heartbeat_deadline_leaves_the_worker_up(smollm2_dir: Path) -> None:
    engine = build_engine(EngineConfig.of(model=str(smollm2_dir), **ENGINE, kv_cache_prefault=False), DEPLOYMENT)
    link = engine.client.links[0]
    prompt = engine.tokenizer.encode("Tell me about the weather in every city you know. " * 400)[:PROMPT_TOKENS]
    other = engine.tokenizer.encode("Name every river you have heard of, and where it flows. " * 400)[:PROMPT_TOKENS]
    assert len(prompt) == len(other) == PROMPT_TOKENS

    async def scenario() -> None:
        ids, error, gap = await _generate(engine, prompt, "long")
        assert error is None and len(ids) == 2
        # longer than the deadline plus a heartbeat tick, or the test proves nothing
        assert gap > DEPLOYMENT.worker_timeout + HEARTBEAT_S, f"the prefill step took only {gap:.2f}s"
        assert link.state is WorkerState.UP and link.failures == 0, link.error

        # The same step against a step timeout shorter than it: the engine counts as hung.
        router = engine.client
        router.settings = dataclasses.replace(router.settings, worker_step_timeout_s=1.0)
        ids, error, _ = await _generate(engine, other, "hung")
        assert error is not None and error.startswith("engine worker local-0 went down: its engine loop answered")
        assert "(step timeout 1s)" in error

    try:
        asyncio.run(asyncio.wait_for(scenario(), 300))
    finally:
        engine.shutdown()
