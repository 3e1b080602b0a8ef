"""The `EngineClient` protocol, and its in-process implementation.

Everything above the protocol (AsyncLLM, the serving layer) works with any implementation and never knows
which one it has: the engine core in this process (tests, the offline API) or the router over one or more
worker processes (hybridserve/router/; the worker's loop is engine/worker.py).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Protocol

from hybridserve.config import EngineConfig
from hybridserve.engine.protocol import (
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineFacts,
    SchedulerStats,
    WorkerStatus,
)

if TYPE_CHECKING:
    from hybridserve.engine.core import EngineCore


class EngineClient(Protocol):
    """The token-level engine as the frontend sees it."""

    @property
    def facts(self) -> EngineFacts:
        """The loaded engine's limits (context length, vocabulary, KV blocks)."""
        ...

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        """Requests added together are served together: the choices of one request, on one worker. Raises
        EngineUnavailable when no worker can take them."""
        ...

    def abort(self, request_ids: list[str]) -> None:
        """Stop the engine's work on these requests; unknown or finished ids are ignored."""
        ...

    async def get_outputs(self) -> EngineCoreOutputs:
        """The next batch of outputs (waits while there is none). Raises once the engine cannot serve."""
        ...

    def stats(self) -> SchedulerStats:
        """The scheduler stats of the latest batch (summed over workers)."""
        ...

    def workers(self) -> list[WorkerStatus]:
        """Each worker's state and stats."""
        ...

    async def check_health(self) -> None:
        """Raises RuntimeError saying why when the engine cannot serve."""
        ...

    def shutdown(self) -> None: ...


def engine_facts(core: EngineCore, config: EngineConfig) -> EngineFacts:
    return EngineFacts(core.max_model_len, core.runner.vocab_size, core.runner.num_blocks, config.cache.block_size)


class InprocEngineClient:
    """The engine core in this process. `get_outputs` runs a step on the caller's thread (so it blocks the
    event loop while it computes): for tests and the offline API, not for a server. A step that raises
    raises to the caller (the worker process instead fails the requests in flight and goes on)."""

    def __init__(self, core: EngineCore, config: EngineConfig) -> None:
        self.core = core
        self._facts = engine_facts(core, config)
        self._stats = SchedulerStats()
        self._work: asyncio.Event | None = None  # set by add_request; made by the waiting loop

    @property
    def facts(self) -> EngineFacts:
        return self._facts

    def add_request(self, request: EngineCoreRequest) -> None:
        self.core.add_request(request)
        if self._work is not None:
            self._work.set()

    async def add_requests(self, requests: list[EngineCoreRequest]) -> None:
        for request in requests:
            self.add_request(request)

    def abort(self, request_ids: list[str]) -> None:
        self.core.abort(request_ids)

    def step(self) -> EngineCoreOutputs:
        outputs = self.core.step()
        if outputs.stats is not None:
            self._stats = outputs.stats
        return outputs

    async def get_outputs(self) -> EngineCoreOutputs:
        while not self.core.has_work():
            self._work = asyncio.Event()
            await self._work.wait()
        await asyncio.sleep(0)  # let the consumers of the previous batch run first
        return self.step()

    def stats(self) -> SchedulerStats:
        return self._stats

    def workers(self) -> list[WorkerStatus]:
        return [WorkerStatus("inproc", "up", None, self._stats)]

    async def check_health(self) -> None:
        return None

    def shutdown(self) -> None:
        return None
